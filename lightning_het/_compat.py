"""The private Lightning and torch APIs that lightning-het relies on, imported in one place.

Behind one guard, an upstream change becomes one clear import-time error naming the missing API; no other module
imports a private Lightning or torch name.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Callable, Iterator
from datetime import timedelta
from types import ModuleType
from typing import Any


def _missing_api_error(what: str, err: BaseException) -> ImportError:
    import lightning
    import torch

    return ImportError(
        f"lightning-het needs a private API that this lightning {lightning.__version__} / torch {torch.__version__}"
        f" does not have: {what} ({err}). HINT: install the versions lightning-het supports (`pip install"
        ' "lightning>=2.4,<2.7"`), or report the incompatibility; lightning_het/_compat.py lists every such API.'
    )


# Kept, each without a public equivalent: Lightning's
# DataLoader re-instantiation with changed arguments (``_update_dataloader`` takes a new sampler only), and torch's
# default store and default-group timeout (no public getter/setter for an existing group).
try:
    from lightning.fabric.utilities.data import _reinstantiate_wrapped_cls, _replace_dunder_methods
    from lightning.pytorch.utilities.data import _get_dataloader_init_args_and_kwargs
    from torch.distributed.distributed_c10d import _get_default_store, _set_pg_timeout
except ImportError as err:  # pragma: no cover - only with an untested Lightning/torch release
    raise _missing_api_error("one of the imports of lightning_het/_compat.py", err) from err

__all__ = [
    "_get_dataloader_init_args_and_kwargs",
    "_reinstantiate_wrapped_cls",
    "_replace_dunder_methods",
    "attached_trainer",
    "broadcast_ddp_buffers",
    "cached_validation_loader",
    "ddp_forward_skippable",
    "default_store",
    "forget_validation_loader",
    "inside_fabric_backward",
    "inside_log_sync",
    "logged_batch",
    "queue_backward_callback",
    "record_loader_arguments",
    "replace_signal_connector",
    "restore_checkpoint",
    "set_default_group_timeout",
    "should_accumulate",
    "skip_buffer_broadcast",
    "training_loaders",
    "uses_distributed_sampler",
    "wrapped_sampler",
]


def default_store() -> object:
    """The ``torch.distributed.Store`` of the default process group (it must exist; torch has no public getter)."""
    return _get_default_store()


def set_default_group_timeout(timeout: timedelta) -> None:
    """Make ``timeout`` the default group's collective and (best effort) store timeout (torch has no public setter
    for an existing group)."""
    _set_pg_timeout(timeout)
    with contextlib.suppress(Exception):
        _get_default_store().set_timeout(timeout)


# ---------------------------------------------------------------- private attributes of Lightning's trainer and loops
def _private_attribute(owner: Any, name: str) -> Any:
    try:
        return getattr(owner, name)
    except AttributeError as err:  # pragma: no cover - only with an untested Lightning release
        raise _missing_api_error(f"{type(owner).__qualname__}.{name}", err) from err


def attached_trainer(module: Any) -> Any:
    """The trainer a LightningModule is attached to, or ``None`` (also under Fabric, where ``module.trainer`` is a
    stand-in, and for a plain module); public API only: ``module.trainer`` raises when there is none."""
    if module is None or getattr(module, "fabric", None) is not None:
        return None
    try:
        return getattr(module, "trainer", None)
    except RuntimeError:  # not attached to a Trainer
        return None


def training_loaders(trainer: Any) -> list[Any] | None:
    """The fit loop's current training loaders, flattened as its ``CombinedLoader`` flattens them (``None`` before
    the loop built them); public API: ``trainer.train_dataloader``."""
    iterables = trainer.train_dataloader
    return None if iterables is None else _leaves(iterables)


def _leaves(tree: Any) -> list[Any]:
    if isinstance(tree, dict):
        tree = list(tree.values())
    if isinstance(tree, (list, tuple)):
        return [leaf for branch in tree for leaf in _leaves(branch)]
    return [tree]


def cached_validation_loader(trainer: Any) -> Any:
    """The fit loop's cached validation ``CombinedLoader`` (``None`` when the next validation builds one); private:
    ``trainer.val_dataloaders`` falls back to the validate loop's loaders."""
    return _private_attribute(trainer.fit_loop.epoch_loop.val_loop, "_combined_loader")


def forget_validation_loader(trainer: Any) -> None:
    """Make the fit loop's next validation rebuild its loaders (``val_dataloader()`` and ``process_dataloader``); a
    write: Lightning rebuilds them publicly only on ``reload_dataloaders_every_n_epochs``, at epoch boundaries."""
    val_loop = trainer.fit_loop.epoch_loop.val_loop
    _private_attribute(val_loop, "_combined_loader")
    val_loop._combined_loader = None


