"""The private Lightning and torch APIs that lightning-het relies on, imported in one place: an upstream change becomes
one clear import-time error naming the missing API; no other module imports a private Lightning or torch name."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any


def _missing_api_error(what: str, err: BaseException) -> ImportError:
    import lightning
    import torch

    return ImportError(
        f"lightning-het needs a private API that this lightning {lightning.__version__} / torch {torch.__version__}"
        f" does not have: {what} ({err}). HINT: install the versions lightning-het supports (`pip install"
        ' "lightning>=2.4,<2.7"`), or report the incompatibility; lightning_het/_compat.py lists every such API.'
    )


# Kept, each without a public equivalent: Lightning's reading of a DataLoader's ``__init__`` arguments (its
# ``_update_dataloader`` changes the sampler only, not the batch size) and their recording (``_replace_dunder_methods``
# around its sampler injection), and torch's default store (no public getter).
try:
    from lightning.fabric.utilities.data import _replace_dunder_methods
    from lightning.pytorch.utilities.data import _get_dataloader_init_args_and_kwargs
    from torch.distributed.distributed_c10d import _get_default_store
except ImportError as err:  # pragma: no cover - only with an untested Lightning/torch release
    raise _missing_api_error("one of the imports of lightning_het/_compat.py", err) from err

#: the private upstream names other modules import from here (tests/test_fence.py reads it)
__all__ = ["_get_dataloader_init_args_and_kwargs", "_get_default_store"]


def _private_attribute(owner: Any, name: str) -> Any:
    try:
        return getattr(owner, name)
    except AttributeError as err:  # pragma: no cover - only with an untested Lightning release
        raise _missing_api_error(f"{type(owner).__qualname__}.{name}", err) from err


def attached_trainer(module: Any) -> Any:
    """The Trainer a LightningModule is attached to, else ``None`` (also under Fabric, and for a plain module)."""
    if module is not None and getattr(module, "fabric", None) is None:
        with contextlib.suppress(RuntimeError):  # not attached to a Trainer
            return getattr(module, "trainer", None)
    return None


def training_loaders(trainer: Any) -> list[Any] | None:
    """The fit loop's training loaders, flattened as its ``CombinedLoader`` does (``None`` before it built them)."""

    def leaves(tree: Any) -> list[Any]:
        tree = list(tree.values()) if isinstance(tree, dict) else tree
        return [leaf for branch in tree for leaf in leaves(branch)] if isinstance(tree, (list, tuple)) else [tree]

    return None if trainer.train_dataloader is None else leaves(trainer.train_dataloader)


def should_accumulate(trainer: Any) -> bool:
    """Whether the batch that just ran only accumulates gradients (no optimizer step follows it): the fit loop's rule,
    from public attributes."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    ready = progress.current.ready
    if ready % trainer.accumulate_grad_batches == 0:
        return False
    last = ready == trainer.num_training_batches or progress.is_last_batch
    return bool(trainer.strategy.handles_gradient_accumulation or not last)


def restore_checkpoint(trainer: Any, path: str) -> None:
    """Load ``path`` as ``trainer.fit(ckpt_path=path)`` would, before the strategy's setup: the model, datamodule and
    callbacks now, the optimizers and loops when the fit restores its training state."""
    _private_attribute(trainer, "_checkpoint_connector")._restore_modules_and_callbacks(path)


def replace_signal_connector(trainer: Any, connector: Any) -> None:
    """Install ``connector`` as the trainer's signal connector (no public hook registers the signal handlers); the fit
    loop's broadcast of the SIGTERM flag, which ``connector`` never sets, is dropped (a collective every step)."""
    _private_attribute(trainer, "_signal_connector")
    trainer._signal_connector = connector
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = lambda: None  # the strategy's replicas agree on signals


_RECORDING: weakref.WeakSet[Callable[..., Any]] = weakref.WeakSet()  # the wrappers record_loader_arguments installed


def record_loader_arguments(trainer: Any) -> None:
    """Make the loader Lightning re-creates around its distributed sampler record its ``__init__`` arguments, so that
    a subclass with arguments of its own can be re-created from the copy (idempotent)."""
    from torch.utils.data import BatchSampler, DataLoader

    connector = _private_attribute(trainer, "_data_connector")
    prepare = _private_attribute(connector, "_prepare_dataloader")
    if prepare in _RECORDING:
        return

    def prepare_recording(*args: Any, **kwargs: Any) -> Any:
        with _replace_dunder_methods(DataLoader, "dataset"), _replace_dunder_methods(BatchSampler):
            return prepare(*args, **kwargs)

    _RECORDING.add(prepare_recording)
    connector._prepare_dataloader = prepare_recording


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the current backward pass has finished (from inside a backward hook)."""
    from torch.autograd import Variable

    Variable._execution_engine.queue_callback(callback)


def wrapped_sampler(sampler: Any) -> Any:
    """The user's sampler inside Lightning's ``DistributedSamplerWrapper``, else ``None``."""
    return getattr(getattr(sampler, "dataset", None), "_sampler", None)


def keep_rank_zero_log() -> None:
    """Send Lightning's rank-zero messages to the logger they went to before ``lightning_het`` was imported (importing
    a Lightning package points ``lightning_utilities``' shared logger at its own), else to ``lightning.pytorch``'s."""
    import logging
    import sys

    from lightning_utilities.core import rank_zero

    names = list(sys.modules)  # in import order
    before = names[: names.index("lightning_het")] if "lightning_het" in names else []
    packages = ("lightning", "pytorch_lightning", "lightning_fabric")
    loggers = [n for n in before if n.endswith(".utilities.rank_zero") and n.split(".")[0] in packages]
    rank_zero.log = logging.getLogger(loggers[-1] if loggers else "lightning.pytorch.utilities.rank_zero")


#: the Callback hooks Lightning calls at every training or evaluation batch
BATCH_HOOKS = (
    "on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
    "on_before_zero_grad", "on_train_batch_end", "on_validation_batch_start", "on_validation_batch_end",
    "on_test_batch_start", "on_test_batch_end", "on_predict_batch_start", "on_predict_batch_end",
)  # fmt: skip


def batch_hooks(*used: str) -> Callable[[type], type]:
    """Class decorator of a Callback mixin: the per-batch hooks it does not use set to ``None``, which Lightning's
    dispatcher skips (it calls a hook only if callable): a callback costs nothing on them (~1 us each, every batch)."""

    def decorate(cls: type) -> type:
        for name in BATCH_HOOKS:
            if name not in used:
                setattr(cls, name, None)
        return cls

    return decorate
