"""Splitting the Trainer's DataLoaders among the replicas: training by the allocation, evaluation by share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightning.fabric.utilities.data import has_iterable_dataset
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

from lightning_het._compat import cached_validation_loader, forget_validation_loader, uses_distributed_sampler
from lightning_het._flavour import trainer_flavour
from lightning_het.allocation import allocate_batch_sizes
from lightning_het.data.loaders import (
    TrainingOrder,
    as_batch_size,
    batch_sampler_error,
    loader_batch_size,
    lost_batch_sampler,
    rebuild_loader,
    rebuild_with_batch_sampler,
    training_order,
)
from lightning_het.data.sampler import (
    EvalBatchSampler,
    ProportionalBatchSampler,
    ProportionalDistributedSampler,
    eval_batch_plan,
)
from lightning_het.reliability.checkpointing import apply_sampler_resume, resumed_global_batch_size


@dataclass(frozen=True)
class TrainingSplit:
    """What splitting a training loader needs: this replica, the bounds, the allocation's callables."""

    rank: int
    world_size: int
    min_batch_size: int  # fewest training samples per replica and step
    given_global_batch: int | None
    given_speeds: list[float] | None
    batch_sizes: Callable[[], list[int] | None]  # the allocation now
    allocate: Callable[[DataLoader, int, TrainingOrder], None]  # allocate (profiling when needed) a global batch
    adopt: Callable[[list[int], list[float]], None]  # make batch sizes and speeds the allocation
    profiler: Callable[[], Any]  # the InLoopProfiler while the first steps profile (it binds the sampler), else None


def eval_weights(batch_sizes: list[int] | None, speeds: list[float] | None, world_size: int) -> list[float]:
    """Each replica's share of an evaluation set: the allocation, else the given speeds, else equal."""
    if batch_sizes is not None:
        return [float(b) for b in batch_sizes]
    if speeds is not None:
        return list(speeds)
    return [1.0] * world_size


def read_as_given(dataloader: DataLoader, trainer: Any) -> bool:
    """``use_distributed_sampler=False``: every replica reads ``dataloader`` whole (own sampler adopted)."""
    own_sampler = isinstance(dataloader.sampler, ProportionalDistributedSampler)
    return not own_sampler and not uses_distributed_sampler(trainer)


