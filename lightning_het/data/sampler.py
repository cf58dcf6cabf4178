"""Samplers that split every global batch unevenly, but reproducibly, among replicas."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Iterator, Sequence, Sized
from typing import Any

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, Sampler

from lightning_het.allocation import allocate_batch_sizes


def draw_sampler_order(sampler: Sampler, seed: int, epoch: int) -> list[Any]:
    """Everything ``sampler`` yields in one pass, drawn with random generators seeded by ``seed + epoch``."""
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)
    python_state, numpy_state = random.getstate(), np.random.get_state()
    own, saved = hasattr(sampler, "generator"), getattr(sampler, "generator", None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + epoch)
        random.seed(seed + epoch)
        np.random.seed((seed + epoch) % 2**32)
        try:
            if own:
                sampler.generator = torch.Generator().manual_seed(seed + epoch)  # type: ignore[attr-defined]
            return list(iter(sampler))
        finally:
            if own:
                sampler.generator = saved  # type: ignore[attr-defined]
            random.setstate(python_state)
            np.random.set_state(numpy_state)


def tail_batch_sizes(tail: int, batch_sizes: Sequence[int], min_batch_size: int = 1) -> list[int] | None:
    """How the last, smaller global batch of ``tail`` samples is split (``None``: not trained).

    >>> tail_batch_sizes(4, [2, 6]), tail_batch_sizes(1, [2, 6])
    ([1, 3], None)
    """
    sizes = [int(b) for b in batch_sizes]
    floor = max(1, min(int(min_batch_size), min(sizes)))
    if tail < len(sizes) * floor or tail <= 0:
        return None
    return allocate_batch_sizes(tail, [float(b) for b in sizes], min_batch_size=floor, max_batch_sizes=sizes)


class ProportionalDistributedSampler(DistributedSampler):
    """Replica ``r``'s slice ``[k*B + sum(b[:r]), +b[r])`` of every global batch ``k`` of one seeded order (the
    ``order_sampler``'s, else a permutation); the last ``N % B`` samples split by :func:`tail_batch_sizes`."""

    def __init__(
        self,
        dataset: Sized,
        batch_sizes: Sequence[int],
        rank: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        min_batch_size: int = 1,
        order_sampler: Sampler | None = None,
    ) -> None:
        sizes = [int(b) for b in batch_sizes]
        if not sizes or any(b < 1 for b in sizes):
            raise ValueError(f"Expected argument `batch_sizes` to hold positive integers, but got {list(batch_sizes)}.")
        if not 0 <= rank < len(sizes):
            raise ValueError(f"Expected argument `rank` in [0, {len(sizes)}), but got {rank}.")
        global_batch = sum(sizes)
        length = len(order_sampler) if order_sampler is not None else len(dataset)  # type: ignore[arg-type]
        if length < global_batch:
            raise ValueError(f"The dataset holds {length} samples, fewer than one global batch of {global_batch}.")
        super().__init__(dataset, num_replicas=len(sizes), rank=rank, shuffle=shuffle, seed=seed, drop_last=True)
        self.batch_sizes, self.global_batch_size, self.order_sampler = sizes, global_batch, order_sampler
        self.num_full_steps = length // global_batch
        self._tail, self._min_batch_size = length - self.num_full_steps * global_batch, min_batch_size
        self.tail_batch_sizes = None if drop_last else tail_batch_sizes(self._tail, sizes, min_batch_size)
        #: ``(epoch, step) -> split or None``: a global batch's split other than ``batch_sizes`` (profiler trials)
        self.split_schedule: Callable[[int, int], list[int] | None] | None = None
        self.dropped_per_epoch = self._tail if self.tail_batch_sizes is None else 0
        self.num_steps = self.num_full_steps + (self.tail_batch_sizes is not None)
        self.num_samples = self.num_full_steps * sizes[rank] + (self.tail_batch_sizes or [0] * len(sizes))[rank]
        self.total_size = length - self.dropped_per_epoch
        self._skip: tuple[int, int] | None = None  # (epoch, global batches to skip), set by `resume`

    def resume(self, epoch: int, skip_steps: int) -> None:
        """Continue epoch ``epoch`` after its first ``skip_steps`` global batches (mid-epoch resume)."""
        if not 0 <= skip_steps <= self.num_steps:
            raise ValueError(f"Expected argument `skip_steps` in [0, {self.num_steps}], but got {skip_steps}.")
        self.set_epoch(epoch)
        self._skip = (epoch, skip_steps) if skip_steps else None

    @property
    def local_batch_size(self) -> int:
        return self.batch_sizes[self.rank]

    def set_batch_sizes(self, batch_sizes: Sequence[int]) -> None:
        """Split the global batches not drawn yet by ``batch_sizes`` (same samples, same number of steps)."""
        sizes = [int(b) for b in batch_sizes]
        if len(sizes) != len(self.batch_sizes) or sum(sizes) != self.global_batch_size or min(sizes) < 1:
            raise ValueError(
                f"Expected `batch_sizes` to split {self.global_batch_size} in {len(self.batch_sizes)}: {sizes}"
            )
        self.batch_sizes = sizes
        if self.tail_batch_sizes is not None:
            self.tail_batch_sizes = tail_batch_sizes(self._tail, sizes, self._min_batch_size)

    def step_batch_sizes(self, step: int) -> list[int]:
        """Per-replica samples of global batch ``step``: ``batch_sizes``, a scheduled split, or the tail's."""
        planned = self.split_schedule(self.epoch, step) if self.split_schedule is not None else None
        if step >= self.num_full_steps and self.tail_batch_sizes is not None:
            if planned is None:
                return list(self.tail_batch_sizes)
            return tail_batch_sizes(self._tail, planned, self._min_batch_size) or list(self.tail_batch_sizes)
        return list(planned) if planned is not None else list(self.batch_sizes)

    def iter_batches(self, start: int = 0) -> Iterator[list[Any]]:
        """This replica's batches of the current epoch from global batch ``start`` on, each split when drawn."""
        if self.order_sampler is not None:
            order = draw_sampler_order(self.order_sampler, self.seed, self.epoch)
        elif self.shuffle:
            order = torch.randperm(len(self.dataset), generator=torch.Generator().manual_seed(self.seed + self.epoch))
            order = order.tolist()  # type: ignore[assignment]
        else:
            order = list(range(len(self.dataset)))  # type: ignore[arg-type]
        for k in range(start, self.num_steps):
            sizes = self.step_batch_sizes(k)
            begin = k * self.global_batch_size + sum(sizes[: self.rank])
            yield order[begin : begin + sizes[self.rank]]

    def take_start_step(self) -> int:
        """The global batch this epoch starts from: the resumed step once, else 0."""
        start = 0
        if self._skip is not None and self._skip[0] == self.epoch:  # one-shot: the resumed epoch only
            start, self._skip = self._skip[1], None
        return start

    def __iter__(self) -> Iterator[Any]:
        return iter([i for step in self.iter_batches(self.take_start_step()) for i in step])


