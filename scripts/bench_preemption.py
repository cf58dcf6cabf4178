"""How long a preempted job takes from SIGTERM to a written checkpoint and to its last process's end.

    python scripts/bench_preemption.py --replicas 2 --repeats 5 --out bench_results/preemption.json
    python scripts/bench_preemption.py --stuck --grace 5      # replica 1 stuck in training_step: the deadline path

Each repeat starts a fresh CPU job (``--replicas`` Gloo replicas of a small MLP, ``HeterogeneousStrategy`` with
speeds 1:2:..., ``--workers`` data-loader workers per replica, a short sleep per step so that the signal lands
mid-epoch) in its own process group, waits until every replica has trained ``--ready-step`` steps, sends ``SIGTERM``
to the group and records: seconds until the checkpoint file exists, seconds until the last process of the job ended,
the launcher's exit status and any process left. Writes JSON (rows + medians) and prints the command that made it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # the package without installing it (workers get it through PYTHONPATH)
    sys.path.insert(0, str(REPO))


# ---------------------------------------------------------------------------------------------------- worker
def _worker(out: Path, cfg: dict[str, Any]) -> None:
    import lightning.pytorch as pl
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_het

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 1))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            if cfg["stuck"] and self.global_rank == 1 and self.trainer.global_step >= cfg["ready_step"]:
                (out / "stuck1").write_text(str(os.getpid()))
                while True:
                    time.sleep(1)
            time.sleep(cfg["step_sleep"])
            return nn.functional.mse_loss(self.net(x), y)

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            if self.trainer.global_step == cfg["ready_step"]:
                (out / f"ready{self.global_rank}").write_text(str(os.getpid()))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    pl.seed_everything(0, workers=True, verbose=False)
    replicas = cfg["replicas"]
    strategy = lightning_het.HeterogeneousStrategy(
        speeds=[float(r + 1) for r in range(replicas)], process_group_backend="gloo", preemption_grace=cfg["grace"]
    )
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(4096, 32, generator=g), torch.randn(4096, 1, generator=g))
    loader = DataLoader(data, batch_size=16, shuffle=True, num_workers=cfg["workers"])
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=replicas,
        strategy=strategy,
        max_epochs=100,
        default_root_dir=str(out),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Net(), loader)


# ---------------------------------------------------------------------------------------------------- driver
def _group_members(pgid: int) -> list[int]:
    alive = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[2]) == pgid and fields[0] != "Z":
                    alive.append(int(entry))
    return alive


def _one_run(out: Path, cfg: dict[str, Any], limit: float = 300.0) -> dict[str, Any]:
    shutil.rmtree(out, ignore_errors=True)  # no marker or checkpoint of an earlier run
    out.mkdir(parents=True)
    from lightning_het.cluster.rendezvous import free_port  # torch is imported only when a job starts

    env = {**os.environ, "PYTHONPATH": str(REPO), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    env.pop("LOCAL_RANK", None)
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", str(out), json.dumps(cfg)]
    log = (out / "job.log").open("w")
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        markers = [out / "stuck1"] if cfg["stuck"] else [out / f"ready{r}" for r in range(cfg["replicas"])]
        deadline = time.monotonic() + limit
        while not all(m.exists() for m in markers):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the job never got ready (status {proc.poll()}); see {out / 'job.log'}")
            time.sleep(0.01)
        checkpoint = out / "checkpoints" / "last.ckpt"
        sent = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        saved_s = None
        while _group_members(proc.pid) and time.monotonic() - sent < 120:
            if saved_s is None and checkpoint.exists():
                saved_s = time.monotonic() - sent
            time.sleep(0.005)
        ended_s = time.monotonic() - sent
        if saved_s is None and checkpoint.exists():
            saved_s = ended_s
        survivors = _group_members(proc.pid)
        return {"signal_to_checkpoint_s": saved_s, "signal_to_exit_s": round(ended_s, 3),
                "exit_status": proc.wait(5), "survivors": survivors}  # fmt: skip
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(Path(sys.argv[2]), json.loads(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--workers", type=int, default=1, help="data-loader workers per replica")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ready-step", type=int, default=5, help="steps every replica trains before the signal")
    parser.add_argument("--step-sleep", type=float, default=0.05, help="seconds of sleep per training step")
    parser.add_argument("--grace", type=float, default=25.0, help="preemption_grace")
    parser.add_argument("--stuck", action="store_true", help="replica 1 never reaches the step boundary")
    parser.add_argument("--work-dir", type=Path, default=REPO / "bench_results" / "preemption_runs")
    parser.add_argument("--out", type=Path, default=REPO / "bench_results" / "preemption.json")
    args = parser.parse_args()
    cfg = {"replicas": args.replicas, "workers": args.workers, "ready_step": args.ready_step,
           "step_sleep": args.step_sleep, "grace": args.grace, "stuck": args.stuck}  # fmt: skip
    rows = []
    for i in range(args.repeats):
        row = _one_run(args.work_dir / f"run{i}", cfg)
        rows.append(row)
        print(f"run {i}: {row}", flush=True)
    exits = [r["signal_to_exit_s"] for r in rows]
    saves = [r["signal_to_checkpoint_s"] for r in rows if r["signal_to_checkpoint_s"] is not None]
    result = {
        "config": cfg,
        "rows": rows,
        "median_signal_to_exit_s": statistics.median(exits),
        "max_signal_to_exit_s": max(exits),
        "median_signal_to_checkpoint_s": statistics.median(saves) if saves else None,
        "all_exit_143": all(r["exit_status"] == 143 for r in rows),
        "no_survivors": all(not r["survivors"] for r in rows),
        "load_average_1min": os.getloadavg()[0],
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=2))
    print(f"wrote {args.out}; command: {result['command']}")


if __name__ == "__main__":
    main()
