"""The harness's jobs on Lightning's hooks and collectives: the hooks Lightning calls (``hooks``), and the values of
Lightning's collectives in every hook (``collectives``), each to be compared with stock DDP.

``hooks`` config keys: ``strategy`` (``"ddp"``, ``"heterogeneous"`` or a dict of ``HeterogeneousStrategy`` keywords),
``devices`` (default 2), ``manual`` (manual optimization, default false). One ``Trainer`` runs ``fit``, ``validate``,
``test`` and ``predict`` in turn on a fresh model; every rank writes ``rank<r>.json``: for each stage, the calls in
order, each ``"module.<hook>"`` or ``"callback.<hook>"`` (``setup`` and ``teardown`` with their stage). The data are
sized so that DDP and an even split give every rank the same batches: 16 training samples (batch 2 per rank), 8
validation, test and predict samples each.

``collectives`` config keys: ``strategy`` (keywords of ``HeterogeneousStrategy``, or ``"ddp"`` for stock DDP),
``epochs``, ``batches``; the fit logs with ``sync_dist`` and the progress bar is on. Rank 0 writes ``result.json``: the
logged epoch metrics and, per rank, every value ``self.all_gather`` returned.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.core.hooks import CheckpointHooks, DataHooks, ModelHooks
from torch.utils.data import DataLoader, Dataset, TensorDataset

from tests.helpers.harness_parts import make_strategy, make_trainer
from tests.helpers.tiny import pl

STAGES = ("fit", "validate", "test", "predict")


def _public_hooks(*classes: type) -> list[str]:
    return [name for cls in classes for name, value in vars(cls).items() if callable(value) and name[0] != "_"]


#: LightningModule hooks and the step/optimizer methods Lightning calls on the module. `configure_sharded_model` is
#: left out: Lightning refuses a module that overrides it (wrapping counts as overriding).
MODULE_HOOKS = [
    name for name in _public_hooks(ModelHooks, DataHooks, CheckpointHooks) if name != "configure_sharded_model"
] + [
    "configure_optimizers",
    "configure_callbacks",
    "configure_gradient_clipping",
    "training_step",
    "validation_step",
    "test_step",
    "predict_step",
    "backward",
    "optimizer_step",
    "optimizer_zero_grad",
    "lr_scheduler_step",
]
CALLBACK_HOOKS = _public_hooks(pl.Callback)


def _wrap(owner: object, prefix: str, names: list[str], calls: list[str]) -> None:
    """Replace each hook of ``owner`` by one that appends its name to ``calls`` and then runs it."""
    for name in names:
        original = getattr(owner, name)

        def hook(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
            stage = kwargs.get("stage", args[-1] if _name in ("setup", "teardown") and args else None)
            stage = getattr(stage, "value", stage)  # TrainerFn.FITTING -> "fit"
            calls.append(f"{prefix}.{_name}" + (f"({stage})" if stage is not None else ""))
            return _original(*args, **kwargs)

        object.__setattr__(owner, name, hook)


class _Data(Dataset):
    def __init__(self, n: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 4, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.x[index]


class HookedModule(pl.LightningModule):
    def __init__(self, calls: list[str], manual: bool) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.automatic_optimization = not manual
        _wrap(self, "module", MODULE_HOOKS, calls)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor | None:
        loss = self.layer(batch).pow(2).mean()
        if self.automatic_optimization:
            return loss
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        return None

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self.layer(batch).pow(2).mean(), batch_size=len(batch))

    def test_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("test_loss", self.layer(batch).pow(2).mean(), batch_size=len(batch))

    def predict_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.layer(batch)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.layer.parameters(), lr=0.1)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)]

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_Data(16, 0), batch_size=2, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(_Data(8, 1), batch_size=2)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(_Data(8, 2), batch_size=2)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(_Data(8, 3), batch_size=2)


class HookedCallback(pl.Callback):
    def __init__(self, calls: list[str]) -> None:
        _wrap(self, "callback", CALLBACK_HOOKS, calls)


def hooks(out: Path, cfg: dict) -> None:
    pl.seed_everything(0)
    calls: list[str] = []
    model = HookedModule(calls, manual=cfg.get("manual", False))
    trainer = make_trainer(
        cfg.get("devices", 2),
        make_strategy(cfg["strategy"], gloo=False),
        max_epochs=1,
        callbacks=[HookedCallback(calls)],
        default_root_dir=out,
        enable_checkpointing=True,
        num_sanity_val_steps=None,
    )
    recorded = {}
    for stage in STAGES:
        calls.clear()
        getattr(trainer, stage)(model)
        recorded[stage] = list(calls)
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(recorded, indent=1))


# ---------------------------------------------------------------------------------------------------- collectives
class Chatty(pl.LightningModule):
    """Logs with ``sync_dist`` on step and on epoch and all-gathers a scalar where stock DDP allows it (not in
    ``on_train_epoch_end``, where rank 0's progress bar reduces the epoch metrics alone, under DDP too)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.gathered: list[list[float]] = []

    def _gather(self, name: str) -> None:
        value = self.all_gather(torch.tensor(float(self.global_rank + 1)))
        self.gathered.append([name, *value.tolist()])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train_epoch_loss", loss, on_step=False, on_epoch=True, sync_dist=True, prog_bar=True)
        self.log("train_step_loss", loss, on_step=True, on_epoch=False, sync_dist=True, prog_bar=True)
        return loss

    def on_train_epoch_start(self) -> None:
        self._gather("on_train_epoch_start")

    def on_train_end(self) -> None:
        self._gather("on_train_end")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def collectives(out: Path, cfg: dict[str, Any]) -> None:
    pl.seed_everything(0)
    batches, world = cfg.get("batches", 3), 2
    data = TensorDataset(torch.randn(8 * batches, 4), torch.randn(8 * batches, 1))
    model = Chatty()
    trainer = make_trainer(
        world,
        make_strategy(cfg.get("strategy", {}), gloo=False, timeout=30),
        max_epochs=cfg.get("epochs", 2),
        enable_progress_bar=True,
        default_root_dir=out,
        num_sanity_val_steps=None,
    )
    trainer.fit(model, DataLoader(data, batch_size=4))
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    ranks = [None] * world
    torch.distributed.all_gather_object(ranks, model.gathered)
    if trainer.is_global_zero:
        (out / "result.json").write_text(json.dumps({"metrics": metrics, "gathered": ranks}))
