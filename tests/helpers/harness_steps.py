"""The harness's step-level jobs: profiled fits that check Lightning's contract in the loop (``inloop``), small
fits and validations compared with one process (``exact``), and per-step collectives in evaluation (``eval_sync``).

``inloop`` config keys: ``devices`` (2), ``epochs`` (2), ``n`` (320), ``batch_size`` (16, per replica), ``manual``
(manual optimization), ``gan`` (manual optimization of two networks, one per backward), ``strategy`` (extra
``HeterogeneousStrategy`` keywords), ``loader`` (extra ``DataLoader`` keywords), ``limit_train_batches``,
``cost_per_sample_s`` (seconds slept per sample, stretched by ``emulate_slowdown``). Every rank dumps
``OUT_DIR/rank{r}.pt``: the batch size and the synchronised gradient of every step, hook counts, what
``training_step`` found missing, the allocation.

``exact`` config keys: ``devices``, ``speeds`` and ``scenarios`` (run in order in every rank). Every rank writes
``OUT_DIR/rank{r}.pt``: one entry per scenario (weights, batch sizes seen, allocation, logged epoch metrics).
Scenarios (the tests compare each with one process doing the same):

* ``metrics_N``: ``validate`` an untrained model on ``N`` samples logging ``val/loss`` with
  ``self.log(on_epoch=True, sync_dist=True, batch_size=len(batch))``;
* ``tail``: fit 45 samples with global batch 8 (a tail of 5) for 2 epochs;
* ``weighted``: fit with a ``WeightedRandomSampler`` (with replacement, 50 draws) and global batch 8;
* ``batchnorm``: fit a model with ``BatchNorm1d`` at global batch 4;
* ``no_batch_size``: fit a ``DataLoader(batch_size=None)`` with ``global_batch_size=8``;
* ``numpy_global_batch``: fit a data module whose ``global_batch_size`` is a NumPy integer (8; loader batch 2).

``eval_sync`` config keys: ``devices`` and ``speeds``. Every rank runs, in order:

* ``validate`` and ``test`` of an untrained model on 41 samples (loader batch 5), whose evaluation step logs
  ``self.log(..., on_step=True, sync_dist=True)`` every step, an epoch mean weighted by ``batch_size``, and gathers the
  batch's targets with ``self.all_gather``;
* ``predict`` on the same samples (Lightning's own split), recording the dataset indices of each batch;
* ``fit`` for 2 epochs (40 training samples, global batch 8, validation on the same 41 samples, sanity check of 2
  batches), gathering each training batch's inputs with ``self.all_gather``.

Every rank writes ``OUT_DIR/rank{r}.pt``: batch sizes seen, gathered targets and shapes, logged values and dtypes.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, WeightedRandomSampler

from tests.helpers.harness_parts import make_strategy, make_trainer, save_rank, train_loader, weights
from tests.helpers.tiny import TinyRegressor, make_dataset, make_net, pl


# ---------------------------------------------------------------------------------------------------- inloop
class ContractModule(pl.LightningModule):
    """``training_step(self, batch)`` without ``batch_idx``; state made in ``on_train_start`` and
    ``on_train_epoch_start``; counts its hooks; records every step's batch size and synchronised gradient."""

    def __init__(self, cost_per_sample_s: float = 0.0, manual: bool = False, gan: bool = False) -> None:
        super().__init__()
        self.net = make_net()
        self.frozen = nn.Dropout(0.5).eval()  # a frozen submodule: Lightning keeps it in eval() mode
        self.gan = gan  # manual optimization of two networks, each backward reaching one of them
        self.disc = make_net(seed=8) if gan else None
        self.cost_per_sample_s = cost_per_sample_s
        self.automatic_optimization = not manual
        self.counts = {"training_step": 0, "on_before_backward": 0, "on_after_backward": 0, "on_train_batch_end": 0}
        self.problems: list[str] = []
        self.batch_sizes: list[int] = []
        self.grads: list[torch.Tensor] = []

    def on_train_start(self) -> None:
        self.started = torch.zeros(1)

    def on_train_epoch_start(self) -> None:
        self.epoch_state = self.current_epoch

    def training_step(self, batch):
        self.counts["training_step"] += 1
        if not hasattr(self, "started") or getattr(self, "epoch_state", None) != self.current_epoch:
            self.problems.append(f"step {self.counts['training_step']}: state from on_train_start missing")
        if self.trainer.train_dataloader is None:
            self.problems.append("trainer.train_dataloader is None")
        if self.frozen.training:
            self.problems.append(f"step {self.counts['training_step']}: the frozen submodule was put in train mode")
        x, y = batch
        self.batch_sizes.append(int(x.shape[0]))
        if self.cost_per_sample_s:  # a sleep, which the job's clock counts as compute (see `inloop`)
            time.sleep(self.cost_per_sample_s * x.shape[0])
        loss = nn.functional.mse_loss(self.net(x), y)
        if self.gan:
            opt_g, opt_d = self.optimizers()
            opt_g.zero_grad()
            self.manual_backward(loss)  # the second network gets no gradient: find_unused_parameters=True
            self._record_grad()
            opt_g.step()
            opt_d.zero_grad()
            self.manual_backward(nn.functional.mse_loss(self.disc(x), y))
            opt_d.step()
            return None
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            self._record_grad()
            opt.step()
            return None
        return loss

    def on_before_backward(self, loss) -> None:
        self.counts["on_before_backward"] += 1

    def on_after_backward(self) -> None:
        self.counts["on_after_backward"] += 1

    def on_before_optimizer_step(self, optimizer) -> None:
        if self.automatic_optimization:
            self._record_grad()

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.counts["on_train_batch_end"] += 1

    def _record_grad(self) -> None:
        self.grads.append(torch.cat([p.grad.detach().flatten().clone() for p in self.net.parameters()]))

    def configure_optimizers(self):
        if self.gan:
            return [
                torch.optim.SGD(self.net.parameters(), lr=0.05, momentum=0.9),
                torch.optim.SGD(self.disc.parameters(), lr=0.05, momentum=0.9),
            ]
        return torch.optim.SGD(self.net.parameters(), lr=0.05, momentum=0.9)


