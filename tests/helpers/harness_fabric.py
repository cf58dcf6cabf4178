"""The harness's ``fabric`` job: a tiny Fabric training loop on several replicas, dumping what each rank saw.

Config keys: devices, strategy (kwargs for
HeterogeneousFabricStrategy), epochs, n (dataset size), batch_size (loader batch size), lr, cost_per_sample_s (seconds
slept per sample in every step, after the forward pass), slow_rank / slow_factor (that rank sleeps ``slow_factor``
times longer), loader_first (set the training loader up before the model), fault (``{"rank": r, "step": k}``: that
rank writes ``OUT_DIR/fault.json`` (pid, time) and hangs for good before its ``k``-th step). Every rank writes its
pid to ``OUT_DIR/pid{r}`` once launched and dumps ``OUT_DIR/rank{r}.pt`` at the end. With
``LIGHTNING_HET_TEST_FLAVOUR=pytorch_lightning`` the loop runs on the standalone ``lightning_fabric``.

Several loops in one job (one launch and rendezvous for all): a JSON list of such configs, all with the same
``devices``; loop ``i`` dumps ``OUT_DIR/<i>/rank{r}.pt``. The first loop's ``Fabric.launch`` starts the replicas and
the process group; each loop has its own strategy, ``Fabric``, model and loader.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from tests.helpers.tiny import FLAVOUR, make_dataset, make_net

if FLAVOUR == "pytorch_lightning":  # the standalone packages: lightning_fabric and our strategy on it
    from lightning_fabric import Fabric

    from lightning_het.pl import HeterogeneousFabricStrategy
else:
    from lightning.fabric import Fabric

    from lightning_het import HeterogeneousFabricStrategy


def fabric(out: Path, cfg: dict) -> None:
    """One training loop as ``cfg`` says; this rank's view goes to ``out/rank{r}.pt``."""
    strategy = HeterogeneousFabricStrategy(process_group_backend="gloo", **cfg.get("strategy", {}))
    fabric = Fabric(accelerator="cpu", devices=cfg.get("devices", 3), strategy=strategy)
    fabric.launch()
    rank = fabric.global_rank
    (out / f"pid{rank}").write_text(str(os.getpid()))
    fault = cfg.get("fault", {})
    cost = cfg.get("cost_per_sample_s", 0.0) * (cfg.get("slow_factor", 1.0) if rank == cfg.get("slow_rank") else 1.0)

    net = make_net()
    loader = DataLoader(make_dataset(cfg.get("n", 60)), batch_size=cfg.get("batch_size", 4), shuffle=True)
    if cfg.get("loader_first"):  # the training loader set up before the model
        loader = fabric.setup_dataloaders(loader)
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=cfg.get("lr", 0.05), momentum=0.9))
    if not cfg.get("loader_first"):
        loader = fabric.setup_dataloaders(loader)

    def loss_of(batch: list[torch.Tensor]) -> torch.Tensor:
        x, y = batch
        out = model(x)
        if cost:
            time.sleep(cost * len(x))  # a slower replica: a fixed cost per sample (inside the timed step)
        return torch.nn.functional.mse_loss(out, y)

    seen = []
    for _ in range(cfg.get("epochs", 2)):
        for batch in loader:
            if fault.get("rank") == rank and len(seen) == fault["step"]:
                (out / "fault.json").write_text(json.dumps({"rank": rank, "pid": os.getpid(), "time": time.time()}))
                while True:
                    time.sleep(3600)
            optimizer.zero_grad()
            fabric.backward(loss_of(batch))
            optimizer.step()
            seen.append(len(batch[0]))
    torch.save(
        {
            "state_dict": {k: v.detach().cpu() for k, v in net.state_dict().items()},
            "seen_batch_sizes": seen,
            "batch_sizes": strategy.batch_sizes,
            "speeds": strategy.speeds,
            "node_ids": strategy.node_ids,
            "loss_scale": strategy.loss_scale,
            "profile_cached": strategy.balance_report()["profile_cached"],
            "comm_mode": strategy.comm_mode,
            "comm_stats": strategy.comm_stats,
        },
        out / f"rank{rank}.pt",
    )
