"""Splitting the Trainer's DataLoaders among the replicas: training by the allocation, evaluation by share."""

from __future__ import annotations

import numbers
import os
from collections.abc import Callable, Sequence, Sized
from dataclasses import dataclass
from functools import partial
from typing import Any

from lightning.fabric.utilities.data import has_iterable_dataset
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
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

from lightning_het._compat import _get_dataloader_init_args_and_kwargs, wrapped_sampler
from lightning_het._flavour import trainer_flavour
from lightning_het.allocation import allocate_batch_sizes
from lightning_het.data.sampler import EvalBatchSampler, ProportionalBatchSampler, ProportionalDistributedSampler
from lightning_het.reliability.checkpointing import apply_sampler_resume, resumed_global_batch_size


def as_batch_size(value: Any) -> int | None:
    """``value`` as a positive ``int`` when it is one (Python or NumPy integer, not ``bool``), else ``None``."""
    return int(value) if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value > 0 else None


def batch_sampler_error(name: str) -> ValueError:
    return ValueError(
        f"The training DataLoader draws its batches from a batch sampler ({name}), which cannot be re-split."
        " HINT: give the DataLoader the index sampler itself with `sampler=...` and `batch_size=...`."
    )


@dataclass(slots=True)
class TrainingOrder:
    """Where the single-process order of a training loader comes from."""

    shuffle: bool
    seed: int
    sampler: Sampler | None = None
    drop_last: bool = False
    batch_size: int | None = None  # samples per batch on one replica (None: no automatic batching)

    def split(self, dataset: Any, sizes: Sequence[int], rank: int, **options: Any) -> ProportionalDistributedSampler:
        """Replica ``rank``'s share of this order cut into global batches of ``sizes`` (``options``: the sampler's)."""
        options.setdefault("drop_last", self.drop_last)
        return ProportionalDistributedSampler(
            dataset, sizes, rank, shuffle=self.shuffle, seed=self.seed, order_sampler=self.sampler, **options
        )


def training_order(dataloader: DataLoader) -> TrainingOrder:
    """The order one process would draw from ``dataloader`` (after Lightning's sampler injection)."""
    batch_sampler, size = dataloader.batch_sampler, dataloader.batch_size
    if batch_sampler is not None and type(batch_sampler) is not BatchSampler:
        raise batch_sampler_error(type(batch_sampler).__name__)
    sampler, drop_last = dataloader.sampler, bool(dataloader.drop_last)
    if batch_sampler is not None and size is None:  # DataLoader(batch_sampler=BatchSampler(...))
        sampler, drop_last, size = batch_sampler.sampler, bool(batch_sampler.drop_last), batch_sampler.batch_size
    order = TrainingOrder(True, int(os.environ.get("PL_GLOBAL_SEED", 0)), drop_last=drop_last, batch_size=size)
    random = type(sampler) is RandomSampler and isinstance(sampler.data_source, Sized) and not sampler.replacement
    if type(sampler) is DistributedSampler:  # injected by Lightning: it carries Lightning's shuffle/seed choice
        order.shuffle, order.seed = bool(sampler.shuffle), int(sampler.seed)
    elif type(sampler) is SequentialSampler:
        order.shuffle = False
    elif not (random and sampler.num_samples == len(sampler.data_source)):  # not one permutation: the user's order
        order.sampler = wrapped_sampler(sampler) or sampler  # inside Lightning's DistributedSamplerWrapper
        if isinstance(order.sampler, BatchSampler):  # a batch sampler passed as `sampler=` with batch_size=None
            raise batch_sampler_error(type(order.sampler).__name__)
        if isinstance(order.sampler, DistributedSampler):
            raise ValueError(
                f"The training DataLoader's sampler is a {type(order.sampler).__name__}, a DistributedSampler that"
                " yields one replica's share only. HINT: give the DataLoader the non-distributed sampler."
            )
    return order


def _collate_each(per_sample: Callable[[Any], Any], samples: list[Any]) -> Any:
    """The user's per-sample collate applied to each sample, then ``default_collate`` (picklable with a partial)."""
    return default_collate([per_sample(s) for s in samples])