def inloop(out: Path, cfg: dict) -> None:
    # the module's per-sample cost is a sleep, not CPU work: on a busy machine it keeps its length, and
    # `emulate_slowdown` stretches it once the process CPU clock reads the wall clock
    time.process_time = time.perf_counter
    pl.seed_everything(0)
    model = ContractModule(cfg.get("cost_per_sample_s", 0.0), cfg.get("manual", False), cfg.get("gan", False))
    trainer = make_trainer(
        cfg.get("devices", 2),
        make_strategy(cfg.get("strategy", {})),
        max_epochs=cfg.get("epochs", 2),
        limit_train_batches=cfg.get("limit_train_batches"),
    )
    trainer.fit(model, train_loader(cfg, 320, 16))
    s = trainer.strategy
    save_rank(
        out,
        trainer.global_rank,
        {
            "batch_sizes_seen": model.batch_sizes,
            "grads": model.grads,
            "counts": model.counts,
            "problems": model.problems,
            "global_step": trainer.global_step,
            "batch_sizes": s.batch_sizes,
            "cost_model": [c.as_dict() for c in s.cost_model] if s.cost_model else None,
            "profile_seconds": s.profile_seconds,
            "state_dict": weights(model.net),
        },
    )


# ---------------------------------------------------------------------------------------------------- exact
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


def _exact_trainer(devices: int, speeds, **strategy) -> pl.Trainer:
    return make_trainer(devices, make_strategy(strategy, speeds=speeds), max_epochs=2)


def _exact_fit(devices, speeds, model, loader=None, datamodule=None, **strategy) -> dict:
    pl.seed_everything(0)
    trainer = _exact_trainer(devices, speeds, **strategy)
    trainer.fit(model, train_dataloaders=loader, datamodule=datamodule)
    return {
        "state_dict": weights(model.net),
        "seen_batch_sizes": list(model.seen_batch_sizes),
        "batch_sizes": trainer.strategy.batch_sizes,
        "global_step": trainer.global_step,
    }


