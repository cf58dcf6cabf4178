"""Per-step collectives in evaluation and training steps with uneven shares: ``python -m tests.helpers.run_eval_sync
OUT_DIR JSON``.

JSON keys: ``devices`` and ``speeds``. Every rank runs, in order:

* ``validate`` and ``test`` of an untrained model on 41 samples (loader batch 5), whose evaluation step logs
  ``self.log(..., on_step=True, sync_dist=True)`` every step, an epoch mean weighted by ``batch_size``, and gathers the
  batch's targets with ``self.all_gather``;
* ``predict`` on the same samples (Lightning's own split), recording the dataset indices of each batch;
* ``fit`` for 2 epochs (40 training samples, global batch 8, validation on the same 41 samples, sanity check of 2
  batches), gathering each training batch's inputs with ``self.all_gather``.

Every rank writes ``OUT_DIR/rank{r}.pt``: batch sizes seen, gathered targets and shapes, logged values and dtypes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from torch import nn
from torch.utils.data import DataLoader

import lightning_het
from tests.helpers.tiny import TinyRegressor, make_dataset


class StepSyncRegressor(TinyRegressor):
    def __init__(self) -> None:
        super().__init__()
        self.eval_batches: list[int] = []
        self.eval_gathered: list[torch.Tensor] = []
        self.train_gathered_shapes: list[tuple[int, ...]] = []
        self.train_gathered_ok = True

    def _eval_step(self, batch, prefix: str):
        x, y = batch
        self.eval_batches.append(int(x.shape[0]))
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log(f"{prefix}/step_loss", loss, on_step=True, on_epoch=False, sync_dist=True, batch_size=len(x))
        self.log(f"{prefix}/loss", loss, on_step=False, on_epoch=True, sync_dist=True, batch_size=len(x))
        self.eval_gathered.append(self.all_gather(y.squeeze(1)).reshape(-1).cpu())

    def validation_step(self, batch, batch_idx):
        self._eval_step(batch, "val")

    def test_step(self, batch, batch_idx):
        self._eval_step(batch, "test")

    def predict_step(self, batch, batch_idx):
        return batch[1].squeeze(1)

    def training_step(self, batch, batch_idx):
        x, _ = batch
        gathered = self.all_gather({"x": x, "n": torch.tensor(len(x))})
        self.train_gathered_shapes.append(tuple(gathered["x"].shape))
        # the gathered inputs are the replicas' batches in rank order: this replica's rows sit after the lower ranks'
        offset = int(gathered["n"][: self.global_rank].sum())
        self.train_gathered_ok &= bool(torch.equal(gathered["x"][offset : offset + len(x)], x))
        self.train_gathered_ok &= int(gathered["n"].sum()) == gathered["x"].shape[0]
        return super().training_step(batch, batch_idx)


class IndexWriter(BasePredictionWriter):
    """Records each prediction batch with the dataset indices Lightning tracks for prediction writers."""

    def __init__(self) -> None:
        super().__init__(write_interval="batch")
        self.indices: list[int] = []
        self.predictions: list[torch.Tensor] = []

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        self.indices.extend(batch_indices)
        self.predictions.append(prediction)


def _trainer(devices: int, speeds, progress_bar: bool = True, **kwargs) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=lightning_het.HeterogeneousStrategy(process_group_backend="gloo", speeds=speeds),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=progress_bar,
        enable_model_summary=False,
        **kwargs,
    )


def _eval_record(model: StepSyncRegressor, trainer: pl.Trainer, prefix: str) -> dict:
    metric = trainer.callback_metrics[f"{prefix}/loss"]
    record = {
        "batches": list(model.eval_batches),
        "gathered": torch.cat(model.eval_gathered) if model.eval_gathered else torch.empty(0),
        "loss": float(metric),
        "loss_dtype": metric.dtype,
    }
    model.eval_batches.clear()
    model.eval_gathered.clear()
    return record


def main() -> None:
    out = Path(sys.argv[1])
    cfg = json.loads(sys.argv[2])
    devices, speeds = cfg["devices"], cfg["speeds"]
    val = DataLoader(make_dataset(41, seed=99), batch_size=5)
    results: dict = {}
    model = StepSyncRegressor()
    trainer = _trainer(devices, speeds)
    trainer.validate(model, val, verbose=False)
    results["validate"] = _eval_record(model, trainer, "val")
    trainer.test(model, val, verbose=False)
    results["test"] = _eval_record(model, trainer, "test")
    writer = IndexWriter()
    trainer = _trainer(devices, speeds, callbacks=[writer])
    trainer.predict(model, val, return_predictions=False)
    results["predict"] = {"indices": writer.indices, "predictions": torch.cat(writer.predictions)}

    pl.seed_everything(0)
    model = StepSyncRegressor()
    # progress bar off here: rank 0's bar computes the `sync_dist` training metric at `on_train_epoch_end`, where the
    # balance monitor's epoch-end gather runs on the other ranks (a rank-0-only collective, not about evaluation)
    trainer = _trainer(devices, speeds, progress_bar=False, max_epochs=2, num_sanity_val_steps=2)
    train = DataLoader(make_dataset(40), batch_size=4, shuffle=True)
    trainer.fit(model, train, val)
    results["fit"] = {
        "eval_batches": list(model.eval_batches),  # sanity check (2 batches), then 2 validation epochs
        "train_shapes": model.train_gathered_shapes,
        "train_gathered_ok": model.train_gathered_ok,
        "batch_sizes": trainer.strategy.batch_sizes,
        "val_loss_dtype": trainer.callback_metrics["val/loss"].dtype,
        "train_loss_dtype": trainer.callback_metrics["train/loss"].dtype,
    }
    torch.save(results, out / f"rank{torch.distributed.get_rank()}.pt")


if __name__ == "__main__":
    main()
