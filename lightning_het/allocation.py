"""Pure maths of static load balancing: per-replica batch sizes, sample shares and loss scales."""

from __future__ import annotations

import math
from collections.abc import Sequence

_BISECTION_STEPS = 200


def positive_finite(name: str, values: Sequence[float], world: int | None = None) -> list[float]:
    """``values`` as a non-empty list of positive finite floats (``world`` of them when given), else ``ValueError``."""
    try:
        out = [float(v) for v in values]
    except (TypeError, ValueError) as err:
        raise ValueError(f"Expected argument `{name}` to be a sequence of numbers, but got {values!r}.") from err
    if not out:
        raise ValueError(f"Expected argument `{name}` to be non-empty.")
    if world is not None and len(out) != world:
        raise ValueError(f"Expected argument `{name}` to hold one entry per replica ({world}), but got {len(out)}.")
    for rank, value in enumerate(out):
        if not math.isfinite(value) or value <= 0:
            raise ValueError(
                f"Expected argument `{name}` to hold positive finite numbers, but `{name}[{rank}]` is {value!r}"
                f" ({name}={out})."
            )
    return out


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"Expected argument `{name}` to be an integer, but got {value!r}.")
    if value < minimum:
        raise ValueError(f"Expected argument `{name}` to be at least {minimum}, but got {value}.")
    return value


def proportional_shares(
    total: float, speeds: Sequence[float], lower: Sequence[float], upper: Sequence[float]
) -> list[float]:
    """Real-valued shares ``clip(lam * speed_r, lower_r, upper_r)`` that sum to ``total``."""

    def clipped_sum(lam: float) -> float:
        return sum(min(max(lam * s, lo), hi) for s, lo, hi in zip(speeds, lower, upper))

    low, high = 0.0, 1.0
    while clipped_sum(high) < total:
        high *= 2.0
        if high > 1e300:  # total is above sum(upper): the caller broke the precondition
            break
    for _ in range(_BISECTION_STEPS):
        mid = 0.5 * (low + high)
        if clipped_sum(mid) < total:
            low = mid
        else:
            high = mid
    shares = [min(max(high * s, lo), hi) for s, lo, hi in zip(speeds, lower, upper)]
    # remove the last rounding residue so that the shares sum to ``total`` to machine precision
    scale = total / sum(shares) if sum(shares) > 0 else 1.0
    return [min(max(x * scale, lo), hi) for x, lo, hi in zip(shares, lower, upper)]


def batch_bounds(
    world: int, global_batch_size: int, min_batch_size: int, max_batch_sizes: Sequence[int] | None
) -> tuple[list[int], list[int]]:
    """Validated per-replica bounds ``(lower, upper)`` in samples; ``sum(lower) <= global_batch_size <= sum(upper)``."""
    _check_int("global_batch_size", global_batch_size, 1)
    _check_int("min_batch_size", min_batch_size, 0)
    if max_batch_sizes is None:
        upper = [global_batch_size] * world
    else:
        upper = list(max_batch_sizes)
        if len(upper) != world:
            raise ValueError(
                f"Expected argument `max_batch_sizes` to have one entry per replica ({world}), but got {len(upper)}:"
                f" {upper}."
            )
        for rank, bound in enumerate(upper):
            if isinstance(bound, bool) or not isinstance(bound, int) or bound < max(min_batch_size, 1):
                raise ValueError(
                    f"Expected argument `max_batch_sizes` to hold integers >= max(min_batch_size, 1) ="
                    f" {max(min_batch_size, 1)}, but `max_batch_sizes[{rank}]` is {bound!r}."
                )
    if global_batch_size < world * min_batch_size:
        raise ValueError(
            f"`global_batch_size`={global_batch_size} is below what the bounds allow: {world} replicas x"
            f" `min_batch_size`={min_batch_size} = {world * min_batch_size} samples. HINT: raise the global batch"
            " size or lower `min_batch_size`."
        )
    if global_batch_size > sum(upper):
        raise ValueError(
            f"`max_batch_sizes`={upper} cannot hold `global_batch_size`={global_batch_size}: they sum to only"
            f" {sum(upper)}. HINT: lower the global batch size, raise the bounds or add replicas."
        )
    return [min_batch_size] * world, upper


def allocate_batch_sizes(
    global_batch_size: int,
    speeds: Sequence[float],
    *,
    min_batch_size: int = 1,
    max_batch_sizes: Sequence[int] | None = None,
) -> list[int]:
    """Split ``global_batch_size`` samples among replicas in proportion to their ``speeds`` (by global rank, any
    consistent unit), each within ``[min_batch_size, max_batch_sizes[r]]``.

    The sizes sum to ``global_batch_size``; each lies within one sample of its proportional share unless a bound
    forces it away (water filling); largest remainders first, ties to the lower rank. Bad input raises ``ValueError``.
    """
    values = positive_finite("speeds", speeds)
    world = len(values)
    lower, upper = batch_bounds(world, global_batch_size, min_batch_size, max_batch_sizes)
    shares = proportional_shares(global_batch_size, values, lower, upper)
    sizes = [min(max(math.floor(x), lo), hi) for x, lo, hi in zip(shares, lower, upper)]
    remainder = global_batch_size - sum(sizes)
    # largest remainder first; only replicas below their upper bound may take one more sample
    order = sorted(range(world), key=lambda r: (-(shares[r] - sizes[r]), r))
    while remainder > 0:
        progressed = False
        for r in order:
            if remainder == 0:
                break
            if sizes[r] < upper[r]:
                sizes[r] += 1
                remainder -= 1
                progressed = True
        if not progressed:  # pragma: no cover - excluded by the checks above
            raise AssertionError("allocation could not place all samples")
    return sizes


def sample_shares(batch_sizes: Sequence[int]) -> list[float]:
    """Each replica's fraction of the global batch, ``b_r / sum(b)``; the fractions sum to one."""
    total = sum(batch_sizes)
    if total <= 0:
        raise ValueError(f"Expected argument `batch_sizes` to sum to a positive number, but got {list(batch_sizes)}.")
    return [b / total for b in batch_sizes]


def loss_scale(batch_sizes: Sequence[int], rank: int) -> float:
    """Factor ``W * b_r / B`` for replica ``rank``'s mean loss: DDP's *mean* all-reduce then yields the global-batch
    gradient."""
    return len(batch_sizes) * batch_sizes[rank] / sum(batch_sizes)
