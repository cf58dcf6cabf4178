"""A tiny fit with telemetry and a CSV logger: ``python -m tests.helpers.run_balance OUT_DIR JSON``.

JSON keys: devices, strategy (kwargs for HeterogeneousStrategy), epochs, n (dataset size), batch_size (loader batch
size), module (kwargs for TinyRegressor: ``cost_per_sample_s``, ``slow_factor``, ``slow_rank``),
``slow_from_epoch`` (``slow_factor`` applies to ``slow_rank`` from that epoch on; default 0), and
``sleep_counts_as_cpu`` (the process CPU clock reads the wall clock, so ``emulate_slowdown`` stretches the module's
sleeps as if they were computation, whatever the machine's load).
Each rank dumps ``rank{r}.pt``: weights, the batch size of every step, the balance report (with the step series) and
the paths of the report files.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

import lightning_het
from tests.helpers.tiny import TinyRegressor, make_dataset


class ScheduledRegressor(TinyRegressor):
    """``TinyRegressor`` whose ``slow_rank`` becomes ``slow_factor`` times slower from ``slow_from_epoch`` on."""

    def __init__(self, slow_from_epoch: int = 0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.target_factor = self.slow_factor
        self.slow_from_epoch = slow_from_epoch

    def on_train_epoch_start(self) -> None:
        self.slow_factor = self.target_factor if self.current_epoch >= self.slow_from_epoch else 1.0


def main() -> None:
    out = Path(sys.argv[1])
    cfg = json.loads(sys.argv[2])
    if cfg.get("sleep_counts_as_cpu"):
        time.process_time = time.perf_counter
    pl.seed_everything(cfg.get("seed", 0), workers=True)
    strategy = lightning_het.HeterogeneousStrategy(process_group_backend="gloo", **cfg.get("strategy", {}))
    model = ScheduledRegressor(slow_from_epoch=cfg.get("slow_from_epoch", 0), **cfg.get("module", {}))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=cfg.get("devices", 2),
        strategy=strategy,
        max_epochs=cfg.get("epochs", 2),
        logger=CSVLogger(out, name="logs", version=0),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    loader = DataLoader(make_dataset(cfg.get("n", 64)), batch_size=cfg.get("batch_size", 8), shuffle=True)
    trainer.fit(model, loader)
    s = trainer.strategy
    monitor = s._monitor
    torch.save(
        {
            "state_dict": {k: v.detach().cpu() for k, v in model.net.state_dict().items()},
            "seen_batch_sizes": model.seen_batch_sizes,
            "batch_sizes": s.batch_sizes,
            "loss_scale": s.loss_scale,
            "report": s.balance_report(include_series=True),
            "report_paths": {k: str(v) for k, v in (monitor.report_paths if monitor else {}).items()},
            "log_dir": trainer.log_dir,
        },
        out / f"rank{trainer.global_rank}.pt",
    )


def run_balance_job(out: Path, cfg: dict, *, timeout: float = 180) -> list[dict]:
    """Run this module as a multi-process job writing into ``out``; return the per-rank dumps."""
    from tests.conftest import run_job

    result = run_job(["-m", "tests.helpers.run_balance", str(out), json.dumps(cfg)], timeout=timeout)
    assert result.returncode == 0, result.stdout[-6000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(cfg.get("devices", 2))]


if __name__ == "__main__":
    main()
