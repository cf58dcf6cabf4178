"""Several small fits/validations in one multi-replica job: ``python -m tests.helpers.run_exact OUT_DIR JSON``.

JSON keys: ``devices``, ``speeds`` and ``scenarios`` (names below, run in order in every rank). Every rank writes
``OUT_DIR/rank{r}.pt``: one entry per scenario (weights, batch sizes seen, allocation, logged epoch metrics).

Scenarios (the tests compare each with one process doing the same):

* ``metrics_N``: ``validate`` an untrained model on ``N`` samples logging ``val/loss`` with
  ``self.log(on_epoch=True, sync_dist=True, batch_size=len(batch))``;
* ``tail``: fit 45 samples with global batch 8 (a tail of 5) for 2 epochs;
* ``weighted``: fit with a ``WeightedRandomSampler`` (with replacement, 50 draws) and global batch 8;
* ``batchnorm``: fit a model with ``BatchNorm1d`` at global batch 4;
* ``no_batch_size``: fit a ``DataLoader(batch_size=None)`` with ``global_batch_size=8``;
* ``numpy_global_batch``: fit a data module whose ``global_batch_size`` is a NumPy integer (8; loader batch 2).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, WeightedRandomSampler

from tests.helpers.tiny import HeterogeneousStrategy, TinyRegressor, make_dataset, pl


class LoggingRegressor(TinyRegressor):
    """Logs the batch-mean validation loss the way the app logs its losses."""

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_seen += int(x.shape[0])
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("val/loss", loss, on_step=False, on_epoch=True, sync_dist=True, batch_size=len(x))


class BatchNormRegressor(TinyRegressor):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))


class ArrayDataModule(pl.LightningDataModule):
    def __init__(self) -> None:
        super().__init__()
        self.global_batch_size = np.int64(8)

    def train_dataloader(self):
        return DataLoader(make_dataset(40), batch_size=2, shuffle=True)


def _trainer(devices: int, speeds, epochs: int = 2, **strategy) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=HeterogeneousStrategy(process_group_backend="gloo", speeds=speeds, **strategy),
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )


def _fit(devices, speeds, model, loader=None, datamodule=None, **strategy) -> dict:
    pl.seed_everything(0)
    trainer = _trainer(devices, speeds, **strategy)
    trainer.fit(model, train_dataloaders=loader, datamodule=datamodule)
    return {
        "state_dict": {k: v.detach().cpu().clone() for k, v in model.net.state_dict().items()},
        "seen_batch_sizes": list(model.seen_batch_sizes),
        "batch_sizes": trainer.strategy.batch_sizes,
        "global_step": trainer.global_step,
    }


def run(name: str, devices: int, speeds) -> dict:
    if name.startswith("metrics_"):
        n = int(name.split("_")[1])
        model = LoggingRegressor()
        trainer = _trainer(devices, speeds)
        trainer.validate(model, DataLoader(make_dataset(n, seed=99), batch_size=5), verbose=False)
        return {"val_loss": float(trainer.callback_metrics["val/loss"]), "val_seen": model.val_seen}
    if name == "tail":
        return _fit(devices, speeds, TinyRegressor(), DataLoader(make_dataset(45), batch_size=4, shuffle=True))
    if name == "weighted":
        sampler = WeightedRandomSampler(torch.linspace(0.2, 1.0, 40), 50, replacement=True)
        return _fit(devices, speeds, TinyRegressor(), DataLoader(make_dataset(40), batch_size=4, sampler=sampler))
    if name == "batchnorm":
        loader = DataLoader(make_dataset(40), batch_size=2, shuffle=True)
        return _fit(devices, speeds, BatchNormRegressor(), loader, global_batch_size=4)
    if name == "no_batch_size":
        loader = DataLoader(make_dataset(40), batch_size=None, shuffle=True)
        return _fit(devices, speeds, TinyRegressor(), loader, global_batch_size=8)
    if name == "numpy_global_batch":
        return _fit(devices, speeds, TinyRegressor(), datamodule=ArrayDataModule())
    raise ValueError(name)


def main() -> None:
    out = Path(sys.argv[1])
    cfg = json.loads(sys.argv[2])
    results = {name: run(name, cfg["devices"], cfg["speeds"]) for name in cfg["scenarios"]}
    rank = torch.distributed.get_rank()
    torch.save(results, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