def rebuild_loader(
    dataloader: DataLoader, sampler: Sampler, batch_size: int, *, batch_sampler: BatchSampler | None = None
) -> DataLoader:
    """Re-instantiate ``dataloader`` (any DataLoader subclass) with a new sampler and batch size, keeping the rest."""
    args, kwargs = _get_dataloader_init_args_and_kwargs(dataloader, sampler)
    replacements: dict[str, Any] = {"batch_size": batch_size, "drop_last": False}
    if batch_sampler is not None:  # it excludes batch_size, shuffle, sampler and drop_last
        replacements.update(batch_sampler=batch_sampler, sampler=None, batch_size=1, shuffle=None)
    if dataloader.batch_size is None and dataloader.batch_sampler is None:
        collate = dataloader.collate_fn
        replacements["collate_fn"] = default_collate if collate is default_convert else partial(_collate_each, collate)
    names = getattr(dataloader, "__pl_saved_arg_names", ())  # positional arguments Lightning recorded
    args = tuple(replacements.pop(name, value) for name, value in zip(names, args)) + args[len(names) :]
    loader = type(dataloader)(*args, **{**kwargs, **replacements})
    for attr_args, setter in getattr(dataloader, "__pl_attrs_record", ()):  # attributes set after __init__
        setter(loader, *attr_args)
    return loader