class ProportionalBatchSampler(BatchSampler):
    """The batches of a :class:`ProportionalDistributedSampler`, each split decided when the loader draws it."""

    def __init__(self, sampler: ProportionalDistributedSampler) -> None:
        super().__init__(sampler, batch_size=sampler.local_batch_size, drop_last=False)

    def __iter__(self) -> Iterator[list[Any]]:
        sampler: ProportionalDistributedSampler = self.sampler  # type: ignore[assignment]
        return sampler.iter_batches(sampler.take_start_step())

    def __len__(self) -> int:
        return self.sampler.num_steps  # type: ignore[attr-defined]


class UnpaddedDistributedSampler(DistributedSampler):
    """Evaluation sampler: each sample on one replica, no padding, contiguous shares proportional to ``weights``
    (at least ``min_share``; a set smaller than the replicas repeated whole first)."""

    def __init__(self, dataset: Sized, weights: Sequence[float], rank: int, *, min_share: int = 1) -> None:
        super().__init__(dataset, num_replicas=len(weights), rank=rank, shuffle=False, drop_last=False)
        n = len(dataset)
        self.repeats = math.ceil(len(weights) / n) if 0 < n < len(weights) else 1
        total = n * self.repeats
        floor = max(1, min(int(min_share), total // len(weights)))
        sizes = allocate_batch_sizes(total, weights, min_batch_size=floor) if total else [0] * len(weights)
        self.start, self.num_samples, self.total_size, self._length = sum(sizes[:rank]), sizes[rank], total, n

    def __iter__(self) -> Iterator[int]:
        return iter(i % self._length for i in range(self.start, self.start + self.num_samples))


def eval_batch_plan(length: int, weights: Sequence[float], batch_size: int) -> tuple[list[int], list[list[int]]]:
    """``(shares, batch_sizes)`` of an evaluation set: every replica runs as many batches, whatever the weights.

    >>> eval_batch_plan(41, [1.0, 3.0], 5)
    ([10, 31], [[2, 2, 2, 2, 2], [7, 6, 6, 6, 6]])
    >>> eval_batch_plan(2, [1.0, 1.0, 1.0], 4)  # fewer samples than replicas: the set is evaluated twice
    ([2, 1, 1], [[2], [1], [1]])
    """
    world = len(weights)
    if world < 1 or int(batch_size) < 1:
        raise ValueError(f"Expected at least one weight and a positive `batch_size`, got {weights}, {batch_size}.")
    total = length * (math.ceil(world / length) if 0 < length < world else 1)
    if total == 0:
        return [0] * world, [[] for _ in range(world)]
    steps = min(math.ceil(total / (int(batch_size) * world)), total // world)
    shares = allocate_batch_sizes(total, weights, min_batch_size=steps)
    return shares, [[n // steps + (k < n % steps) for k in range(steps)] for n in shares]


class EvalBatchSampler(BatchSampler):
    """Evaluation batches, as many on every replica, sized by ``weights`` (a callable is read at each iteration)."""

    def __init__(
        self, dataset: Sized, weights: Sequence[float] | Callable[[], Sequence[float]], rank: int, batch_size: int
    ) -> None:
        super().__init__(range(len(dataset)), int(batch_size), drop_last=False)
        self.weights, self.rank = weights if callable(weights) else (lambda: weights), rank
        shares, plan = self.plan()  # the number of steps and the repeats are the same whatever the weights
        self.repeats, self._steps = max(1, sum(shares) // max(len(dataset), 1)), len(plan[0])

    def plan(self) -> tuple[list[int], list[list[int]]]:
        return eval_batch_plan(len(self.sampler), self.weights(), self.batch_size)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[list[int]]:
        shares, plan = self.plan()
        start, n = sum(shares[: self.rank]), len(self.sampler)  # type: ignore[arg-type]
        for size in plan[self.rank]:
            yield [i % n for i in range(start, start + size)]
            start += size

    def __len__(self) -> int:
        return self._steps


def training_sampler(loaders: Iterable[Any]) -> ProportionalDistributedSampler | None:
    """The first :class:`ProportionalDistributedSampler` among ``loaders`` (Lightning's flattened train loaders)."""
    pairs = [(d.sampler, getattr(d.batch_sampler, "sampler", None)) for d in loaders if isinstance(d, DataLoader)]
    return next((s for pair in pairs for s in pair if isinstance(s, ProportionalDistributedSampler)), None)
