"""Pure maths of semi-dynamic rebalancing: new speeds from measured step times, and when to act on them.

Nothing here touches ``torch.distributed``. The strategy all-gathers every replica's measured compute times at an
epoch boundary and calls :func:`plan_rebalance` with the same arguments on every rank; the functions are
deterministic, so every rank reaches the same decision without further communication.

Model. Replica ``r`` runs ``b_r`` samples per step and is *busy* (forward + backward compute, emulated slowdown
included) for ``t_r`` seconds, then waits for the slowest replica in the gradient all-reduce. The step takes about
``max_r t_r`` and the job is balanced when all ``t_r`` are equal. Re-estimating ``speed_r = b_r / t_r`` at the batch
size the replica actually runs and re-allocating in proportion is a fixed-point iteration whose fixed point has equal
busy times even when a step costs ``c_r + b_r / v_r`` (a per-step overhead), so repeated checks converge to balance.

Hysteresis (so that timing noise does not make the allocation churn), both conditions must hold:

1. the measured *imbalance* ``max_r t_r / min_r t_r`` is at least ``threshold`` (default 1.1), and
2. the new allocation shortens the step by at least ``min_gain`` (default 3 %) *even if every measured time is off
   by up to* ``noise`` (default ``(threshold - 1) / (threshold + 1)``, 4.8 % for 1.1) in the least favourable
   direction: a replica that would get more samples may be that much slower than measured while the others are
   that much faster (:func:`robust_step_ratio`).

A balanced job whose medians are off by less than ``noise`` fails (1), and an allocation that is only "better"
within the measurement error (typically a neighbour of the current one when integer granularity limits the balance)
fails (2), every epoch, instead of oscillating. A real change (a replica 2x slower) passes both by a wide margin.

Transients: when the slowest replica's time rose by ``surge`` (default 1.25x) or more since the previous epoch at the
*same* batch sizes but its later half-epoch is back below that rise, the disturbance (a neighbour's job, a burst of
I/O on a shared machine) has passed, and the check keeps the split instead of re-allocating for it (which would
unbalance the next epoch). A change that lasts to the end of the epoch is acted on at once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from lightning_het.balance.allocation import allocate_batch_sizes
from lightning_het.balance.cost import allocate_affine, refresh_costs

__all__ = [
    "DEFAULT_MIN_GAIN",
    "DEFAULT_SURGE",
    "DEFAULT_THRESHOLD",
    "RebalanceDecision",
    "imbalance",
    "is_check_epoch",
    "plan_rebalance",
    "predicted_step_time",
    "robust_step_ratio",
    "speeds_from_step_times",
]

#: imbalance (max / min busy time) from which a check may re-allocate, when the user gives no threshold
DEFAULT_THRESHOLD = 1.1
#: smallest predicted relative shortening of the step that justifies a new allocation
DEFAULT_MIN_GAIN = 0.03
#: rise of the slowest replica's time since the previous epoch (same batch sizes) that is confirmed before acting
DEFAULT_SURGE = 1.25


def _check_times(name: str, values: Sequence[float], world: int | None = None) -> list[float]:
    out = [float(v) for v in values]
    if not out:
        raise ValueError(f"Expected argument `{name}` to be non-empty.")
    if world is not None and len(out) != world:
        raise ValueError(f"Expected argument `{name}` to hold one entry per replica ({world}), but got {len(out)}.")
    for rank, value in enumerate(out):
        if not math.isfinite(value) or value <= 0:
            raise ValueError(
                f"Expected argument `{name}` to hold positive finite numbers, but `{name}[{rank}]` is {value!r}."
            )
    return out


def speeds_from_step_times(batch_sizes: Sequence[int], compute_times: Sequence[float]) -> list[float]:
    """Throughput of every replica in samples/s, ``b_r / t_r``, measured at the batch size it ran.

    Args:
        batch_sizes: samples per step of each replica during the measurement, indexed by global rank.
        compute_times: typical busy seconds per step of each replica (e.g. the median over an epoch).

    Raises:
        ValueError: naming the argument, for non-positive or non-finite times, or lengths that differ.

    >>> speeds_from_step_times([8, 4], [0.1, 0.1])
    [80.0, 40.0]
    """
    sizes = [int(b) for b in batch_sizes]
    times = _check_times("compute_times", compute_times, len(sizes))
    if any(b < 1 for b in sizes):
        raise ValueError(f"Expected argument `batch_sizes` to hold positive integers, but got {sizes}.")
    return [b / t for b, t in zip(sizes, times)]


def imbalance(compute_times: Sequence[float]) -> float:
    """``max / min`` of the replicas' busy times per step: 1.0 is perfect balance.

    >>> imbalance([0.2, 0.1, 0.1])
    2.0
    """
    times = _check_times("compute_times", compute_times)
    return max(times) / min(times)


def predicted_step_time(batch_sizes: Sequence[int], speeds: Sequence[float]) -> float:
    """Seconds per step under the proportional model: the slowest replica's ``b_r / v_r``.

    >>> predicted_step_time([2, 4], [10.0, 10.0])
    0.4
    """
    rates = _check_times("speeds", speeds, len(batch_sizes))
    return max(b / v for b, v in zip(batch_sizes, rates))


def is_check_epoch(epoch: int, every_n_epochs: int | None) -> bool:
    """Whether the end of 0-based ``epoch`` is a rebalancing check (every ``every_n_epochs``-th epoch end).

    >>> [is_check_epoch(e, 2) for e in range(4)]
    [False, True, False, True]
    """
    if every_n_epochs is None:
        return False
    return (epoch + 1) % every_n_epochs == 0


def robust_step_ratio(
    batch_sizes: Sequence[int], proposal: Sequence[int], compute_times: Sequence[float], noise: float
) -> float:
    """Worst-case ``step time(proposal) / step time(current)`` when every measured time may be off by ``noise``.

    Replica ``r``'s time per sample is ``t_r / b_r`` up to a factor in ``[1 - noise, 1 + noise]``. The adversary
    makes one replica ``r`` slow (``1 + noise``) and every other one fast (``1 - noise``); the ratio is the maximum
    over ``r`` of ``t'_r (1 + noise) / max(t_r (1 + noise), max_{s != r} t_s (1 - noise))`` with
    ``t'_r = t_r b'_r / b_r``. With ``noise = 0`` it is the plain predicted ratio ``max t' / max t``.

    >>> round(robust_step_ratio([8, 8], [12, 4], [0.1, 0.3], 0.0), 12)
    0.5
    """
    times = _check_times("compute_times", compute_times, len(batch_sizes))
    if len(proposal) != len(times):
        raise ValueError(f"Expected argument `proposal` to hold one entry per replica ({len(times)}).")
    return _robust_ratio(times, [t * b_new / b for b, b_new, t in zip(batch_sizes, proposal, times)], noise)


def _robust_ratio(times: Sequence[float], new_times: Sequence[float], noise: float) -> float:
    """:func:`robust_step_ratio` with each replica's predicted time under the proposal given directly."""
    up, down = 1.0 + noise, 1.0 - noise
    worst = 0.0
    for r, (t, t_new) in enumerate(zip(times, new_times)):
        others = max((t_s * down for s, t_s in enumerate(times) if s != r), default=0.0)
        worst = max(worst, t_new * up / max(t * up, others))
    return worst


