"""Pure maths of static load balancing: per-replica batch sizes, sample shares and loss scales."""

from __future__ import annotations

import math
from collections.abc import Sequence

from lightning_het.arguments import finite_positive_list, int_list, positive_int


def positive_finite(name: str, values: Sequence[float], world: int | None = None) -> list[float]:
    """``values`` as a non-empty list of positive finite floats (``world`` of them when given), else ``ValueError``."""
    out = finite_positive_list(name, [] if values is None else values) or []  # (an empty list raised)
    if world is not None and len(out) != world:
        raise ValueError(f"Expected argument `{name}` to hold one entry per replica ({world}), but got {len(out)}.")
    return out


def proportional_shares(
    total: float, speeds: Sequence[float], lower: Sequence[float], upper: Sequence[float]
) -> list[float]:
    """Real-valued shares ``clip(lam * speed_r, lower_r, upper_r)`` that sum to ``total`` (``lam`` by bisection)."""

    def shares(lam: float) -> list[float]:
        return [min(max(lam * s, lo), hi) for s, lo, hi in zip(speeds, lower, upper)]

    low, high = 0.0, 1.0
    while sum(shares(high)) < total and high < 1e300:
        high *= 2.0
    for _ in range(200):
        mid = 0.5 * (low + high)
        low, high = (mid, high) if sum(shares(mid)) < total else (low, mid)
    scale = total / sum(shares(high))  # the last rounding residue: the shares sum to ``total``
    return [min(max(x * scale, lo), hi) for x, lo, hi in zip(shares(high), lower, upper)]


def batch_bounds(
    world: int, global_batch_size: int, min_batch_size: int, max_batch_sizes: Sequence[int] | None
) -> tuple[list[int], list[int]]:
    """Validated per-replica bounds ``(lower, upper)`` in samples; ``sum(lower) <= global_batch_size <= sum(upper)``."""
    positive_int("global_batch_size", global_batch_size, allow_none=False)
    positive_int("min_batch_size", min_batch_size, allow_none=False, minimum=0)
    upper = int_list("max_batch_sizes", max_batch_sizes) or [global_batch_size] * world
    positive_finite("max_batch_sizes", upper, world)  # one entry per replica
    small = [r for r, bound in enumerate(upper) if bound < min_batch_size]
    if small:
        raise ValueError(
            f"Expected `max_batch_sizes[{small[0]}]`={upper[small[0]]} >= `min_batch_size`={min_batch_size}."
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
    """``global_batch_size`` samples split in proportion to ``speeds`` (by global rank), each within its bounds and
    one sample of its share unless a bound forces it away; largest remainders first, ties to the lower rank."""
    values = positive_finite("speeds", speeds)
    lower, upper = batch_bounds(len(values), global_batch_size, min_batch_size, max_batch_sizes)
    shares = proportional_shares(global_batch_size, values, lower, upper)
    sizes = [math.floor(x) for x in shares]  # within the (integer) bounds, as the shares are
    # the samples left (fewer than the replicas whose share has a fraction) go to the largest fractions
    for r in sorted(range(len(sizes)), key=lambda r: (sizes[r] - shares[r], r))[: global_batch_size - sum(sizes)]:
        sizes[r] += 1
    return sizes


def loss_scale(batch_sizes: Sequence[int], rank: int) -> float:
    """``W * b_r / B``: replica ``rank``'s loss factor for which DDP's mean gives the global-batch gradient."""
    return len(batch_sizes) * batch_sizes[rank] / sum(batch_sizes)