class LoaderSplitter:
    """A strategy's loader state: training sampler, resumed record, evaluation weights, global batch."""

    def __init__(self) -> None:
        self.train_sampler: ProportionalDistributedSampler | None = None  # the fit's training sampler (tail step)
        self.resume_record: dict[str, Any] | None = None  # checkpoint["lightning_het"] of the fit being resumed
        self.eval_weights_used: list[float] | None = None
        #: (the loader set-up of this fit it belongs to, the global batch of its first training loader)
        self.train_pass: tuple[Any, int] | None = None
        self.own_sharding_warned = False  # `use_distributed_sampler=False` warned about (once)

    def process(self, dataloader: DataLoader, trainer: Any, split: TrainingSplit, weights: list[float]) -> DataLoader:
        """``dataloader`` split for this replica at the trainer's stage (as given where it cannot be split)."""
        stage, stages = trainer.state.stage, trainer_flavour(trainer).RunningStage  # the trainer's package's enum
        training = stage == stages.TRAINING
        evaluating = stage in (stages.VALIDATING, stages.TESTING, stages.SANITY_CHECKING)
        if has_iterable_dataset(dataloader):
            if training:
                rank_zero_warn(
                    "The training DataLoader wraps an IterableDataset, which HeterogeneousStrategy cannot re-split:"
                    " every replica reads it as in plain DDP, with equal weights and no load balancing. HINT: use a"
                    " map-style Dataset for speed-proportional batches and exact gradients."
                )
            return dataloader
        if (training or evaluating) and read_as_given(dataloader, trainer):
            self.warn_own_sharding()  # plain DDP behaviour for this loader
            return dataloader
        if training:
            return self.split_training_loader(dataloader, trainer, split)
        if evaluating:
            return self.split_eval_loader(dataloader, weights, split.rank, split.world_size)
        return dataloader

    def warn_own_sharding(self) -> None:
        if self.own_sharding_warned:
            return
        self.own_sharding_warned = True
        rank_zero_warn(
            "HeterogeneousStrategy: `Trainer(use_distributed_sampler=False)`: every replica reads its DataLoaders"
            " whole, as given (shard inside the Dataset), and the strategy falls back to plain DDP behaviour for them:"
            " no speed-proportional batches, equal weights in the gradient mean (exact when the replicas' batches are"
            " equal). HINT: leave `use_distributed_sampler` at True for load balancing."
        )

    def resolve_global_batch_size(
        self, dataloader: DataLoader, trainer: Any, given: int | None, world_size: int
    ) -> int:
        """``global_batch_size``, else the datamodule's, else a resumed checkpoint's, else the loader's x replicas."""
        if given is not None:
            return given
        datamodule_value = getattr(trainer.datamodule, "global_batch_size", None) if trainer.datamodule else None
        if as_batch_size(datamodule_value) is not None:  # int or NumPy integer
            return int(as_batch_size(datamodule_value))  # type: ignore[arg-type]
        saved = resumed_global_batch_size(self.resume_record)
        if saved is not None:  # resuming: the checkpoint's global batch, whatever the number of replicas now
            per_replica = loader_batch_size(dataloader)
            if per_replica is not None and per_replica * world_size != saved:
                rank_zero_info(
                    f"HeterogeneousStrategy: resuming with the checkpoint's global batch of {saved} samples (not the"
                    f" DataLoader's batch_size {per_replica} x {world_size} replicas); pass `global_batch_size`"
                    " to change it"
                )
            return saved
        per_replica = loader_batch_size(dataloader)
        if per_replica is None:
            raise ValueError(
                "The training DataLoader has no `batch_size` (built with `batch_size=None`), so the global batch cannot"
                " be inferred. HINT: pass `HeterogeneousStrategy(global_batch_size=...)`, or give the DataLoader a"
                " `batch_size`."
            )
        return per_replica * world_size

    def _adopt_own_sampler(self, dataloader: DataLoader, trainer: Any, split: TrainingSplit) -> DataLoader:
        """A loader with a ``ProportionalDistributedSampler`` of the user's own: its sizes are the allocation."""
        sampler = dataloader.sampler
        assert isinstance(sampler, ProportionalDistributedSampler)
        allocated = split.batch_sizes()
        if allocated is None:
            split.adopt(list(sampler.batch_sizes), split.given_speeds or list(map(float, sampler.batch_sizes)))
        elif list(sampler.batch_sizes) != allocated:
            raise ValueError(
                f"The training DataLoader's ProportionalDistributedSampler has batch_sizes={sampler.batch_sizes},"
                f" but the strategy allocated {allocated}. HINT: build it from `strategy.batch_sizes`."
            )
        apply_sampler_resume(sampler, self.resume_record, trainer.fit_loop.epoch_progress.current.processed)
        self.resume_record = None
        self.train_sampler = sampler
        return dataloader

    def split_training_loader(self, dataloader: DataLoader, trainer: Any, split: TrainingSplit) -> DataLoader:
        """Allocate the global batch (profiling when needed) and rebuild the loader around this replica's sampler."""
        if isinstance(dataloader.sampler, ProportionalDistributedSampler):
            return self._adopt_own_sampler(dataloader, trainer, split)
        if lost_batch_sampler(dataloader):  # `batch_sampler=` that Lightning's sampler injection dropped
            raise batch_sampler_error("given as `batch_sampler=`")
        order = training_order(dataloader)
        dataset = dataloader.dataset
        global_batch = self.resolve_global_batch_size(dataloader, trainer, split.given_global_batch, split.world_size)
        length = len(order.sampler) if order.sampler is not None else len(dataset)
        if length < global_batch:
            raise ValueError(
                f"The training dataset holds {length} samples, fewer than one global batch of {global_batch}"
                f" (global_batch_size={global_batch}, {split.world_size} replicas): no step could run. HINT: lower"
                " `global_batch_size` or use more data."
            )
        pass_key = (id(trainer), trainer.fit_loop.epoch_progress.current.processed, trainer.global_step)
        if self.train_pass is not None and self.train_pass[0] == pass_key and self.train_pass[1] != global_batch:
            return self.split_other_training_loader(dataloader, order, global_batch, split)
        allocated = split.batch_sizes()
        if allocated is None or sum(allocated) != global_batch:
            split.allocate(dataloader, global_batch, order)
        batch_sizes = split.batch_sizes()
        assert batch_sizes is not None
        self.train_pass = (pass_key, global_batch)
        sampler = _training_sampler(dataset, batch_sizes, order, split)
        if sampler.dropped_per_epoch and not order.drop_last:
            rank_zero_warn(
                f"HeterogeneousStrategy: the last {sampler.dropped_per_epoch} training sample(s) of each epoch are too"
                f" few for a last global batch over {split.world_size} replicas (at least"
                f" {split.min_batch_size} each) and are not trained. HINT: choose `global_batch_size` so that"
                " the remainder of the dataset size is 0 or at least that many."
            )
        # epoch (and, when resuming, the global batches already trained on) before Lightning's first iterator
        apply_sampler_resume(sampler, self.resume_record, trainer.fit_loop.epoch_progress.current.processed)
        self.resume_record = None
        self.train_sampler = sampler
        self.reset_cached_eval_loaders(trainer, eval_weights(batch_sizes, split.given_speeds, split.world_size))
        return _rebuild_training_loader(dataloader, sampler, split)

    def split_other_training_loader(
        self, dataloader: DataLoader, order: TrainingOrder, global_batch: int, split: TrainingSplit
    ) -> DataLoader:
        """A further training loader with another global batch: split by the same speeds (or trial split)."""
        allocated = split.batch_sizes()
        assert allocated is not None
        sizes = allocate_batch_sizes(global_batch, allocated, min_batch_size=split.min_batch_size)
        return _rebuild_training_loader(dataloader, _training_sampler(dataloader.dataset, sizes, order, split), split)

    def split_eval_loader(self, dataloader: DataLoader, weights: list[float], rank: int, world_size: int) -> DataLoader:
        """Every replica runs as many evaluation batches, sized by its share; each sample is evaluated once."""
        if isinstance(dataloader.sampler, DistributedSampler) and type(dataloader.sampler) is not DistributedSampler:
            return dataloader  # the user's own distributed sampler
        if type(dataloader.batch_sampler) is not BatchSampler:
            return dataloader
        self.eval_weights_used = weights
        batch_size = dataloader.batch_size or 1
        batches = EvalBatchSampler(dataloader.dataset, weights, rank, batch_size)
        if batches.repeats > 1:
            rank_zero_warn(
                f"HeterogeneousStrategy: the evaluation set holds {len(dataloader.dataset)} sample(s), fewer than the"
                f" {world_size} replicas; every replica needs one, so the set is evaluated {batches.repeats}"
                " times over (each sample equally often): means and accuracies are exact, summed values are"
                f" {batches.repeats} times larger. HINT: evaluate at least one sample per replica."
            )
        return rebuild_with_batch_sampler(dataloader, batches)

    def reset_cached_eval_loaders(self, trainer: Any, weights: list[float]) -> None:
        """Rebuild validation loaders cached with pre-allocation shares when the allocation changes a shard."""
        cached = cached_validation_loader(trainer)
        if cached is None or self.eval_weights_used == weights:
            return
        for loader in getattr(cached, "flattened", [cached]):
            batches = getattr(loader, "batch_sampler", None)
            if not isinstance(batches, EvalBatchSampler):
                continue  # not split by the weights (the user's own sampler, an iterable dataset)
            if eval_batch_plan(len(batches.sampler.dataset), weights, batches.batch_size)[0] != batches.shares:
                forget_validation_loader(trainer)
                return
        self.eval_weights_used = weights


def _training_sampler(
    dataset: Any, batch_sizes: list[int], order: TrainingOrder, split: TrainingSplit
) -> ProportionalDistributedSampler:
    """This replica's sampler of ``dataset`` for the split ``batch_sizes``, in the user's loader's order."""
    return ProportionalDistributedSampler(
        dataset,
        batch_sizes,
        split.rank,
        shuffle=order.shuffle,
        seed=order.seed,
        drop_last=order.drop_last,
        min_batch_size=split.min_batch_size,
        order_sampler=order.sampler,
    )


def _rebuild_training_loader(dataloader: DataLoader, sampler: ProportionalDistributedSampler, split: TrainingSplit):
    """The user's loader around ``sampler``; while profiling, its batches are cut one at a time by the plan."""
    profiler = split.profiler()
    size = sampler.batch_sizes[split.rank]
    if profiler is None:
        return rebuild_loader(dataloader, sampler, size)
    profiler.bind(sampler)
    return rebuild_loader(dataloader, sampler, size, batch_sampler=ProportionalBatchSampler(sampler))
