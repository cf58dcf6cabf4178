"""Timing and fitting a replica's cost model, and the speed cache."""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_het._compat import _collect_rng_states, _set_rng_states
from lightning_het.balance.allocation import allocate_batch_sizes
from lightning_het.balance.clock import emulate_slower_device
from lightning_het.balance.cost import AffineCost, fit_affine

__all__ = [
    "ProfileCache",
    "StepTiming",
    "cache_key",
    "fit_stage_timings",
    "preserved_training_state",
    "speed_from_timings",
    "stage_sizes",
    "time_steps",
]


@dataclass(frozen=True)
class StepTiming:
    """Wall-clock seconds of one profiled step, split at the end of the forward pass."""

    forward_s: float
    total_s: float

    @property
    def backward_s(self) -> float:
        return max(self.total_s - self.forward_s, 0.0)


def speed_from_timings(batch_size: int, timings: Sequence[StepTiming]) -> float:
    """Robust throughput in samples/s: ``batch_size / median(total step time)``."""
    if not timings:
        raise ValueError("Expected at least one timed step to estimate a speed, got none.")
    median = statistics.median(t.total_s for t in timings)
    return batch_size / max(median, 1e-9)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(
    batches: Iterable[Any],
    forward: Callable[[Any, int], torch.Tensor | None],
    backward: Callable[[torch.Tensor], None],
    *,
    warmup: int,
    steps: int,
    device: torch.device,
    slowdown: float = 1.0,
    align: Callable[[], None] | None = None,
) -> list[StepTiming]:
    """Run ``warmup + steps`` steps and return the timings of the last ``steps``."""
    cached: list[Any] = []
    source: Iterator[Any] = iter(batches)
    timings: list[StepTiming] = []
    for i in range(warmup + steps):
        try:
            batch = next(source)
            cached.append(batch)
        except StopIteration:
            if not cached:
                raise ValueError("The training DataLoader yielded no batch to profile.") from None
            batch = cached[i % len(cached)]
        if align is not None:
            align()
        _synchronize(device)
        start = time.perf_counter()
        cpu_start = time.process_time()
        loss = forward(batch, i)
        _synchronize(device)
        forward_end = time.perf_counter()
        if loss is not None:
            backward(loss)
        _synchronize(device)
        end = time.perf_counter()
        if slowdown != 1.0:
            cpu = time.process_time() - cpu_start if device.type == "cpu" else None
            delay = emulate_slower_device(slowdown, end - start, cpu)
            forward_end = start + (forward_end - start) * (1.0 + delay / max(end - start, 1e-12))
            end = time.perf_counter()
        if i >= warmup:
            timings.append(StepTiming(forward_s=forward_end - start, total_s=end - start))
    return timings


#: smallest fitted per-sample cost, as a fraction of the average cost per sample at the largest profiled batch size
_MIN_SLOPE_OF_AVERAGE = 0.1


def stage_sizes(
    global_batch_size: int,
    rough_speeds: Sequence[float],
    *,
    min_batch_size: int = 1,
    max_batch_sizes: Sequence[int] | None = None,
) -> tuple[list[int], list[int]]:
    """Per-replica batch sizes of the two timed profiling stages.

    >>> stage_sizes(48, [1, 2, 4])
    ([1, 2, 3], [3, 7, 14])
    """
    world = len(rough_speeds)
    floor = max(min_batch_size, 1)
    upper = list(max_batch_sizes) if max_batch_sizes is not None else [global_batch_size] * world

    def split(total: int) -> list[int]:
        total = min(max(total, world * floor), sum(upper))
        return allocate_batch_sizes(total, rough_speeds, min_batch_size=floor, max_batch_sizes=upper)

    small = split(-(-global_batch_size // 8))
    large = split(-(-global_batch_size // 2))
    large = [max(lg, min(sm + 1, hi)) for sm, lg, hi in zip(small, large, upper)]
    return small, large


def fit_stage_timings(stages: Sequence[tuple[int, Sequence[StepTiming]]]) -> AffineCost:
    """One replica's :class:`~lightning_het.balance.cost.AffineCost` from its timed stages."""
    sizes = [b for b, timings in stages if timings]
    seconds = [max(min(t.total_s for t in timings), 1e-9) for _, timings in stages if timings]
    if not sizes:
        raise ValueError("Expected at least one timed profiling step, got none.")
    cost = fit_affine(sizes, seconds)
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
            data = json.loads(self._path(key).read_text())
            if data.get("key") != key:
                return None
            cost = AffineCost.from_dict(data["cost"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return cost if math.isfinite(cost.fixed_s) else None

    def put(self, key: str, cost: AffineCost) -> None:
        """Store ``cost`` under ``key`` (atomic replace; an unwritable directory is ignored with a debug log)."""
        path = self._path(key)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"key": key, "cost": cost.as_dict(), "time": time.time()}))
            os.replace(tmp, path)
        except OSError:
            return


#: a torchmetrics ``Metric``'s bookkeeping besides its declared states; torchmetrics has no public setter for them
_METRIC_BOOKKEEPING = ("_update_count", "_computed", "_forward_cache")


def _metric_modules(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The torchmetrics ``Metric`` submodules (their accumulated states are not in ``state_dict``)."""
    return [m for m in module.modules() if hasattr(m, "metric_state") and hasattr(m, "update_count")]


def _metric_state(metric: Any) -> dict[str, Any]:
    names = [*metric.metric_state, *_METRIC_BOOKKEEPING]
    return {name: copy.deepcopy(getattr(metric, name)) for name in names if hasattr(metric, name)}


@contextmanager
def preserved_training_state(
    module: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer] = (), schedulers: Sequence[Any] = ()
) -> Iterator[None]:
    """Restore parameters, gradients, optimizer, scheduler, metric and RNG states and train flags on exit."""
    module_state = copy.deepcopy(module.state_dict())
    grads = {name: (None if p.grad is None else p.grad.detach().clone()) for name, p in module.named_parameters()}
    optimizer_states = [copy.deepcopy(opt.state_dict()) for opt in optimizers]
    scheduler_states = [copy.deepcopy(s.state_dict()) for s in schedulers if hasattr(s, "state_dict")]
    training_flags = {name: m.training for name, m in module.named_modules()}
    metrics = _metric_modules(module)
    metric_states = [_metric_state(m) for m in metrics]
    # reading the CUDA RNG of a replica that never touched CUDA would create a context on every GPU, for nothing
    rng_states = _collect_rng_states(include_cuda=torch.cuda.is_available() and torch.cuda.is_initialized())
    try:
        yield
    finally:
        with torch.no_grad():
            module.load_state_dict(module_state)
        for name, p in module.named_parameters():
            p.grad = grads[name]
        for opt, state in zip(optimizers, optimizer_states):
            opt.load_state_dict(state)
        for sched, state in zip([s for s in schedulers if hasattr(s, "state_dict")], scheduler_states):
            sched.load_state_dict(state)
        for name, m in module.named_modules():
            m.training = training_flags.get(name, m.training)
        for metric, saved in zip(metrics, metric_states):
            for name, value in saved.items():
                setattr(metric, name, value)
        _set_rng_states(rng_states)
