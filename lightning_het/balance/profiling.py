"""Measuring each replica's speed on the real training step, without side effects.

The strategy profiles before the first epoch: every replica runs ``warmup + steps`` forward/backward passes of the
user's own ``training_step`` on real batches of the size it would get under an equal split, times each one, and reports
``samples / median(step time)``. Everything the passes touch (parameters, buffers, gradients, optimizer and scheduler
state, the torch/CUDA/numpy/python RNG streams, the module's train/eval flags) is snapshotted first and restored after,
so training proceeds exactly as it would have without profiling.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states

__all__ = ["StepTiming", "preserved_training_state", "speed_from_timings", "time_steps"]


@dataclass(frozen=True)
class StepTiming:
    """Wall-clock seconds of one profiled step, split at the end of the forward pass."""

    forward_s: float
    total_s: float

    @property
    def backward_s(self) -> float:
        return max(self.total_s - self.forward_s, 0.0)


def speed_from_timings(batch_size: int, timings: Sequence[StepTiming]) -> float:
    """Robust throughput in samples/s: ``batch_size / median(total step time)``.

    The median ignores the odd step that hit a page fault, a garbage collection or a noisy neighbour.
    """
    if not timings:
        raise ValueError("Expected at least one timed step to estimate a speed, got none.")
    median = statistics.median(t.total_s for t in timings)
    return batch_size / max(median, 1e-9)


def backward_ratio(timings: Sequence[StepTiming]) -> float:
    """Median of ``total / forward`` time: how much a full step costs relative to its forward pass (>= 1)."""
    ratios = [t.total_s / t.forward_s for t in timings if t.forward_s > 0]
    return max(statistics.median(ratios), 1.0) if ratios else 3.0


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
) -> list[StepTiming]:
    """Run ``warmup + steps`` steps and return the timings of the last ``steps``.

    Args:
        batches: iterable of device-ready batches; it is cycled when shorter than ``warmup + steps``.
        forward: ``forward(batch, batch_idx)`` returns the loss (or ``None`` when the step did its own backward).
        backward: back-propagates a loss.
        warmup: untimed steps first (allocator, autotuning and cache warm-up).
        steps: timed steps.
        device: where to synchronise before reading the clock.
        slowdown: emulation factor ``f``; each step is stretched to ``f`` times its measured duration by sleeping.
    """
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
        _synchronize(device)
        start = time.perf_counter()
        loss = forward(batch, i)
        _synchronize(device)
        forward_end = time.perf_counter()
        if loss is not None:
            backward(loss)
        _synchronize(device)
        end = time.perf_counter()
        if slowdown != 1.0:
            time.sleep((slowdown - 1.0) * (end - start))
            forward_end = start + slowdown * (forward_end - start)
            end = time.perf_counter()
        if i >= warmup:
            timings.append(StepTiming(forward_s=forward_end - start, total_s=end - start))
    return timings


@contextmanager
def preserved_training_state(
    module: torch.nn.Module,
    optimizers: Sequence[torch.optim.Optimizer] = (),
    schedulers: Sequence[Any] = (),
) -> Iterator[None]:
    """Restore parameters, buffers, gradients, optimizer/scheduler state, RNG streams and train flags on exit."""
    module_state = copy.deepcopy(module.state_dict())
    grads = {name: (None if p.grad is None else p.grad.detach().clone()) for name, p in module.named_parameters()}
    optimizer_states = [copy.deepcopy(opt.state_dict()) for opt in optimizers]
    scheduler_states = [copy.deepcopy(s.state_dict()) for s in schedulers if hasattr(s, "state_dict")]
    training_flags = {name: m.training for name, m in module.named_modules()}
    # a CPU replica of a mixed CPU/GPU job has not initialised CUDA: reading the CUDA RNG would create a context on
    # every GPU (#8); a replica that has not touched CUDA has no CUDA RNG state to protect either
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
        _set_rng_states(rng_states)