def should_accumulate(trainer: Any) -> bool:
    """Whether the batch that just ran only accumulates gradients (no optimizer step follows it): the fit loop's own
    rule, from public attributes (the step comes every ``accumulate_grad_batches`` batches and after the epoch's last
    one, unless the strategy accumulates across it)."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    ready = progress.current.ready
    if ready % trainer.accumulate_grad_batches == 0:
        return False
    last = ready == trainer.num_training_batches or progress.is_last_batch
    return bool(trainer.strategy.handles_gradient_accumulation or not last)


def ddp_forward_skippable(ddp: Any) -> bool:
    """Whether a forward and backward may bypass ``ddp`` (its reducer ignores a backward whose forward it did not
    prepare): not before its first forward, nor before the forward that rebuilds its buckets (a collective that the
    buffers' broadcast must not overtake; none with unused parameters), nor with a static graph, a delayed all-reduce
    or a buffer comm hook. DDP's private state: it has no public "may skip" query."""
    return (
        getattr(ddp, "_lazy_init_ran", False)
        and (getattr(ddp, "_has_rebuilt_buckets", False) or getattr(ddp, "find_unused_parameters", False))
        and not getattr(ddp, "static_graph", True)
        and not getattr(ddp, "_delay_all_reduce_all_params", True)
        and not hasattr(ddp, "buffer_hook")
        and hasattr(ddp, "_sync_buffers")
    )


def inside_log_sync(frames: int = 6) -> bool:
    """Whether the caller runs inside Lightning's on-step reduction of a value logged with ``sync_dist=True`` (a
    ``_ResultMetric`` updating, within ``frames`` frames up the stack; Lightning says so nowhere else)."""
    frame = inspect.currentframe()
    frame = frame.f_back if frame is not None else None
    for _ in range(frames):
        if frame is None:
            return False
        owner = frame.f_locals.get("self")
        if type(owner).__name__ == "_ResultMetric" and frame.f_code.co_name == "update":
            return True
        frame = frame.f_back
    return False


def broadcast_ddp_buffers(ddp: Any) -> None:
    """Broadcast ``ddp``'s module buffers now, as its next forward would have done (that forward then does not);
    DDP's private method, the only way to broadcast them outside a forward with its own settings."""
    if ddp.will_sync_module_buffers():
        ddp._sync_buffers()
        ddp.require_forward_param_sync = False


def skip_buffer_broadcast(model: Any) -> None:
    """After a forward through ``model`` (a DDP wrapper; else nothing) that failed inside the module: DDP broadcast
    the buffers before the module ran, so the step's next forwards do not broadcast them again (the other replicas
    broadcast once in this step)."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        model.require_forward_param_sync = False


@contextlib.contextmanager
def logged_batch(module: Any, batch: Any) -> Iterator[None]:
    """Around one micro-batch's ``training_step``: Lightning's logging infers the batch size of a value logged
    without ``batch_size`` from ``batch`` (else from the whole step's batch, cached per step); the step's batch and
    cached size come back after (the trainer's private result collection; no public way to set the batch)."""
    trainer = attached_trainer(module)
    results = _private_attribute(trainer, "_results") if trainer is not None else None
    if results is None:
        yield
        return
    saved = results.batch, results.batch_size
    results.batch, results.batch_size = batch, None
    try:
        yield
    finally:
        results.batch, results.batch_size = saved


def restore_checkpoint(trainer: Any, path: str) -> None:
    """Load ``path`` as ``trainer.fit(ckpt_path=path)`` would before the strategy's setup: the model, the datamodule
    and the callbacks now, the optimizers and loops when the fit restores its training state (the connector's
    private step; ``ckpt_path`` restores only after the strategy's setup)."""
    _private_attribute(trainer, "_checkpoint_connector")._restore_modules_and_callbacks(path)


def replace_signal_connector(trainer: Any, connector: Any) -> None:
    """Install ``connector`` where the trainer keeps its signal connector (it registers the signal handlers; the
    trainer has no public hook for it)."""
    _private_attribute(trainer, "_signal_connector")
    trainer._signal_connector = connector


def uses_distributed_sampler(trainer: Any) -> bool:
    """``Trainer(use_distributed_sampler=...)`` (``False``: every rank reads its loaders whole, as given); the
    trainer keeps the argument only in its private accelerator connector."""
    return bool(_private_attribute(trainer, "_accelerator_connector").use_distributed_sampler)


_RECORDING: weakref.WeakSet[Callable[..., Any]] = weakref.WeakSet()  # the wrappers record_loader_arguments installed


def record_loader_arguments(trainer: Any) -> None:
    """Make the loader Lightning re-creates around its distributed sampler record its ``__init__`` arguments.

    Lightning re-creates it without ``_replace_dunder_methods``, so a subclass with arguments of its own could not be
    re-created once more from the copy; the sampler injection runs under the wrapper from here on (idempotent).
    """
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


# ------------------------------------------------------ private attributes of torch, the stdlib and Lightning helpers
def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the current backward pass has finished (called from inside a backward hook); torch's
    ``Variable._execution_engine.queue_callback``, which has no public equivalent."""
    from torch.autograd import Variable

    Variable._execution_engine.queue_callback(callback)


def wrapped_sampler(sampler: Any) -> Any:
    """The user's sampler inside Lightning's ``DistributedSamplerWrapper`` (its dataset keeps it as ``_sampler``), or
    ``None`` when ``sampler`` is no such wrapper; the wrapper gives it no public name."""
    return getattr(getattr(sampler, "dataset", None), "_sampler", None)


@contextlib.contextmanager
def inside_fabric_backward(wrappers: ModuleType) -> Iterator[None]:
    """While the block runs, Fabric's ``wrappers`` module (of either Fabric package) believes that it runs inside
    ``fabric.backward`` (its ``_in_fabric_backward`` flag), so that a bare ``loss.backward()`` is allowed; Fabric
    has no public switch."""
    previous = wrappers._in_fabric_backward
    wrappers._in_fabric_backward = True
    try:
        yield
    finally:
        wrappers._in_fabric_backward = previous
