"""The allocation (an immutable value with its plain-data form) and the split of the step being trained."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any, NamedTuple

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

    def as_dict(self) -> dict[str, Any]:
        """Plain data (what a spawned worker sends back to the parent)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Allocation:
        known = {f.name: data[f.name] for f in fields(cls) if data.get(f.name) is not None}
        costs = known.pop("cost_model", None)
        return cls(**known, cost_model=[AffineCost.from_dict(c) for c in costs] if costs else None)