@dataclass(frozen=True)
class RebalanceDecision:
    """Outcome of one rebalancing check (identical on every rank).

    Attributes:
        adopt: whether the job should switch to ``batch_sizes``.
        batch_sizes: the allocation to run next: the proposal when adopted, else the current one (same sum).
        proposed: the best allocation for the measured speeds, adopted or not.
        speeds: re-estimated samples/s of every replica, ``b_r / t_r`` at the current allocation.
        imbalance: measured ``max / min`` busy time under the current allocation.
        current_step_s: measured slowest busy time per step, ``max_r t_r``, in seconds.
        predicted_step_s: the proposal's slowest ``b'_r / v_r``, in seconds.
        gain: predicted relative shortening of the step, ``1 - predicted / current``.
        robust_gain: the shortening guaranteed when the times are off by up to the tolerated noise,
            ``1 - robust_step_ratio(...)`` (what the hysteresis compares with ``min_gain``).
        reason: one line saying why the allocation changes or stays.
        costs: with the affine model (``fixed_costs`` given), each replica's refreshed cost as
            ``{"fixed_s", "per_sample_s"}``; else ``None``.
    """

    adopt: bool
    batch_sizes: list[int]
    proposed: list[int]
    speeds: list[float]
    imbalance: float
    current_step_s: float
    predicted_step_s: float
    gain: float
    robust_gain: float
    reason: str = field(default="")
    costs: list[dict[str, float]] | None = field(default=None)

    def as_dict(self) -> dict[str, object]:
        """Plain data, for reports and loggers."""
        return {
            "adopt": self.adopt,
            "batch_sizes": list(self.batch_sizes),
            "proposed": list(self.proposed),
            "speeds": list(self.speeds),
            "imbalance": self.imbalance,
            "current_step_s": self.current_step_s,
            "predicted_step_s": self.predicted_step_s,
            "gain": self.gain,
            "robust_gain": self.robust_gain,
            "reason": self.reason,
            "costs": self.costs,
        }