class LoaderSplitter:
    """A strategy's loader state: training sampler, resumed record, global batch of this fit's training loaders."""

    def __init__(self) -> None:
        self.train_sampler: ProportionalDistributedSampler | None = None  # the fit's training sampler (tail step)
        self.resume_record: dict[str, Any] | None = None  # checkpoint["lightning_het"] of the fit being resumed
        self.train_pass: tuple[Any, int] | None = None  # (this fit's loader set-up, its first loader's global batch)
        self.own_sharding_warned = False

    def process(self, dataloader: DataLoader, trainer: Any, policy: Any, fit: Any) -> DataLoader:
        """``dataloader`` split for this replica at the trainer's stage by the strategy's ``BalancePolicy`` (``fit``:
        the ``FitContext`` it allocates with), as given where it cannot be split."""
        stage, stages = trainer.state.stage, trainer_flavour(trainer).RunningStage  # the trainer's package's enum
        training = stage == stages.TRAINING
        evaluating = stage in (stages.VALIDATING, stages.TESTING, stages.SANITY_CHECKING)
        if has_iterable_dataset(dataloader):
            if training:
                rank_zero_warn(
                    "The training IterableDataset cannot be re-split: every replica reads it as in plain DDP."
                )
            return dataloader
        sampler = dataloader.sampler
        if isinstance(sampler, ProportionalDistributedSampler) and training:  # the user's own: it is the allocation
            allocated = policy.allocation.batch_sizes
            if allocated is None:
                policy.adopt(list(sampler.batch_sizes), policy.config.speeds or list(map(float, sampler.batch_sizes)))
            elif list(sampler.batch_sizes) != allocated:
                raise ValueError(f"The sampler's batch_sizes={sampler.batch_sizes} are not the allocation {allocated}.")
            self._start(sampler, trainer)
            return dataloader
        # `Trainer(use_distributed_sampler=False)`: Lightning injected no DistributedSampler; read as given
        samplers = (sampler, getattr(dataloader.batch_sampler, "sampler", None))
        if not any(isinstance(s, DistributedSampler) for s in samplers):
            if (training or evaluating) and not self.own_sharding_warned:
                self.own_sharding_warned = True
                rank_zero_warn(
                    "HeterogeneousStrategy with `Trainer(use_distributed_sampler=False)`: every replica reads its"
                    " DataLoaders as given, with equal weights, as in plain DDP."
                )
            return dataloader
        if training:
            return self.split_training_loader(dataloader, trainer, policy, fit)
        own = type(sampler) is not DistributedSampler and isinstance(sampler, DistributedSampler)  # the user's own
        if not evaluating or own or type(dataloader.batch_sampler) is not BatchSampler:
            return dataloader
        # every replica runs as many evaluation batches, sized by its share (the weights read when iterated)
        batches = EvalBatchSampler(dataloader.dataset, policy.eval_weights, policy.rank, dataloader.batch_size or 1)
        if batches.repeats > 1:
            rank_zero_warn(
                f"HeterogeneousStrategy: the evaluation set holds fewer samples than the {policy.world_size} replicas,"
                f" so it is evaluated {batches.repeats} times over (summed values {batches.repeats} times larger)."
            )
        return rebuild_loader(dataloader, batches.sampler, 1, batch_sampler=batches)

    def resolve_global_batch_size(self, per_replica: int | None, trainer: Any, policy: Any) -> int:
        """``global_batch_size``, else the datamodule's, else a resumed checkpoint's, else ``per_replica`` x world."""
        given = policy.config.global_batch_size or as_batch_size(getattr(trainer.datamodule, "global_batch_size", None))
        if given is not None:
            return given
        saved = resumed_global_batch_size(self.resume_record)
        if saved is not None:  # resuming: the checkpoint's global batch, whatever the number of replicas now
            if per_replica is not None and per_replica * policy.world_size != saved:
                rank_zero_info(f"HeterogeneousStrategy: resuming with the checkpoint's global batch of {saved} samples")
            return saved
        if per_replica is None:
            raise ValueError(
                "The training loader has no `batch_size`; HINT: pass `HeterogeneousStrategy(global_batch_size=...)`."
            )
        return per_replica * policy.world_size

    def _start(self, sampler: ProportionalDistributedSampler, trainer: Any) -> None:
        """The fit's sampler, at its epoch (and, resuming, after the global batches already trained on)."""
        apply_sampler_resume(sampler, self.resume_record, trainer.fit_loop.epoch_progress.current.processed)
        self.resume_record, self.train_sampler = None, sampler

    def split_training_loader(self, dataloader: DataLoader, trainer: Any, policy: Any, fit: Any) -> DataLoader:
        """Allocate the global batch (profiling when needed) and rebuild the loader around this replica's sampler."""
        if dataloader.batch_sampler is None and dataloader.collate_fn is default_collate:  # `batch_size=None`:
            raise batch_sampler_error("given as `batch_sampler=`")  # Lightning's sampler injection dropped it
        order = training_order(dataloader)
        global_batch = self.resolve_global_batch_size(order.batch_size, trainer, policy)
        length = len(order.sampler) if order.sampler is not None else len(dataloader.dataset)
        if length < global_batch:
            raise ValueError(f"The training set holds {length} samples, fewer than one global batch of {global_batch}.")
        pass_key = (id(trainer), trainer.fit_loop.epoch_progress.current.processed, trainer.global_step)
        further = self.train_pass is not None and self.train_pass[0] == pass_key and self.train_pass[1] != global_batch
        if further:  # a further training loader with another global batch: split by the same speeds (or trial split)
            sizes = allocate_batch_sizes(
                global_batch, policy.allocation.batch_sizes, min_batch_size=policy.min_batch_size
            )
        else:
            sizes = policy.sizes_for(dataloader, global_batch, fit, self.resume_record)
            self.train_pass = (pass_key, global_batch)
        sampler = order.split(dataloader.dataset, sizes, policy.rank, min_batch_size=policy.min_batch_size)
        if not further:
            if sampler.dropped_per_epoch and not order.drop_last:
                rank_zero_warn(
                    f"HeterogeneousStrategy: the last {sampler.dropped_per_epoch} training sample(s) of each epoch are"
                    f" too few for {policy.world_size} replicas and are not trained."
                )
            self._start(sampler, trainer)
        batches = None
        if policy.profiling:  # trial splits on the first steps, each batch cut when the loop fetches it
            policy.profiler.bind(sampler)
            batches = ProportionalBatchSampler(sampler)
        return rebuild_loader(dataloader, sampler, sizes[policy.rank], batch_sampler=batches)
