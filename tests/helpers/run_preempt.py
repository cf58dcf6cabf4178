"""A fit to be preempted, or resumed: ``python -m tests.helpers.run_preempt OUT_DIR JSON``.

JSON keys: ``devices``, ``strategy`` (HeterogeneousStrategy kwargs), ``epochs``, ``n`` (dataset size),
``batch_size``, ``seed``, ``step_cost`` (seconds of sleep per sample in ``training_step``), ``num_workers``,
``ckpt_dir`` (a ``ModelCheckpoint`` writing there every 1000 steps, so only its directory matters), ``resume``
(checkpoint path), ``ready_step`` (each rank writes ``OUT_DIR/ready{r}`` holding its pid once ``global_step`` reaches
it), ``stuck_rank`` / ``stuck_step`` (that rank writes ``OUT_DIR/stuck{r}`` and sleeps for good in ``training_step``
from that step on).

The default root directory is ``OUT_DIR``. Every rank that finishes dumps ``OUT_DIR/rank{r}.pt`` (weights, global
step); the launching process prints the exit statuses of the replicas it launched when it ends.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from tests.helpers.tiny import HeterogeneousStrategy, TinyRegressor, make_dataset, pl

Callback, ModelCheckpoint = pl.callbacks.Callback, pl.callbacks.ModelCheckpoint


class Ready(Callback):
    """Tell the test that training reached ``step`` (so that the signal lands mid-run)."""

    def __init__(self, out: Path, step: int) -> None:
        self.out, self.step, self.done = out, step, False

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        if not self.done and trainer.global_step >= self.step:
            self.done = True
            tmp = self.out / f".ready{trainer.global_rank}"
            tmp.write_text(str(os.getpid()))
            tmp.rename(self.out / f"ready{trainer.global_rank}")


class Stuck(TinyRegressor):
    def __init__(self, out: Path, stuck_rank: int, stuck_step: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.out, self.stuck_rank, self.stuck_step = out, stuck_rank, stuck_step

    def training_step(self, batch, batch_idx):
        if self.global_rank == self.stuck_rank and self.trainer.global_step >= self.stuck_step:
            (self.out / f"stuck{self.global_rank}").write_text(str(os.getpid()))
            while True:  # a replica that never reaches the step boundary
                time.sleep(1)
        return super().training_step(batch, batch_idx)


def _report_children(trainer: pl.Trainer) -> None:
    procs = getattr(trainer.strategy.launcher, "procs", None) or []
    codes = [p.poll() for p in procs]
    print(f"launched replicas ended with {codes}", flush=True)


def main() -> None:
    out = Path(sys.argv[1])
    cfg = json.loads(sys.argv[2])
    pl.seed_everything(cfg.get("seed", 0), workers=True)
    strategy = HeterogeneousStrategy(process_group_backend="gloo", **cfg.get("strategy", {}))
    kwargs = {"cost_per_sample_s": cfg.get("step_cost", 0.0)}
    stuck = "stuck_rank" in cfg
    model = Stuck(out, cfg["stuck_rank"], cfg["stuck_step"], **kwargs) if stuck else TinyRegressor(**kwargs)
    callbacks: list[Callback] = []
    if cfg.get("ready_step") is not None:
        callbacks.append(Ready(out, cfg["ready_step"]))
    if cfg.get("ckpt_dir"):
        callbacks.append(ModelCheckpoint(cfg["ckpt_dir"], "{step}", every_n_train_steps=1000))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=cfg.get("devices", 2),
        strategy=strategy,
        max_epochs=cfg.get("epochs", 2),
        default_root_dir=str(out),
        logger=False,
        callbacks=callbacks,
        enable_checkpointing=bool(cfg.get("ckpt_dir")),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    if trainer.global_rank == 0:
        atexit.register(_report_children, trainer)
    loader = DataLoader(
        make_dataset(cfg.get("n", 80)),
        batch_size=cfg.get("batch_size", 4),
        shuffle=True,
        num_workers=cfg.get("num_workers", 0),
        persistent_workers=bool(cfg.get("num_workers", 0)),
    )
    trainer.fit(model, loader, ckpt_path=cfg.get("resume"))
    torch.save(
        {
            "state_dict": {k: v.detach().cpu() for k, v in model.net.state_dict().items()},
            "global_step": trainer.global_step,
            "seen_batch_sizes": model.seen_batch_sizes,
        },
        out / f"rank{trainer.global_rank}.pt",
    )


if __name__ == "__main__":
    main()
