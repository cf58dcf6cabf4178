"""The allocation (an immutable value with its plain-data form) and the split of the step being trained."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from lightning_het.allocation import loss_scale
from lightning_het.balance.cost import AffineCost


class StepSplit(NamedTuple):
    """The split of the global batch being trained, computed once at the batch's start."""

    sizes: list[int]
    loss_scale: float  # ``W * b_r / B`` of this replica


@dataclass(frozen=True)
class Allocation:
    """Samples per step and speed (samples/s when measured) of every replica by global rank, the affine costs behind
    them, the micro-batch caps, and the profiling's cost; ``batch_sizes=None``: not allocated yet (plain DDP)."""

    batch_sizes: list[int] | None = None
    speeds: list[float] | None = None
    cost_model: list[AffineCost] | None = None
    micro_caps: list[int] | None = None  # most samples each replica runs at once (None: its whole share)
    profile_seconds: float = 0.0  # estimated seconds the profiling steps cost beyond balanced ones
    profile_cached: bool = False  # the costs came from the speed cache

    @property
    def global_batch_size(self) -> int | None:
        return sum(self.batch_sizes) if self.batch_sizes else None

    def loss_scale(self, rank: int) -> float:
        return loss_scale(self.batch_sizes, rank) if self.batch_sizes else 1.0

    def adopt(self, batch_sizes: list[int], speeds: list[float], costs: list[dict[str, float]] | None = None) -> Any:
        """This allocation with ``batch_sizes`` and ``speeds`` (and refreshed ``costs``, ``AffineCost.as_dict()``)."""
        model = [AffineCost.from_dict(c) for c in costs] if costs is not None else self.cost_model
        return replace(self, batch_sizes=list(batch_sizes), speeds=list(speeds), cost_model=model)

    def with_caps(self, caps: list[int] | None) -> Allocation:
        """This allocation with micro-batch ``caps``, which its cost model follows (a share run in pieces)."""
        costs = self.cost_model
        if costs is not None and caps is not None:
            costs = [c.with_micro_batch(m) for c, m in zip(costs, caps)]
        return replace(self, micro_caps=caps, cost_model=costs)

    def step_split(self, sampler: Any, step: int | None, rank: int) -> StepSplit:
        """The split of global batch ``step`` of ``sampler``: the allocation, a profiling split or the tail's."""
        sizes = list(self.batch_sizes or [])
        own = sampler is not None and step is not None and list(sampler.batch_sizes) == sizes
        if own and (sampler.tail_batch_sizes is not None or sampler.split_schedule is not None):
            sizes = sampler.step_batch_sizes(step)
        return StepSplit(sizes, loss_scale(sizes, rank) if sizes else 1.0)

    def as_dict(self) -> dict[str, Any]:
        """Plain data (what a spawned worker sends back to the parent)."""
        costs = [c.as_dict() for c in self.cost_model] if self.cost_model else None
        return {**self.__dict__, "cost_model": costs}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Allocation:
        costs = data.get("cost_model")
        fields = {k: data.get(k) for k in ("batch_sizes", "speeds", "micro_caps")}
        return cls(
            **fields,
            cost_model=[AffineCost.from_dict(c) for c in costs] if costs else None,
            profile_seconds=data.get("profile_seconds", 0.0),
            profile_cached=bool(data.get("profile_cached", False)),
        )
