"""Pure maths of semi-dynamic rebalancing: new speeds from measured step times, and when to act on them."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_het.allocation import allocate_batch_sizes, positive_finite
from lightning_het.balance.cost import AffineCost, allocate_affine, step_time

#: imbalance (max / min busy time) from which a check may re-allocate, when the user gives no threshold
DEFAULT_THRESHOLD = 1.1
#: smallest predicted relative shortening of the step that justifies a new allocation
DEFAULT_MIN_GAIN = 0.03
#: what a re-allocation costs (the training loader rebuilt, its workers restarted), in step times
REALLOCATION_COST_STEPS = 2.0


def profiled_split(
    global_batch: int, costs: Sequence[AffineCost], *, threshold: float = DEFAULT_THRESHOLD, **bounds: object
) -> list[int]:
    """The split of ``global_batch`` for profiled ``costs``."""
    upper = bounds.get("max_batch_sizes") or [global_batch] * len(costs)
    sizes = monotone_split(allocate_affine(global_batch, costs, **bounds), costs, upper)  # type: ignore[arg-type]
    equal = allocate_batch_sizes(global_batch, [1.0] * len(costs), **bounds)  # type: ignore[arg-type]
    mean_share = [cost(global_batch / len(costs)) for cost in costs]  # each replica's step at the mean share
    faster = step_time(sizes, costs) <= (1.0 - DEFAULT_MIN_GAIN) * step_time(equal, costs)
    return sizes if max(mean_share) >= threshold * min(mean_share) and faster else equal


def monotone_split(batch_sizes: Sequence[int], costs: Sequence[AffineCost], upper: Sequence[int]) -> list[int]:
    """``batch_sizes`` with no replica holding fewer samples than a slower one (swapped within the bounds ``upper``)."""
    sizes = [int(b) for b in batch_sizes]
    order = sorted(range(len(sizes)), key=lambda r: (costs[r].per_sample_s, costs[r].fixed_s, r))
    for _ in range(len(sizes)):
        changed = False
        for i, j in itertools.pairwise(order):  # i is at least as fast per sample as j
            faster = costs[i].fixed_s <= costs[j].fixed_s and costs[i].per_sample_s <= costs[j].per_sample_s
            if faster and sizes[i] < sizes[j] and sizes[j] <= upper[i]:
                sizes[i], sizes[j] = sizes[j], sizes[i]
                changed = True
        if not changed:
            break
    return sizes


@dataclass(frozen=True)
class RebalanceDecision:
    """Outcome of one rebalancing check (identical on every rank)."""

    adopt: bool
    batch_sizes: list[int]
    proposed: list[int]
    speeds: list[float]
    imbalance: float
    current_step_s: float
    predicted_step_s: float
    gain: float
    robust_gain: float
    reason: str = ""
    costs: list[dict[str, float]] | None = None


def plan_rebalance(
    batch_sizes: Sequence[int],
    compute_times: Sequence[float],
    *,
    threshold: float = DEFAULT_THRESHOLD,
    min_gain: float = DEFAULT_MIN_GAIN,
    min_batch_size: int = 1,
    max_batch_sizes: Sequence[int] | None = None,
    fixed_costs: Sequence[float] | None = None,
    micro_batch_sizes: Sequence[int | None] | None = None,
    uncertainty: Sequence[float] | None = None,
    reallocation_cost: float = 0.0,
) -> RebalanceDecision:
    """Decide whether to re-allocate the global batch from measured busy times (``uncertainty``: their relative
    standard errors, none if not given): the predicted gain must exceed ``min_gain`` and its doubt."""
    sizes = [int(b) for b in batch_sizes]
    times = positive_finite("compute_times", compute_times, len(sizes))
    if any(b < 1 for b in sizes):
        raise ValueError(f"Expected argument `batch_sizes` to hold positive integers, but got {sizes}.")
    speeds = [b / t for b, t in zip(sizes, times)]  # samples/s at the sizes run
    current = max(times)
    ratio = current / min(times)
    # the costs refreshed per micro-batch (a share of b run as k pieces is k steps of b / k), fixed costs kept
    caps = micro_batch_sizes if micro_batch_sizes is not None else [None] * len(sizes)
    pieces = [1 if m is None else max(math.ceil(b / m), 1) for b, m in zip(sizes, caps)]
    fixed = [min(a, 0.9 * t / k) for a, t, k in zip(fixed_costs or [0.0] * len(sizes), times, pieces)]  # <= 90 %
    costs = [
        AffineCost(round(a, 15), round((t / k - a) / (b / k), 15), m)
        for a, t, k, b, m in zip(fixed, times, pieces, sizes, caps)
    ]
    # trust region: at most double a replica's batch (+2) per check, so no extrapolated cost piles the batch on it
    upper = max_batch_sizes if max_batch_sizes is not None else [sum(sizes)] * len(sizes)
    trusted = [max(min(hi, 2 * b + 2), min_batch_size, 1) for b, hi in zip(sizes, upper)]
    proposal = allocate_affine(sum(sizes), costs, min_batch_size=min_batch_size, max_batch_sizes=trusted)
    proposal = monotone_split(proposal, costs, trusted)
    predicted = max(c(b) for c, b in zip(costs, proposal))
    gain = 1.0 - predicted / current
    # the standard error of the gain: the current slowest replica's and that of those given more samples
    errors = [0.0] * len(sizes) if uncertainty is None else uncertainty
    growing = max((float(e) for e, b, b_new in zip(errors, sizes, proposal) if b_new > b), default=0.0)
    spread = _CONFIDENCE * (predicted / current) * math.hypot(errors[times.index(current)], growing)
    net, adopt = gain - reallocation_cost, False
    if ratio < threshold:
        reason = f"imbalance {ratio:.3f} below threshold {threshold:.3f}"
    elif proposal == sizes:
        reason = f"imbalance {ratio:.3f}, but the best allocation is the current one"
    elif net < max(min_gain, spread):
        reason = (
            f"imbalance {ratio:.3f}, but the gain ({gain:.1%} predicted) may be noise: {net:.1%} net of a"
            f" re-allocation's cost of {reallocation_cost:.1%}, below {max(min_gain, spread):.1%} (the least gain, or"
            f" {_CONFIDENCE} standard errors of the gain)"
        )
    else:
        adopt, reason = True, f"imbalance {ratio:.3f} >= {threshold:.3f}, predicted gain {gain:.1%}"
    kept, data = (proposal if adopt else sizes), [c.as_dict() for c in costs]
    robust = net - spread
    return RebalanceDecision(adopt, kept, proposal, speeds, ratio, current, predicted, gain, robust, reason, data)


#: standard errors by which a gain must exceed its doubt (about 93 % one-sided)
_CONFIDENCE = 1.5
#: relative spread of one check's timings assumed until the checks themselves show theirs (a shared machine's)
PRIOR_SPREAD = 0.25
#: weight, in checks, of :data:`PRIOR_SPREAD` in the spread estimate
_PRIOR_CHECKS = 3.0
#: a check's cost this many spreads away from a replica's smoothed one is a candidate change of that replica's speed
_SHIFT_SPREADS = 2.5
#: the mean of two checks confirms a change beyond this fraction of the single-check band (about 2.1 spreads)
_CONFIRM = 1.2 / math.sqrt(2.0)
#: checks kept in a replica's smoothed cost (the oldest is dropped beyond)
_WINDOW = 50


class Track:
    """One replica's cost scale over the checks, in log space: a level (the mean since its last confirmed change) and
    the spread of a check around it (pooled over the stretches between changes, from a prior)."""

    def __init__(self) -> None:
        self.values: list[float] = []  # log scales since the last confirmed change
        #: squared deviations and degrees of freedom of the earlier stretches, the prior included
        self.pooled = [_PRIOR_CHECKS * PRIOR_SPREAD**2, _PRIOR_CHECKS]
        self.previous = 0.0  # the previous check's value (read once there is one)

    @property
    def level(self) -> float:
        return sum(self.values) / len(self.values)

    @property
    def spread(self) -> float:
        """Standard deviation of one check's log scale."""
        level = self.level
        squares = self.pooled[0] + sum((v - level) ** 2 for v in self.values)
        return math.sqrt(squares / (self.pooled[1] + len(self.values) - 1))

    def add(self, x: float, recent: float | None) -> None:
        """Book one check's log scale ``x`` (``recent``: that of the later half of its epoch, if known)."""
        previous, self.previous = self.previous, x
        if not self.values:
            self.values.append(x)
            return
        level = self.level
        spread = self.spread * math.sqrt(1.0 + 1.0 / len(self.values))  # of a check around the estimated level
        band = _SHIFT_SPREADS * spread
        deviation = x - level
        both = 0.5 * (previous + x) - level  # the mean deviation of this check and the previous one
        if _beyond(previous - level, deviation, spread) and _beyond(both, deviation, band * _CONFIRM):
            self._restart([previous, x])  # two checks agree: the replica's speed changed
        elif recent is not None and _beyond(recent - level, deviation, band):
            self._restart([x])  # both halves of the epoch agree
        elif abs(deviation) <= band:
            self.values = [*self.values, x][-_WINDOW:]
        # else: an outlier, kept out of the level (the next check may confirm it)

    def _restart(self, values: list[float]) -> None:
        level = self.level
        self.pooled[0] += sum((v - level) ** 2 for v in self.values)
        self.pooled[1] += len(self.values) - 1
        self.values = values


def _beyond(a: float, b: float, band: float) -> bool:
    """Whether deviations ``a`` and ``b`` lie on the same side, both further than ``band``."""
    return a * b > 0 and min(abs(a), abs(b)) > band
