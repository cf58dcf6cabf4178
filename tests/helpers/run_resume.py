"""Fit with periodic checkpoints, or resume from one: ``python -m tests.helpers.run_resume OUT_DIR JSON``.

JSON keys: ``devices``, ``strategy`` (HeterogeneousStrategy kwargs), ``epochs``, ``n`` (dataset size), ``batch_size``,
``seed``, ``save_every`` (optimizer steps between checkpoints written to ``OUT_DIR/ckpt``), ``resume`` (checkpoint
path), ``max_steps``, ``num_workers``. Every rank dumps ``OUT_DIR/rank{r}.pt`` (weights, batch sizes seen, allocation),
and, at every checkpoint, the weights it holds just before and right after to
``OUT_DIR/{before,saved}_step{s}_rank{r}.pt``.

Several fits in one job (one launch and rendezvous for all): a JSON list of such configs, all with the same
``devices``; fit ``i`` writes all of the above into ``OUT_DIR/<i>``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader

import lightning_het
from tests.helpers.jobs import run_configs
from tests.helpers.tiny import TinyRegressor, make_dataset


class DumpOnSave(Callback):
    """Each rank writes the weights it holds just before ``ModelCheckpoint`` saves (Lightning runs checkpoint callbacks
    last) and when the checkpoint is taken (after the checkpoint captured the weights)."""

    def __init__(self, out: Path, every: int) -> None:
        self.out, self.every = out, every

    def _dump(self, trainer, pl_module, what: str) -> None:
        weights = {k: v.detach().cpu().clone() for k, v in pl_module.net.state_dict().items()}
        torch.save(weights, self.out / f"{what}_step{trainer.global_step}_rank{trainer.global_rank}.pt")

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        if trainer.global_step % self.every == 0:
            self._dump(trainer, pl_module, "before")

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self._dump(trainer, pl_module, "saved")


def run(out: Path, cfg: dict) -> None:
    """One fit as ``cfg`` says, writing into ``out``."""
    pl.seed_everything(cfg.get("seed", 0), workers=True)
    strategy = lightning_het.HeterogeneousStrategy(process_group_backend="gloo", **cfg.get("strategy", {}))
    callbacks = []
    if cfg.get("save_every"):
        every = cfg["save_every"]
        callbacks.append(ModelCheckpoint(out / "ckpt", "{step}", every_n_train_steps=every, save_top_k=-1))
        callbacks.append(DumpOnSave(out, every))
    model = TinyRegressor()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=cfg.get("devices", 2),
        strategy=strategy,
        max_epochs=cfg.get("epochs", 2),
        max_steps=cfg.get("max_steps", -1),
        logger=False,
        callbacks=callbacks,
        enable_checkpointing=bool(callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    loader = DataLoader(
        make_dataset(cfg.get("n", 40)),
        batch_size=cfg.get("batch_size", 4),
        shuffle=True,
        num_workers=cfg.get("num_workers", 0),
    )
    trainer.fit(model, loader, ckpt_path=cfg.get("resume"))
    s = trainer.strategy
    torch.save(
        {
            "state_dict": {k: v.detach().cpu() for k, v in model.net.state_dict().items()},
            "seen_batch_sizes": model.seen_batch_sizes,
            "batch_sizes": s.batch_sizes,
            "speeds": s.speeds,
            "global_step": trainer.global_step,
        },
        out / f"rank{trainer.global_rank}.pt",
    )


def main() -> None:
    run_configs(run, sys.argv[1:3])


if __name__ == "__main__":
    main()
