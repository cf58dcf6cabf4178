"""Run a tiny multi-replica fit and dump what each rank saw: ``python -m tests.helpers.run_tiny OUT_DIR JSON``.

JSON keys: devices, num_nodes, strategy (kwargs for HeterogeneousStrategy or the string "heterogeneous"),
epochs, seed, batch_size (loader batch size), n (dataset size), module (kwargs for TinyRegressor),
accelerator (default "cpu"), loader (extra DataLoader kwargs, e.g. num_workers), train_loaders ("dict" or "list": a
second training loader of n2 samples at half the batch size, combined by Lightning).
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

import lightning_het
from tests.helpers.tiny import TinyRegressor, make_dataset


def fit_and_dump(out: Path, cfg: dict) -> None:
    """Fit one tiny model as ``cfg`` says and dump this rank's view into ``out/rank{r}.pt``."""
    pl.seed_everything(cfg.get("seed", 0), workers=True)
    strategy = cfg.get("strategy", {})
    if isinstance(strategy, dict):
        strategy = lightning_het.HeterogeneousStrategy(process_group_backend="gloo", **strategy)
    model = TinyRegressor(**cfg.get("module", {}))
    trainer = pl.Trainer(
        accelerator=cfg.get("accelerator", "cpu"),  # "auto" with a strategy device_map (#8)
        devices=cfg.get("devices", 2),
        num_nodes=cfg.get("num_nodes", 1),
        strategy=strategy,
        max_epochs=cfg.get("epochs", 2),
        accumulate_grad_batches=cfg.get("accumulate", 1),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    loader = DataLoader(
        make_dataset(cfg.get("n", 60)), batch_size=cfg.get("batch_size", 4), shuffle=True, **cfg.get("loader", {})
    )
    if cfg.get("train_loaders"):  # several training loaders ("dict" or "list"): a second one, half the batch size
        second = DataLoader(make_dataset(cfg.get("n2", 30), seed=5), batch_size=max(1, cfg.get("batch_size", 4) // 2))
        loader = {"a": loader, "b": second} if cfg["train_loaders"] == "dict" else [loader, second]
    val_n = cfg.get("val_n", 0)
    val_loader = DataLoader(make_dataset(val_n, seed=99), batch_size=5) if val_n else None
    trainer.fit(model, loader, val_loader)
    s = trainer.strategy
    rank = trainer.global_rank
    torch.save(
        {
            "state_dict": {k: v.detach().cpu() for k, v in model.net.state_dict().items()},
            "seen_batch_sizes": model.seen_batch_sizes,
            "batch_sizes": s.batch_sizes,
            "speeds": s.speeds,
            "node_ids": s.node_ids,
            "loss_scale": s.loss_scale,
            "global_step": trainer.global_step,
            "val_seen": model.val_seen,
            "val_mse": float(trainer.callback_metrics["val/mse"]) if "val/mse" in trainer.callback_metrics else None,
            "root_device": str(s.root_device),
            "num_threads": torch.get_num_threads(),
            "backend": s.process_group_backend,
            "comm_mode": s.comm_mode,
            "comm_stats": s.comm_stats,
            "comm_reduction": s.comm_reduction,
            "cluster_environment": type(s.cluster_environment).__name__,
            "hostname": socket.gethostname(),
            "cost_model": [c.as_dict() for c in s.cost_model] if s.cost_model else None,
            "profile_seconds": s.profile_seconds,
            "profile_cached": s.balance_report()["profile_cached"],
        },
        out / f"rank{rank}.pt",
    )


def main() -> None:
    fit_and_dump(Path(sys.argv[1]), json.loads(sys.argv[2]))


if __name__ == "__main__":
    main()