def _scenario(name: str, devices: int, speeds) -> dict:
    if name.startswith("metrics_"):
        n = int(name.split("_")[1])
        model = LoggingRegressor()
        trainer = _exact_trainer(devices, speeds)
        trainer.validate(model, DataLoader(make_dataset(n, seed=99), batch_size=5), verbose=False)
        return {"val_loss": float(trainer.callback_metrics["val/loss"]), "val_seen": model.val_seen}
    if name == "tail":
        return _exact_fit(devices, speeds, TinyRegressor(), DataLoader(make_dataset(45), batch_size=4, shuffle=True))
    if name == "weighted":
        sampler = WeightedRandomSampler(torch.linspace(0.2, 1.0, 40), 50, replacement=True)
        loader = DataLoader(make_dataset(40), batch_size=4, sampler=sampler)
        return _exact_fit(devices, speeds, TinyRegressor(), loader)
    if name == "batchnorm":
        loader = DataLoader(make_dataset(40), batch_size=2, shuffle=True)
        return _exact_fit(devices, speeds, BatchNormRegressor(), loader, global_batch_size=4)
    if name == "no_batch_size":
        loader = DataLoader(make_dataset(40), batch_size=None, shuffle=True)
        return _exact_fit(devices, speeds, TinyRegressor(), loader, global_batch_size=8)
    if name == "numpy_global_batch":
        return _exact_fit(devices, speeds, TinyRegressor(), datamodule=ArrayDataModule())
    raise ValueError(name)


def exact(out: Path, cfg: dict) -> None:
    results = {name: _scenario(name, cfg["devices"], cfg["speeds"]) for name in cfg["scenarios"]}
    save_rank(out, torch.distributed.get_rank(), results)


# ---------------------------------------------------------------------------------------------------- eval_sync
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


class IndexWriter(pl.callbacks.BasePredictionWriter):
    """Records each prediction batch with the dataset indices Lightning tracks for prediction writers."""

    def __init__(self) -> None:
        super().__init__(write_interval="batch")
        self.indices: list[int] = []
        self.predictions: list[torch.Tensor] = []

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        self.indices.extend(batch_indices)
        self.predictions.append(prediction)


def _eval_trainer(devices: int, speeds, progress_bar: bool = True, **kwargs) -> pl.Trainer:
    kwargs = {"enable_progress_bar": progress_bar, "num_sanity_val_steps": None, **kwargs}
    return make_trainer(devices, make_strategy({"speeds": speeds}), **kwargs)


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


def eval_sync(out: Path, cfg: dict) -> None:
    devices, speeds = cfg["devices"], cfg["speeds"]
    val = DataLoader(make_dataset(41, seed=99), batch_size=5)
    results: dict = {}
    model = StepSyncRegressor()
    trainer = _eval_trainer(devices, speeds)
    trainer.validate(model, val, verbose=False)
    results["validate"] = _eval_record(model, trainer, "val")
    trainer.test(model, val, verbose=False)
    results["test"] = _eval_record(model, trainer, "test")
    writer = IndexWriter()
    trainer = _eval_trainer(devices, speeds, callbacks=[writer])
    trainer.predict(model, val, return_predictions=False)
    results["predict"] = {"indices": writer.indices, "predictions": torch.cat(writer.predictions)}

    pl.seed_everything(0)
    model = StepSyncRegressor()
    # progress bar off here: rank 0's bar computes the `sync_dist` training metric at `on_train_epoch_end`, where the
    # balance monitor's epoch-end gather runs on the other ranks (a rank-0-only collective, not about evaluation)
    trainer = _eval_trainer(devices, speeds, progress_bar=False, max_epochs=2, num_sanity_val_steps=2)
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
    save_rank(out, torch.distributed.get_rank(), results)
