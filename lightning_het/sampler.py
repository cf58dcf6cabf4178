"""Samplers that split every global batch unevenly, but reproducibly, among replicas."""

from __future__ import annotations

from collections.abc import Iterator, Sequence, Sized

import torch
from torch.utils.data import DistributedSampler

from lightning_het.balance.allocation import allocate_batch_sizes

__all__ = ["ProportionalDistributedSampler", "UnpaddedDistributedSampler"]


def _global_order(length: int, shuffle: bool, seed: int, epoch: int) -> torch.Tensor:
    """The order in which one process would visit the dataset in ``epoch``: a permutation seeded by ``seed + epoch``."""
    if not shuffle:
        return torch.arange(length)
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    return torch.randperm(length, generator=generator)


class ProportionalDistributedSampler(DistributedSampler):
    """Yields this replica's slice of every global batch, with per-replica batch sizes.

    For a given ``seed`` and epoch, the dataset is permuted once (the same permutation on every replica, seeded with
    ``seed + epoch``) and cut into global batches of ``B = sum(batch_sizes)`` samples. At step ``k`` replica ``r`` takes
    the contiguous slice ``[k*B + o_r, k*B + o_r + b_r)`` where ``o_r = sum(batch_sizes[:r])``. Hence the union of the
    replicas' batches at step ``k`` is exactly the ``k``-th batch that one process with ``batch_sizes=[B]`` would draw.

    Every replica yields ``len(dataset) // B`` batches' worth of indices, so all replicas run the same number of
    steps. The tail of ``len(dataset) % B`` samples that cannot fill a whole global batch is dropped (like
    ``drop_last=True``); a new permutation each epoch means different samples are dropped each epoch.

    Use it with a ``DataLoader(batch_size=batch_sizes[rank], drop_last=False)``; the sampler already yields a whole
    number of batches. Subclasses :class:`~torch.utils.data.DistributedSampler` so that Lightning leaves it alone.

    Args:
        dataset: any sized dataset.
        batch_sizes: samples per step of each replica, indexed by global rank (all positive).
        rank: this replica's global rank.
        shuffle: draw a new permutation every epoch (see :meth:`set_epoch`); otherwise keep the dataset order.
        seed: base seed of the permutation; must be the same on every replica.
    """

    def __init__(
        self,
        dataset: Sized,
        batch_sizes: Sequence[int],
        rank: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        sizes = [int(b) for b in batch_sizes]
        if not sizes or any(b < 1 for b in sizes):
            raise ValueError(f"Expected argument `batch_sizes` to hold positive integers, but got {list(batch_sizes)}.")
        if not 0 <= rank < len(sizes):
            raise ValueError(f"Expected argument `rank` in [0, {len(sizes)}), but got {rank}.")
        global_batch = sum(sizes)
        if len(dataset) < global_batch:
            raise ValueError(
                f"The dataset holds {len(dataset)} samples, fewer than one global batch of {global_batch}"
                f" (batch_sizes={sizes}): no replica could run a single step. HINT: lower the global batch size"
                " or use a larger dataset."
            )
        super().__init__(dataset, num_replicas=len(sizes), rank=rank, shuffle=shuffle, seed=seed, drop_last=True)
        self.batch_sizes = sizes
        self.global_batch_size = global_batch
        self.offset = sum(sizes[:rank])
        self.num_steps = len(dataset) // global_batch
        self.num_samples = self.num_steps * sizes[rank]
        self.total_size = self.num_steps * global_batch
        self._skip: tuple[int, int] | None = None  # (epoch, global batches to skip), set by `resume`

    def resume(self, epoch: int, skip_steps: int) -> None:
        """Continue epoch ``epoch`` after its first ``skip_steps`` global batches (mid-epoch resume).

        The next iteration of that epoch starts at global batch ``skip_steps`` of the same permutation (so it yields
        ``num_steps - skip_steps`` batches); later epochs are whole. ``len()`` keeps counting the whole epoch, as
        Lightning's loop counters do.
        """
        if not 0 <= skip_steps <= self.num_steps:
            raise ValueError(f"Expected argument `skip_steps` in [0, {self.num_steps}], but got {skip_steps}.")
        self.set_epoch(epoch)
        self._skip = (epoch, skip_steps) if skip_steps else None

    @property
    def local_batch_size(self) -> int:
        """Samples per step on this replica."""
        return self.batch_sizes[self.rank]

    def __iter__(self) -> Iterator[int]:
        order = _global_order(len(self.dataset), self.shuffle, self.seed, self.epoch)[: self.total_size]
        start = 0
        if self._skip is not None and self._skip[0] == self.epoch:  # one-shot: the resumed epoch only
            start, self._skip = self._skip[1], None
        steps = order.view(self.num_steps, self.global_batch_size)[start:]
        mine = steps[:, self.offset : self.offset + self.local_batch_size]
        return iter(mine.reshape(-1).tolist())

    def __len__(self) -> int:
        return self.num_samples


class UnpaddedDistributedSampler(DistributedSampler):
    """Evaluation sampler: each sample goes to exactly one replica, no padding, shares proportional to ``weights``.

    Replica ``r`` takes a contiguous block of the dataset in its original order, of size
    ``allocate_batch_sizes(len(dataset), weights, min_batch_size=0)[r]``. Replicas may therefore run different
    numbers of evaluation batches; that is safe as long as metrics are synchronised only at epoch end
    (torchmetrics, or ``self.log(..., on_epoch=True, sync_dist=True)``).
    """

    def __init__(self, dataset: Sized, weights: Sequence[float], rank: int) -> None:
        super().__init__(dataset, num_replicas=len(weights), rank=rank, shuffle=False, drop_last=False)
        sizes = allocate_batch_sizes(len(dataset), weights, min_batch_size=0) if len(dataset) else [0] * len(weights)
        self.shard_sizes = sizes
        self.start = sum(sizes[:rank])
        self.num_samples = sizes[rank]
        self.total_size = len(dataset)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.start + self.num_samples))

    def __len__(self) -> int:
        return self.num_samples
