"""Record the hooks Lightning calls in a tiny fit, validate, test and predict: ``python -m tests.helpers.run_hooks
OUT_DIR JSON``.

JSON is one config or a list of them (run one after another in the same processes, each into ``OUT_DIR/<index>``;
see :func:`tests.helpers.jobs.run_configs`). Keys: ``strategy`` (``"ddp"``, ``"heterogeneous"`` or a dict of
``HeterogeneousStrategy`` keywords), ``devices`` (default 2), ``manual`` (manual optimization, default false).

One ``Trainer`` runs ``fit``, ``validate``, ``test`` and ``predict`` in turn on a fresh model; every rank writes
``rank<r>.json``: for each stage, the calls in order, each ``"module.<hook>"`` or ``"callback.<hook>"`` (``setup`` and
``teardown`` with their stage). The data are sized so that DDP and an even split give every rank the same batches:
16 training samples (batch 2 per rank), 8 validation, test and predict samples each.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.core.hooks import CheckpointHooks, DataHooks, ModelHooks
from torch.utils.data import DataLoader, Dataset

import lightning_het
from tests.helpers.jobs import run_configs

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


def record(out: Path, cfg: dict) -> None:
    pl.seed_everything(0)
    strategy = cfg["strategy"]
    if isinstance(strategy, dict):
        strategy = lightning_het.HeterogeneousStrategy(**strategy)
    calls: list[str] = []
    model = HookedModule(calls, manual=cfg.get("manual", False))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=cfg.get("devices", 2),
        strategy=strategy,
        max_epochs=1,
        callbacks=[HookedCallback(calls)],
        default_root_dir=out,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    recorded = {}
    for stage in STAGES:
        calls.clear()
        getattr(trainer, stage)(model)
        recorded[stage] = list(calls)
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(recorded, indent=1))


if __name__ == "__main__":
    run_configs(record, sys.argv[1:])
