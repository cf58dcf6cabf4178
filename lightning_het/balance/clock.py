"""The step clock: per-replica compute time, time waiting in gradient synchronisation, and slowdown emulation."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_het._compat import queue_backward_callback

__all__ = ["EpochTimings", "StepClock", "emulate_slower_device"]


@dataclass
class EpochTimings:
    """One replica's per-step timings since the last flush, in seconds (one entry per training batch)."""

    compute_s: list[float] = field(default_factory=list)
    wait_s: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.compute_s)

    def as_tensor(self) -> Tensor:
        """``float64`` tensor of shape ``(steps, 4)``: compute, wait, step seconds and batch size."""
        rows = list(zip(self.compute_s, self.wait_s, self.step_s, map(float, self.batch_sizes)))
        return torch.tensor(rows, dtype=torch.float64).reshape(-1, 4)

    @classmethod
    def from_tensor(cls, rows: Tensor) -> EpochTimings:
        data = rows.detach().cpu().tolist()
        return cls(
            compute_s=[r[0] for r in data],
            wait_s=[r[1] for r in data],
            step_s=[r[2] for r in data],
            batch_sizes=[round(r[3]) for r in data],
        )


def emulate_slower_device(slowdown: float, wall_s: float, cpu_s: float | None = None) -> float:
    """Sleep so that work which took ``wall_s`` seconds appears to take ``slowdown`` times as long; return the delay."""
    work = max(wall_s if cpu_s is None else min(wall_s, cpu_s), 0.0)
    delay = (slowdown - 1.0) * work
    if delay > 0.0:
        time.sleep(delay)
    return max(delay, 0.0)


def _cpu_seconds(device: torch.device | None) -> Callable[[], float] | None:
    """The process CPU clock for a CPU replica, ``None`` for an accelerator (its work is synchronised wall time)."""
    return time.process_time if device is None or device.type == "cpu" else None


class StepClock:
    """Times one replica's training steps and, optionally, stretches them to emulate slower hardware."""

    __slots__ = (
        "_backward_call",
        "_backward_call_cpu",
        "_backward_start",
        "_backward_start_cpu",
        "_cpu",
        "_cpu_inner",
        "_cpu_start",
        "_device",
        "_end",
        "_hook",
        "_inner",
        "_open",
        "_ready",
        "_start",
        "_step_batch",
        "_timings",
        "_wait",
        "record",
        "slowdown",
    )

    def __init__(self, slowdown: float = 1.0, record: bool = True, device: torch.device | None = None) -> None:
        if not math.isfinite(slowdown) or slowdown < 1.0:
            raise ValueError(f"Expected argument `slowdown` to be a finite number >= 1, but got {slowdown!r}.")
        self.slowdown = float(slowdown)
        self.record = record
        self._device = device if device is not None and device.type == "cuda" else None
        self._cpu = _cpu_seconds(device) if self.slowdown != 1.0 else None
        self._cpu_start = self._cpu_inner = self._backward_call_cpu = self._backward_start_cpu = 0.0
        self._timings = EpochTimings()
        self._open = False
        self._start = self._end = self._inner = self._wait = 0.0
        self._backward_call = self._backward_start = 0.0
        self._ready: float | None = None
        self._hook: Any = None
        self._step_batch = 0

    def _now(self) -> float:
        if self._device is not None:
            torch.cuda.synchronize(self._device)
        return time.perf_counter()

    def step_start(self, batch_size: int) -> None:
        """A training batch starts (``training_step`` entry); closes the previous step."""
        now = self._now()
        if self._open:
            self._close(now - self._start)
        self._open = True
        self._start = self._end = now
        self._inner = self._wait = 0.0
        self._cpu_start = self._cpu() if self._cpu is not None else 0.0
        self._cpu_inner = 0.0
        self._step_batch = int(batch_size)

    def forward_end(self) -> None:
        """``training_step`` returned: emulate the slower forward pass."""
        if not self._open:
            return
        now = self._now()
        if self.slowdown != 1.0:
            cpu = self._cpu() - self._cpu_start - self._cpu_inner if self._cpu is not None else None
            emulate_slower_device(self.slowdown, now - self._start - self._inner, cpu)
            now = time.perf_counter()
        self._end = now

    def before_backward(self, loss: Tensor) -> None:
        """``backward(loss)`` is about to run: hook the loss to catch the end of local gradient computation."""
        self._backward_call = time.perf_counter()
        if self._cpu is not None:
            self._backward_call_cpu = self._cpu()
        self._ready = None
        if isinstance(loss, Tensor) and loss.requires_grad:
            self._hook = loss.register_hook(self._on_backward_start)

    def after_backward(self) -> None:
        """``backward`` returned (gradients synchronised): book the wait."""
        now = self._now()
        if self._hook is not None:  # a retained graph backwarded again must not fire this step's hook
            self._hook.remove()
            self._hook = None
        ready = self._ready if self._ready is not None else now
        self._wait += max(now - ready, 0.0)
        self._inner += now - self._backward_call
        if self._cpu is not None:
            self._cpu_inner += self._cpu() - self._backward_call_cpu
        self._end = now

    def open_step(self) -> tuple[int, float] | None:
        """The open step's batch size and compute seconds so far (wait left out), or ``None``."""
        if not self._open:
            return None
        return self._step_batch, max(self._end - self._start - self._wait, 0.0)

    def flush(self) -> EpochTimings:
        """Close the open step and hand over (and forget) everything recorded so far."""
        if self._open:
            self._close(self._end - self._start)
            self._open = False
        timings, self._timings = self._timings, EpochTimings()
        return timings

    def _on_backward_start(self, grad: Tensor) -> None:
        self._backward_start = time.perf_counter()
        if self._cpu is not None:
            self._backward_start_cpu = self._cpu()
        queue_backward_callback(self._on_local_backward_done)

    def _on_local_backward_done(self) -> None:
        now = self._now()
        if self.slowdown != 1.0:
            cpu = self._cpu() - self._backward_start_cpu if self._cpu is not None else None
            emulate_slower_device(self.slowdown, now - self._backward_start, cpu)
            now = time.perf_counter()
        self._ready = now

    def _close(self, step_s: float) -> None:
        if not self.record:
            return
        busy = max(self._end - self._start - self._wait, 0.0)
        t = self._timings
        t.compute_s.append(busy)
        t.wait_s.append(self._wait)
        t.step_s.append(max(step_s, busy + self._wait))
        t.batch_sizes.append(self._step_batch)
