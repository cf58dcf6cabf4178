"""Allocation planning (functions of values): the split from speeds or costs, the speed cache, the profiler start."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader

from lightning_het.allocation import allocate_batch_sizes
from lightning_het.balance.cost import AffineCost, useless_replica_message
from lightning_het.balance.monitor import MonitorSettings
from lightning_het.balance.profiler import InLoopProfiler, attach_profiler, loader_prefetch_depth, profile_plan
from lightning_het.balance.profiling import ProfileCache, cache_key
from lightning_het.balance.rebalance import DEFAULT_THRESHOLD, profiled_split
from lightning_het.config import HeterogeneousConfig


def batch_bounds(min_batch_size: int, max_batch_sizes: Sequence[int] | None) -> dict[str, Any]:
    """The keywords that bound every replica's batch in :func:`allocate_batch_sizes` and :func:`allocate_affine`."""
    return {"min_batch_size": min_batch_size, "max_batch_sizes": max_batch_sizes}


def measured_speeds(batch_sizes: list[int], costs: list[AffineCost], bounds: dict[str, Any]) -> list[float]:
    """Samples/s of every replica at the allocation ``batch_sizes``, from its cost per step. The equal split (the
    replicas equally fast within their costs' noise) gets one speed, the mean, so that pinning the speeds gives it
    again.

    >>> measured_speeds([4, 4], [AffineCost(0.0, 0.01), AffineCost(0.0, 0.0125)], batch_bounds(1, None))
    [90.0, 90.0]
    """
    speeds = [b / max(c(b), 1e-12) for b, c in zip(batch_sizes, costs)]
    if batch_sizes == allocate_batch_sizes(sum(batch_sizes), [1.0] * len(speeds), **bounds):
        return [sum(speeds) / len(speeds)] * len(speeds)
    return speeds


def split_global_batch(
    global_batch: int,
    speeds: list[float],
    costs: list[AffineCost] | None,
    bounds: dict[str, Any],
    threshold: float = DEFAULT_THRESHOLD,
) -> tuple[list[int], list[float]]:
    """Batch sizes and speeds: in proportion to ``speeds`` without costs, else minimising the slowest replica's step."""
    if costs is None:
        return allocate_batch_sizes(global_batch, speeds, **bounds), speeds
    batch_sizes = profiled_split(global_batch, costs, threshold=threshold, **bounds)  # cached: as noisy as profiled
    return batch_sizes, measured_speeds(batch_sizes, costs, bounds)


def warn_useless_replicas(
    global_batch: int, costs: list[AffineCost], batch_sizes: list[int], devices: list[str], bounds: dict[str, Any]
) -> None:
    """Warn (rank 0) about replicas that slow the step down more than they help."""
    message = useless_replica_message(global_batch, costs, batch_sizes, devices, **bounds)
    if message is not None:
        rank_zero_warn(message)


def profile_cache_entry(
    setting: str | os.PathLike[str] | bool | None,
    module: torch.nn.Module | None,
    dataloader: DataLoader,
    *,
    precision: str,
    device: torch.device,
    slowdown: float,
    replicas_on_node: int,
) -> tuple[ProfileCache | None, str | None]:
    """The speed cache (``profile_cache``) and this replica's key in it, or ``(None, None)`` when it is off."""
    if setting in (None, False) or module is None:
        return None, None
    directory = ProfileCache.default_directory() if setting is True else setting
    cache = ProfileCache(directory)  # type: ignore[arg-type]
    try:
        sample = dataloader.dataset[0]
    except Exception:  # a dataset we cannot peek into is simply not cached
        return cache, None
    key = cache_key(module, device, sample, precision=precision, slowdown=slowdown, replicas_on_node=replicas_on_node)
    return cache, key


def cached_costs(
    cache: ProfileCache | None, key: str | None, all_gather_floats: Callable[[list[float]], list[list[float]]]
) -> tuple[list[AffineCost], float] | None:
    """Every replica's cost from the speed cache and the threshold their profiling split by, when every replica has
    an entry, else ``None`` (one all-gather)."""
    if cache is None:
        return None
    cached = cache.get(key) if key is not None else None
    threshold = (cache.get_threshold(key) if key is not None else None) or DEFAULT_THRESHOLD
    row = [1.0, cached.fixed_s, cached.per_sample_s, threshold] if cached is not None else [0.0, 0.0, 0.0, 0.0]
    rows = all_gather_floats(row)
    if not all(r[0] == 1.0 for r in rows):
        return None
    return [AffineCost(r[1], r[2]) for r in rows], max(r[3] for r in rows)


def start_profiler(
    dataloader: DataLoader,
    global_batch: int,
    config: HeterogeneousConfig,
    bounds: dict[str, Any],
    *,
    rank: int,
    world_size: int,
    device: torch.device,
    clock: Callable[[], tuple[int, float | Callable[[], float]] | None],
    on_agreed: Callable[[list[AffineCost], list[int]], None],
    trainer: Any,
    loop_prefetch: int = 1,
) -> InLoopProfiler:
    """Plan the first training steps' trial splits and hook the profiler into the fit loop (when there is a trainer)."""
    plan = profile_plan(
        global_batch,
        world_size,
        warmup=config.profile_warmup,
        steps=config.profile_steps,
        lag=loader_prefetch_depth(dataloader, loop_prefetch),
        **bounds,
    )
    profiler = InLoopProfiler(plan, rank, world_size, device, clock, on_agreed)
    if trainer is not None:
        attach_profiler(profiler, trainer)
    return profiler


def monitor_settings(config: HeterogeneousConfig, rank: int, world_size: int, min_batch_size: int) -> MonitorSettings:
    """This replica's telemetry, emulation and rebalancing settings, and the batch bounds a rebalance keeps."""
    factors = config.emulate_slowdown
    return MonitorSettings(
        record=config.telemetry,
        slowdown=factors[rank] if factors else 1.0,
        profile=config.speeds is None and world_size > 1,
        every_n_epochs=config.rebalance_every_n_epochs,
        threshold=config.rebalance_threshold,
        min_batch_size=min_batch_size,
        max_batch_sizes=tuple(config.max_batch_sizes) if config.max_batch_sizes is not None else None,
    )
