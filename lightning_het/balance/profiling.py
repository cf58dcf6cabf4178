"""Fitting a replica's cost model, and the speed cache (the schedule: :mod:`lightning_het.balance.profiler`)."""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_het.balance.cost import AffineCost, fit_affine, slope_through_origin


@dataclass(frozen=True)
class StepTiming:
    """Wall-clock seconds of one profiled step, split at the end of the forward pass."""

    forward_s: float
    total_s: float


#: appended to a replica's key for its measured memory cap
MEMORY_KEY = "|memory"

#: smallest ratio of a replica's largest to smallest timed size for an affine fit (below: proportional)
_MIN_SIZE_SPREAD = 1.25
#: smallest fitted per-sample cost, as a fraction of the average cost per sample at the largest profiled batch size
_MIN_SLOPE_OF_AVERAGE = 0.1


def stage_ratios(stages: Sequence[Sequence[float]]) -> list[float]:
    """The slowest over the fastest of the steps of each stage timed more than once.

    >>> stage_ratios([[0.010, 0.012], [0.020], [0.031, 0.030]])
    [1.2, 1.0333333333333334]
    """
    return [max(t) / min(t) for t in stages if len(t) > 1 and min(t) > 0]


def fit_stage_timings(stages: Sequence[tuple[int, Sequence[StepTiming]]]) -> AffineCost:
    """One replica's :class:`~lightning_het.balance.cost.AffineCost` from its timed stages."""
    sizes = [b for b, timings in stages if timings]
    seconds = [max(min(t.total_s for t in timings), 1e-9) for _, timings in stages if timings]
    if not sizes:
        raise ValueError("Expected at least one timed profiling step, got none.")
    through_origin = slope_through_origin(sizes, seconds)
    if max(sizes) < _MIN_SIZE_SPREAD * min(sizes):  # sizes too close for a slope: the one-number model
        return AffineCost(0.0, through_origin)
    cost = fit_affine(sizes, seconds)
    # a fixed cost the stages cannot tell from their timing noise: the line through the origin, which extrapolates
    # to other sizes more safely than an intercept fitted to noise (the narrowest spread of a stage timed repeatedly)
    noise = min(stage_ratios([[t.total_s for t in ts] for _, ts in stages]), default=1.0)
    if cost.fixed_s > 0 and max(abs(t - through_origin * b) / t for b, t in zip(sizes, seconds)) <= noise - 1.0:
        return AffineCost(0.0, through_origin)
    # a slope below 10 % of the largest stage's cost per sample is more likely noise than a flat curve: keep the line
    # through the largest stage with that slope (a cautious estimate that rebalancing can correct)
    largest = max(range(len(sizes)), key=lambda i: sizes[i])
    floor = _MIN_SLOPE_OF_AVERAGE * seconds[largest] / sizes[largest]
    if cost.per_sample_s < floor:
        cost = AffineCost(max(seconds[largest] - floor * sizes[largest], 0.0), floor)
    return cost


def _describe(value: Any) -> Any:
    """Shapes and dtypes of the tensors in a (nested) sample: what its cost depends on, not its values."""
    if isinstance(value, torch.Tensor):
        return [list(value.shape), str(value.dtype)]
    if isinstance(value, dict):
        return {str(k): _describe(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_describe(v) for v in value]
    if isinstance(value, (int, float, bool, str)) or value is None:
        return type(value).__name__
    return type(value).__qualname__


def device_description(device: torch.device) -> str:
    """What identifies a device's speed: the GPU model, or the CPU model and the intra-op thread count."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return f"{device.type}:{platform.machine()}:{platform.processor() or 'cpu'}:threads={torch.get_num_threads()}"


def cache_key(module: torch.nn.Module, device: torch.device, sample: Any, **extra: Any) -> str:
    """A stable key for one replica's cost: module class, parameter count, device, one sample's tensor shapes."""
    cls = type(module)
    data = {
        "module": f"{cls.__module__}.{cls.__qualname__}",
        "parameters": sum(p.numel() for p in module.parameters()),
        "device": device_description(device),
        "sample": _describe(sample),
        "torch": torch.__version__,
        **{k: extra[k] for k in sorted(extra)},
    }
    return json.dumps(data, sort_keys=True, default=str)


class ProfileCache:
    """Fitted costs on disk: one small JSON file per key under ``directory`` (safe for concurrent replicas)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory).expanduser()

    @staticmethod
    def default_directory() -> Path:
        """``$XDG_CACHE_HOME/lightning_het/profiles``, else ``~/.cache/lightning_het/profiles``."""
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return Path(base) / "lightning_het" / "profiles"

    def _path(self, key: str) -> Path:
        return self.directory / (hashlib.sha256(key.encode()).hexdigest()[:32] + ".json")

    def get(self, key: str) -> AffineCost | None:
        """The cost stored under ``key``, or ``None`` (missing, unreadable or for another key)."""
        try:
            cost = AffineCost.from_dict(self._read(key)["cost"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return cost if math.isfinite(cost.fixed_s) else None

    def put(self, key: str, cost: AffineCost, threshold: float | None = None) -> None:
        """Store ``cost`` under ``key`` (atomic replace; an unwritable directory is ignored with a debug log), with
        the imbalance ``threshold`` its profiling split by."""
        self._write(key, {"cost": cost.as_dict(), "threshold": threshold})

    def get_threshold(self, key: str) -> float | None:
        """The ``threshold`` stored with ``key``'s cost, or ``None``."""
        try:
            return float(self._read(key)["threshold"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def get_cap(self, key: str) -> int | None:
        """The measured micro-batch cap stored for ``key`` (the memory entry beside the cost), or ``None``."""
        try:
            cap = int(self._read(key + MEMORY_KEY)["micro_batch_cap"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return cap if cap >= 1 else None

    def put_cap(self, key: str, cap: int) -> None:
        """Store a measured micro-batch cap for ``key``."""
        self._write(key + MEMORY_KEY, {"micro_batch_cap": int(cap)})

    def _read(self, key: str) -> dict[str, Any]:
        data = json.loads(self._path(key).read_text())
        if data.get("key") != key:
            raise KeyError(key)
        return data

    def _write(self, key: str, payload: dict[str, Any]) -> None:
        path = self._path(key)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"key": key, **payload, "time": time.time()}))
            os.replace(tmp, path)
        except OSError:
            return
