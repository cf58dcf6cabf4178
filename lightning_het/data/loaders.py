"""Reading a user's ``DataLoader`` and rebuilding it around our samplers, whatever way it was configured."""

from __future__ import annotations

import operator
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
    default_collate,
    default_convert,
)


def as_batch_size(value: Any) -> int | None:
    """``value`` as a positive ``int`` when it is one (Python or NumPy integer, not ``bool``), else ``None``."""
    if isinstance(value, bool):
        return None
    try:
        number = operator.index(value)
    except TypeError:
        return None
    return number if number > 0 else None


def batch_sampler_error(name: str) -> ValueError:
    """The message for a training loader whose batches come from a batch sampler we cannot re-split."""
    return ValueError(
        f"The training DataLoader draws its batches from a batch sampler ({name}), which HeterogeneousStrategy"
        " cannot re-split into speed-proportional global batches. HINT: give the DataLoader the index sampler"
        " itself with `sampler=...` and `batch_size=...` (any sampler works: its order is cut into global batches),"
        " move the grouping into the Dataset, or pass a `ProportionalDistributedSampler` of your own built from"
        " `strategy.batch_sizes`."
    )


@dataclass(slots=True)
class TrainingOrder:
    """Where the single-process order of a training loader comes from."""

    shuffle: bool
    seed: int
    sampler: Sampler | None = None
    drop_last: bool = False


def _unwrap(sampler: Any) -> Any:
    """The user's sampler inside Lightning's ``DistributedSamplerWrapper`` (or ``sampler`` itself)."""
    from lightning_het._compat import wrapped_sampler

    inner = wrapped_sampler(sampler)
    return inner if inner is not None else sampler


def _draws_one_permutation(sampler: RandomSampler) -> bool:
    """Whether ``sampler`` is a ``RandomSampler`` drawing one permutation of its data per epoch."""
    try:
        return sampler.num_samples == len(sampler.data_source)  # type: ignore[arg-type]
    except TypeError:  # a data source without a length
        return False


def training_order(dataloader: DataLoader) -> TrainingOrder:
    """The order one process would draw from ``dataloader`` (after Lightning's sampler injection)."""
    default_seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
    batch_sampler = dataloader.batch_sampler
    if batch_sampler is not None and type(batch_sampler) is not BatchSampler:
        raise batch_sampler_error(type(batch_sampler).__name__)
    sampler = dataloader.sampler
    drop_last = bool(dataloader.drop_last)
    if batch_sampler is not None and dataloader.batch_size is None:  # DataLoader(batch_sampler=BatchSampler(...))
        sampler, drop_last = batch_sampler.sampler, bool(batch_sampler.drop_last)
    if type(sampler) is DistributedSampler:  # injected by Lightning: it carries Lightning's shuffle/seed choice
        return TrainingOrder(bool(sampler.shuffle), int(sampler.seed), drop_last=drop_last)
    if type(sampler) is RandomSampler and not sampler.replacement and _draws_one_permutation(sampler):
        return TrainingOrder(True, default_seed, drop_last=drop_last)
    if type(sampler) is SequentialSampler:
        return TrainingOrder(False, default_seed, drop_last=drop_last)
    user = _unwrap(sampler)
    if isinstance(user, BatchSampler):  # a batch sampler passed as `sampler=` with batch_size=None
        raise batch_sampler_error(type(user).__name__)
    if isinstance(user, DistributedSampler):
        raise ValueError(
            f"The training DataLoader's sampler is a {type(user).__name__}, a DistributedSampler that yields one"
            " replica's share only, so the replicas' orders differ and cannot be cut into common global batches."
            " HINT: give the DataLoader the non-distributed sampler (HeterogeneousStrategy distributes it), or a"
            " `ProportionalDistributedSampler` built from `strategy.batch_sizes`."
        )
    return TrainingOrder(True, default_seed, sampler=user, drop_last=drop_last)


def loader_batch_size(dataloader: DataLoader) -> int | None:
    """Samples per batch of ``dataloader`` on one replica; ``None`` without automatic batching."""
    if dataloader.batch_size is not None:
        return int(dataloader.batch_size)
    batch_sampler = dataloader.batch_sampler
    if type(batch_sampler) is BatchSampler:
        return int(batch_sampler.batch_size)
    return None


def lost_batch_sampler(dataloader: DataLoader) -> bool:
    """Whether Lightning rebuilt a ``batch_sampler=`` loader without it (``batch_size=None``)."""
    return (
        dataloader.batch_size is None and dataloader.batch_sampler is None and dataloader.collate_fn is default_collate
    )


class PerSampleCollate:
    """The user's per-sample collate applied to each sample, then ``default_collate``. Picklable."""

    def __init__(self, per_sample: Callable[[Any], Any]) -> None:
        self.per_sample = per_sample

    def __call__(self, samples: list[Any]) -> Any:
        return default_collate([self.per_sample(s) for s in samples])


def rebuild_loader(
    dataloader: DataLoader,
    sampler: Sampler,
    batch_size: int,
    *,
    batch_sampler: BatchSampler | None = None,
    **overrides: Any,
) -> DataLoader:
    """Re-instantiate ``dataloader`` (any DataLoader subclass) with a new sampler and batch size, keeping the rest."""
    # imported here: importing Lightning runs the strategy registration, which imports this module (no cycle)
    from lightning_het._compat import _get_dataloader_init_args_and_kwargs, _reinstantiate_wrapped_cls

    args, kwargs = _get_dataloader_init_args_and_kwargs(dataloader, sampler)
    arg_names = tuple(getattr(dataloader, "__pl_saved_arg_names", ()))
    replacements: dict[str, Any] = {"batch_size": batch_size, "drop_last": False, **overrides}
    if batch_sampler is not None:  # it excludes batch_size, shuffle, sampler and drop_last
        replacements.update(batch_sampler=batch_sampler, sampler=None, batch_size=1, shuffle=None)
    if dataloader.batch_size is None and dataloader.batch_sampler is None and "collate_fn" not in overrides:
        collate = dataloader.collate_fn
        replacements["collate_fn"] = default_collate if collate is default_convert else PerSampleCollate(collate)
    if arg_names:
        args = tuple(
            replacements.pop(name, value) if name in replacements else value for name, value in zip(arg_names, args)
        )
    kwargs.update(replacements)
    return _reinstantiate_wrapped_cls(dataloader, *args, **kwargs)


def rebuild_with_batch_sampler(dataloader: DataLoader, batch_sampler: BatchSampler) -> DataLoader:
    """Re-instantiate ``dataloader`` (any subclass) drawing its batches from ``batch_sampler``."""
    return rebuild_loader(dataloader, batch_sampler.sampler, 1, batch_sampler=batch_sampler)
