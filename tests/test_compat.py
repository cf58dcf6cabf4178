"""The private-API adapters of ``lightning_het._compat`` that re-build what Lightning computes."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_het._compat import should_accumulate, training_loaders


class _Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        self.log("val", self.layer(batch[0]).mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_attached_trainer_is_the_modules_trainer_and_none_otherwise() -> None:
    """``None`` for no module, a plain module, a detached LightningModule and one under Fabric (whose ``trainer`` is
    a stand-in); the Trainer once one is attached."""
    from lightning.fabric import Fabric

    from lightning_het._compat import attached_trainer

    module = _Tiny()
    assert attached_trainer(None) is None and attached_trainer(nn.Linear(1, 1)) is None
    assert attached_trainer(module) is None
    trainer = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    module.trainer = trainer
    assert attached_trainer(module) is trainer
    module.trainer = None
    module.fabric = Fabric(accelerator="cpu", devices=1)
    assert attached_trainer(module) is None


class _Accumulating(pl.Callback):
    def __init__(self) -> None:
        self.answers: list[bool] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args) -> None:
        expected = trainer.fit_loop.epoch_loop._should_accumulate()  # the loop's own (private) rule
        assert should_accumulate(trainer) == expected
        self.answers.append(expected)


def test_should_accumulate_answers_as_the_fit_loop_after_every_batch(tmp_path) -> None:
    """Every 3 batches an optimizer step, and one after each epoch's last batch (10 batches: 3, 6, 9, 10)."""
    accumulating = _Accumulating()
    trainer = pl.Trainer(
        max_epochs=2,
        accumulate_grad_batches=3,
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[accumulating],
    )
    trainer.fit(_Tiny(), DataLoader(TensorDataset(torch.randn(40, 4)), batch_size=4))
    epoch = [True, True, False, True, True, False, True, True, False, False]
    assert accumulating.answers == epoch + epoch


class _Loaders(pl.Callback):
    def __init__(self) -> None:
        self.checked = 0

    def on_train_batch_start(self, trainer: pl.Trainer, *args) -> None:
        assert training_loaders(trainer) == trainer.fit_loop._combined_loader.flattened  # the fit loop's own list
        self.checked += 1


class _Pair(_Tiny):
    def training_step(self, batch, batch_idx):
        return super().training_step(batch["a"], batch_idx) + super().training_step(batch["b"][1], batch_idx)


def test_training_loaders_are_the_fit_loops_flattened_loaders(tmp_path) -> None:
    """Nested loaders (a dict holding a list) come flattened in the fit loop's order; ``None`` before a fit."""
    data = TensorDataset(torch.randn(8, 4))
    loaders = {"a": DataLoader(data, batch_size=4), "b": [DataLoader(data, batch_size=2), DataLoader(data)]}
    check = _Loaders()
    trainer = pl.Trainer(
        max_steps=2,
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[check],
    )
    assert training_loaders(trainer) is None
    trainer.fit(_Pair(), loaders)
    assert check.checked == 2 and [loader.batch_size for loader in training_loaders(trainer)] == [4, 2, 1]


def test_record_loader_arguments_wraps_lightnings_loader_preparation_once() -> None:
    from lightning_het._compat import record_loader_arguments

    trainer = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    original = trainer._data_connector._prepare_dataloader
    record_loader_arguments(trainer)
    wrapped = trainer._data_connector._prepare_dataloader
    record_loader_arguments(trainer)
    assert wrapped is not original and trainer._data_connector._prepare_dataloader is wrapped


def test_lightning_skips_callback_hooks_set_to_none() -> None:
    """``batch_hooks`` relies on Lightning's dispatcher calling only callable hooks: a callback whose per-batch hooks
    are ``None`` trains (no ``TypeError``) and its kept hook still runs at every batch."""
    from lightning_het._compat import BATCH_HOOKS, batch_hooks

    @batch_hooks("on_train_batch_end")
    class Counting(pl.Callback):
        def __init__(self) -> None:
            self.ends = 0

        def on_train_batch_end(self, *args) -> None:
            self.ends += 1

    assert all(getattr(Counting, hook) is None for hook in BATCH_HOOKS if hook != "on_train_batch_end")
    counting = Counting()
    data = DataLoader(TensorDataset(torch.randn(12, 4)), batch_size=4)
    trainer = pl.Trainer(
        max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[counting],
    )  # fmt: skip
    trainer.fit(_Tiny(), data, data)
    assert counting.ends == 3
