"""Affine per-replica cost model and the allocation that minimises the step time under it."""

from __future__ import annotations

import heapq
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lightning_het.allocation import batch_bounds, positive_finite

#: a useless replica is reported when the job is predicted this much faster without it (less may be timing noise)
USELESS_MARGIN = 0.9
#: least fitted slope, as a fraction of the mean seconds per sample (a flat curve would attract every sample)
_MIN_SLOPE_FRACTION = 0.01


@dataclass(frozen=True)
class AffineCost:
    """Seconds of local compute for a step of ``b`` samples on one replica: ``fixed_s + per_sample_s * b``."""

    fixed_s: float
    per_sample_s: float
    micro_batch: int | None = None

    def __post_init__(self) -> None:
        for name in ("fixed_s", "per_sample_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"Expected `{name}` to be a finite number >= 0, but got {value!r}.")
        if self.fixed_s == 0 and self.per_sample_s == 0:
            raise ValueError("Expected a cost with `fixed_s` > 0 or `per_sample_s` > 0, but both are 0.")
        m = self.micro_batch
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise ValueError(f"Expected `micro_batch` to be an integer >= 1 or None, but got {m!r}.")

    def __call__(self, batch_size: float) -> float:
        """Predicted seconds for a step of ``batch_size`` samples (in pieces of at most ``micro_batch``)."""
        pieces = 1 if self.micro_batch is None else max(math.ceil(batch_size / self.micro_batch), 1)
        return self.fixed_s * pieces + self.per_sample_s * batch_size

    def as_dict(self) -> dict[str, float]:
        """Plain data, for reports and the speed cache (``micro_batch`` only when set)."""
        out = {"fixed_s": self.fixed_s, "per_sample_s": self.per_sample_s}
        return out if self.micro_batch is None else {**out, "micro_batch": self.micro_batch}

    @classmethod
    def from_dict(cls, data: dict[str, float]) -> AffineCost:
        micro = data.get("micro_batch")
        return cls(float(data["fixed_s"]), float(data["per_sample_s"]), None if micro is None else int(micro))


def costs_from_speeds(speeds: Sequence[float]) -> list[AffineCost]:
    """The one-number model as affine costs: ``a_r = 0``, ``c_r = 1 / speed_r``."""
    return [AffineCost(0.0, 1.0 / s) for s in positive_finite("speeds", speeds)]


def slope_through_origin(batch_sizes: Sequence[float], seconds: Sequence[float]) -> float:
    """Least-squares seconds per sample of the line through the origin, ``seconds ~ slope * batch``."""
    return sum(b * t for b, t in zip(batch_sizes, seconds)) / sum(b * b for b in batch_sizes)


def fit_affine(batch_sizes: Sequence[float], seconds: Sequence[float]) -> AffineCost:
    """Least-squares ``seconds ~ fixed_s + per_sample_s * batch`` from timed steps, both coefficients kept >= 0."""
    xs, ys = [float(b) for b in batch_sizes], [float(t) for t in seconds]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    if len(set(xs)) == 1:
        return AffineCost(0.0, my / mx)
    slope, intercept = statistics.linear_regression(xs, ys)
    if intercept < 0:
        slope, intercept = slope_through_origin(xs, ys), 0.0
    if slope < _MIN_SLOPE_FRACTION * my / mx:  # a flat curve would attract every sample
        slope = _MIN_SLOPE_FRACTION * my / mx
        intercept = max(my - slope * mx, 0.0)
    return AffineCost(round(intercept, 15), round(slope, 15))


def step_time(batch_sizes: Sequence[int], costs: Sequence[AffineCost]) -> float:
    """Predicted seconds per step of an allocation: ``max_r t_r(b_r)``."""
    return max(c(b) for b, c in zip(batch_sizes, costs, strict=True))


def allocate_affine(
    global_batch_size: int,
    costs: Sequence[AffineCost],
    *,
    min_batch_size: int = 1,
    max_batch_sizes: Sequence[int] | None = None,
) -> list[int]:
    """The split of ``global_batch_size`` minimising the step ``max_r t_r(b_r)`` (greedy from the lower bounds)."""
    lower, upper = batch_bounds(len(costs), global_batch_size, min_batch_size, max_batch_sizes)
    sizes = list(lower)
    heap = [(costs[r](sizes[r] + 1), r) for r in range(len(costs)) if sizes[r] < upper[r]]
    heapq.heapify(heap)
    for _ in range(global_batch_size - sum(sizes)):  # to the least-growing step (ties: lower rank): exact, costs rising
        _, r = heapq.heappop(heap)
        sizes[r] += 1
        if sizes[r] < upper[r]:
            heapq.heappush(heap, (costs[r](sizes[r] + 1), r))
    return sizes


def useless_replica_message(
    global_batch_size: int, costs: Sequence[AffineCost], batch_sizes: Sequence[int], labels: list[str], **bounds: Any
) -> str | None:
    """The warning about the replicas whose fixed cost alone is at least the best step the others reach without them,
    when leaving them all out is predicted ``USELESS_MARGIN`` faster (less may be timing noise); else ``None``."""

    upper = bounds.pop("max_batch_sizes", None)

    def without(dropped: Sequence[int]) -> float | None:  # the best step of the others (None: they cannot hold it)
        keep = [r for r in range(len(costs)) if r not in dropped]
        kept = [costs[r] for r in keep]
        try:
            sizes = allocate_affine(
                global_batch_size, kept, max_batch_sizes=upper and [upper[r] for r in keep], **bounds
            )
        except ValueError:  # none left, or too few to hold the global batch
            return None
        return step_time(sizes, kept)

    best = [without([r]) for r in range(len(costs))]
    useless = [r for r, (cost, t) in enumerate(zip(costs, best)) if t is not None and cost.fixed_s >= t]
    with_all, faster = step_time(batch_sizes, costs), without(useless) if useless else None
    if faster is None or faster > USELESS_MARGIN * with_all:
        return None
    label = [labels[r] if r < len(labels) else f"rank {r}" for r in range(len(costs))]
    names = ", ".join(f"rank {r} ({label[r]})" for r in useless)
    fixed = ", ".join(f"{costs[r].fixed_s * 1e3:.1f} ms" for r in useless)
    keep = [label[r] for r in range(len(costs)) if r not in useless]
    return (
        f"HeterogeneousStrategy: {names} only slow(s) the job down: its fixed cost per step ({fixed}) is at least the"
        f" best step the other replicas reach on the whole global batch of {global_batch_size}. Predicted step:"
        f" {with_all * 1e3:.1f} ms with it, {faster * 1e3:.1f} ms without. HINT: leave it out, e.g. with"
        f" `Trainer(devices=...)` set to {len(keep)} devices, or `HeterogeneousStrategy(device_map={keep})`."
    )