def plan_rebalance(
    batch_sizes: Sequence[int],
    compute_times: Sequence[float],
    *,
    threshold: float = DEFAULT_THRESHOLD,
    min_gain: float = DEFAULT_MIN_GAIN,
    noise: float | None = None,
    min_batch_size: int = 1,
    max_batch_sizes: Sequence[int] | None = None,
    fixed_costs: Sequence[float] | None = None,
    previous: Sequence[tuple[int, float] | None] | None = None,
    last_times: Sequence[float] | None = None,
    recent_times: Sequence[float] | None = None,
    surge: float = DEFAULT_SURGE,
) -> RebalanceDecision:
    """Decide whether to re-allocate the global batch from measured busy times, with hysteresis.

    The global batch ``sum(batch_sizes)`` is kept; the new sizes come from
    :func:`~lightning_het.balance.allocation.allocate_batch_sizes` with the re-estimated speeds and the same bounds,
    so equal step counts and exact gradients are unaffected (only the split of each global batch changes).

    Args:
        batch_sizes: current samples per step of each replica, indexed by global rank.
        compute_times: each replica's typical busy seconds per step at ``batch_sizes`` (median over the window).
        threshold: act only when ``max / min`` busy time is at least this (>= 1).
        min_gain: adopt only when the step time falls by at least this fraction (in [0, 1)) even in the worst case
            allowed by ``noise``.
        noise: relative error of the measured times to tolerate (in [0, 1)); default
            ``(threshold - 1) / (threshold + 1)``, the error that alone could produce an imbalance of ``threshold``.
        min_batch_size: lower bound per replica, as for the initial allocation.
        max_batch_sizes: upper bounds per replica (device memory), as for the initial allocation.
        fixed_costs: each replica's fixed seconds per step from profiling: the affine model. The slopes are refreshed
            from ``compute_times`` (:func:`~lightning_het.balance.cost.refresh_costs`), the proposal minimises the
            predicted step (:func:`~lightning_het.balance.cost.allocate_affine`) and the predicted times are
            ``a_r + c_r * b'_r``; no replica more than doubles its batch (+2) in one check. ``None``: the one-number
            model (``a_r = 0``).
        previous: with ``fixed_costs``: each replica's ``(batch size, median compute seconds)`` of the latest earlier
            epoch that ran a different batch size, or ``None``; the line through it and the current measurement then
            gives the replica's cost (see :func:`~lightning_het.balance.cost.refresh_costs`).
        last_times: each replica's busy seconds in the previous epoch when it ran the *same* ``batch_sizes``
            (``None``: no such epoch).
        recent_times: each replica's busy seconds over the later part of this epoch (``None``: not known). When the
            slowest replica's time rose by ``surge`` or more over ``last_times`` but its recent time did not, the
            rise was transient and the allocation stays.
        surge: see ``recent_times`` (> 1).

    Returns:
        The decision; ``decision.adopt`` is true only when both hysteresis conditions hold and the sizes change.

    Raises:
        ValueError: naming the argument, for invalid times, thresholds or bounds.

    >>> d = plan_rebalance([8, 8], [0.1, 0.3])
    >>> d.adopt, d.batch_sizes
    (True, [12, 4])
    >>> plan_rebalance([12, 4], [0.101, 0.099]).adopt
    False
    """
    sizes = [int(b) for b in batch_sizes]
    times = _check_times("compute_times", compute_times, len(sizes))
    if not math.isfinite(threshold) or threshold < 1.0:
        raise ValueError(f"Expected argument `threshold` to be a finite number >= 1, but got {threshold!r}.")
    if not math.isfinite(min_gain) or not 0.0 <= min_gain < 1.0:
        raise ValueError(f"Expected argument `min_gain` to be in [0, 1), but got {min_gain!r}.")
    if noise is None:
        noise = (threshold - 1.0) / (threshold + 1.0)
    if not math.isfinite(noise) or not 0.0 <= noise < 1.0:
        raise ValueError(f"Expected argument `noise` to be in [0, 1), but got {noise!r}.")
    if not math.isfinite(surge) or surge <= 1.0:
        raise ValueError(f"Expected argument `surge` to be a finite number > 1, but got {surge!r}.")
    last = _check_times("last_times", last_times, len(sizes)) if last_times is not None else None
    recent = _check_times("recent_times", recent_times, len(sizes)) if recent_times is not None else None
    speeds = speeds_from_step_times(sizes, times)
    ratio = max(times) / min(times)
    current = max(times)
    bounds = {"min_batch_size": min_batch_size, "max_batch_sizes": max_batch_sizes}
    costs = None
    if fixed_costs is None:
        proposal = allocate_batch_sizes(sum(sizes), speeds, **bounds)
        new_times = [t * b_new / b for b, b_new, t in zip(sizes, proposal, times)]
    else:
        costs = refresh_costs(sizes, times, fixed_costs, previous)
        # trust region: a replica at most doubles its batch (+2) per check, so a cost extrapolated far beyond what
        # was measured cannot pile the batch onto one replica; the bounds still hold the total (sum >= 2B)
        upper = max_batch_sizes if max_batch_sizes is not None else [sum(sizes)] * len(sizes)
        trusted = [max(min(hi, 2 * b + 2), min_batch_size, 1) for b, hi in zip(sizes, upper)]
        proposal = allocate_affine(sum(sizes), costs, min_batch_size=min_batch_size, max_batch_sizes=trusted)
        new_times = [c(b) for c, b in zip(costs, proposal)]
    predicted = max(new_times)
    gain = 1.0 - predicted / current
    robust_gain = 1.0 - _robust_ratio(times, new_times, noise)
    slowest = times.index(current)
    rise = current / last[slowest] if last is not None else 1.0
    recent_rise = recent[slowest] / last[slowest] if last is not None and recent is not None else rise
    if ratio < threshold:
        adopt, reason = False, f"imbalance {ratio:.3f} below threshold {threshold:.3f}"
    elif rise >= surge and recent_rise < surge:
        adopt, reason = (
            False,
            f"imbalance {ratio:.3f}, but rank {slowest}'s step rose {rise:.2f}x since the previous epoch at the same"
            f" batch sizes and is back to {recent_rise:.2f}x in the later half of the epoch: a transient",
        )
    elif proposal == sizes:
        adopt, reason = False, f"imbalance {ratio:.3f}, but the best allocation is the current one"
    elif robust_gain < min_gain:
        adopt, reason = (
            False,
            f"imbalance {ratio:.3f}, but the gain ({gain:.1%} predicted) may be noise: {robust_gain:.1%} with"
            f" +-{noise:.1%} timing error < {min_gain:.1%}",
        )
    else:
        adopt, reason = True, f"imbalance {ratio:.3f} >= {threshold:.3f}, predicted gain {gain:.1%}"
    return RebalanceDecision(
        adopt=adopt,
        batch_sizes=proposal if adopt else sizes,
        proposed=proposal,
        speeds=speeds,
        imbalance=ratio,
        current_step_s=current,
        predicted_step_s=predicted,
        gain=gain,
        robust_gain=robust_gain,
        reason=reason,
        costs=[c.as_dict() for c in costs] if costs is not None else None,
    )
