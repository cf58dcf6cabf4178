"""The step clock: compute time, time waiting in gradient synchronisation, slowdown emulation."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_het._compat import queue_backward_callback


@dataclass
class EpochTimings:
    """One replica's per-step timings since the last flush, in seconds (one entry per training batch)."""

    compute_s: list[float] = field(default_factory=list)
    wait_s: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=list)
    index: list[int] = field(default_factory=list)  # each timed step's number (1-based, in the fit); [] : 1, 2, ...
    steps: int = 0  # training steps the window held, timed or not (0: one per entry)

    def __len__(self) -> int:
        return len(self.compute_s)

    @property
    def covered(self) -> int:
        """Training steps the window held (each entry stands for ``covered / len`` of them)."""
        return self.steps or len(self)


def emulate_slower_device(slowdown: float, wall_s: float, cpu_s: float | None = None) -> float:
    """Sleep so that work which took ``wall_s`` seconds appears to take ``slowdown`` times as long; return the delay."""
    delay = (slowdown - 1.0) * max(wall_s if cpu_s is None else min(wall_s, cpu_s), 0.0)
    if delay > 0.0:
        time.sleep(delay)
    return delay


@dataclass
class _Marks:
    """One step's marks: host clock readings, or CUDA events (read once the device has reached them)."""

    batch: int
    start: Any
    end: Any
    index: int = 0
    next_start: Any = None
    ready: Any = None  # the local backward's end, if seen
    spans: list[tuple[Any, Any]] = field(default_factory=list)  # (local backward done, backward returned)


class StepClock:
    """Times one replica's training steps (CUDA events on a GPU, else the host clock); can emulate slower hardware."""

    def __init__(
        self,
        slowdown: float = 1.0,
        record: bool = True,
        device: torch.device | None = None,
        events: Callable[[], Any] | None = None,
    ) -> None:
        self.slowdown = float(slowdown)  # >= 1 (the keywords' and EmulatedPlatform's checks)
        self.record = record
        #: steps 1, 1 + every, 1 + 2 every, ... are timed (the others cost nothing); always 1 under emulation
        self.every = 1
        self._count = self._flushed = 0  # training steps started; at the last flush
        cuda = device is not None and device.type == "cuda"
        if events is None and cuda and self.slowdown == 1.0:
            events = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
        self._events = events
        self._sync = device if cuda and events is None else None  # emulation on a GPU: synchronise, then read
        self._cpu = time.process_time if self.slowdown != 1.0 and not cuda else None  # a CPU replica's work
        self._step: _Marks | None = None  # the open step
        self._pending: list[_Marks] = []  # closed steps whose events are not all complete yet
        self._timings = EpochTimings()
        self._inner = self._backward_call = self._backward_start = 0.0  # emulation: wall seconds in backward
        self._cpu_start = self._cpu_inner = self._cpu_backward_call = self._cpu_backward_start = 0.0
        self._hook: Any = None
        self._start_hook, self._done_hook = self._on_backward_start, self._on_local_backward_done  # bound once

    def _mark(self) -> Any:
        if self._events is not None:
            event = self._events()
            event.record()
            return event
        if self._sync is not None:
            torch.cuda.synchronize(self._sync)
        return time.perf_counter()

    def _seconds(self, start: Any, end: Any) -> float:
        return float(start.elapsed_time(end)) / 1e3 if self._events is not None else end - start

    def _cpu_now(self) -> float:
        return self._cpu() if self._cpu is not None else 0.0

    def step_start(self, batch_size: int) -> bool:
        """A training batch starts (``training_step`` entry); closes the previous step. Whether this one is timed (the
        caller then reports its forward's and backward's ends)."""
        self._count += 1
        timed = self.every == 1 or self.slowdown != 1.0 or (self._count - 1) % self.every == 0
        if not timed and self._step is None:
            return False
        mark = self._mark()
        if self._step is not None:
            self._step.next_start = mark
            self._pending.append(self._step)
        self._step = _Marks(int(batch_size), mark, mark, self._count) if timed else None
        self._inner, self._cpu_start, self._cpu_inner = 0.0, self._cpu_now(), 0.0
        # book the closed steps the device has completed, oldest first (no synchronisation)
        while self._pending and (self._events is None or self._pending[0].next_start.query()):
            self._book(self._pending.pop(0))
        return timed

    def forward_end(self) -> None:
        """``training_step`` returned: emulate the slower forward pass."""
        step = self._step
        if step is None:
            return
        now = self._mark()
        if self.slowdown != 1.0:
            cpu = self._cpu_now() - self._cpu_start - self._cpu_inner if self._cpu is not None else None
            emulate_slower_device(self.slowdown, now - step.start - self._inner, cpu)
            now = time.perf_counter()
        step.end = now

    def before_backward(self, loss: Tensor) -> None:
        """``backward(loss)`` is about to run: hook the loss to catch the end of local gradient computation."""
        if self._step is not None:
            self._step.ready = None
        self._backward_call, self._cpu_backward_call = time.perf_counter(), self._cpu_now()
        if isinstance(loss, Tensor) and loss.grad_fn is not None:  # a node pre-hook: ~30x cheaper than a tensor hook
            self._hook = loss.grad_fn.register_prehook(self._start_hook)

    def after_backward(self) -> None:
        """``backward`` returned (gradients synchronised): book the wait."""
        if self._hook is not None:  # a retained graph backwarded again must not fire this step's hook
            self._hook.remove()
            self._hook = None
        step = self._step
        if step is None:
            return
        after = self._mark()  # on a GPU: after the gradient synchronisation queued on the compute stream
        step.spans.append((step.ready if step.ready is not None else after, after))
        step.end = after
        if self.slowdown != 1.0:
            self._inner += after - self._backward_call
            self._cpu_inner += self._cpu_now() - self._cpu_backward_call

    def open_step(self) -> tuple[int, Callable[[], float]] | None:
        """The open step's batch size and a function reading its compute seconds so far (wait left out), or ``None``."""
        step = self._step
        if step is None:
            return None
        start, end, spans = step.start, step.end, list(step.spans)

        def seconds() -> float:
            if self._events is not None:
                end.synchronize()
            return self._busy(start, end, spans)[0]

        return step.batch, seconds

    def _busy(self, start: Any, end: Any, spans: list[tuple[Any, Any]]) -> tuple[float, float]:
        """Compute and wait seconds of a step's marks (all complete)."""
        wait = sum(max(self._seconds(ready, after), 0.0) for ready, after in spans)
        return max(self._seconds(start, end) - wait, 0.0), wait

    def _book(self, marks: _Marks) -> None:
        if not self.record:
            return
        busy, wait = self._busy(marks.start, marks.end, marks.spans)
        step = self._seconds(marks.start, marks.next_start) if marks.next_start is not None else busy + wait
        t = self._timings
        t.compute_s.append(busy)
        t.wait_s.append(wait)
        t.step_s.append(max(step, busy + wait))
        t.batch_sizes.append(marks.batch)
        t.index.append(marks.index)

    def flush(self) -> EpochTimings:
        """Close the open step and hand over everything recorded (CUDA events: waits for the last step's)."""
        if self._step is not None:
            self._pending.append(self._step)
            self._step = None
            if self._events is not None:
                self._pending[-1].end.synchronize()
            for marks in self._pending:
                self._book(marks)
            self._pending = []
        timings, self._timings = self._timings, EpochTimings()
        timings.steps, self._flushed = self._count - self._flushed, self._count
        return timings

    def _on_backward_start(self, grad_outputs: Any) -> None:
        self._backward_start, self._cpu_backward_start = time.perf_counter(), self._cpu_now()
        queue_backward_callback(self._done_hook)

    def _on_local_backward_done(self) -> None:
        now = self._mark()  # on a GPU: on the compute stream, the gradient all-reduces in flight not waited for
        if self.slowdown != 1.0:
            cpu = self._cpu_now() - self._cpu_backward_start if self._cpu is not None else None
            emulate_slower_device(self.slowdown, now - self._backward_start, cpu)
            now = time.perf_counter()
        if self._step is not None:
            self._step.ready = now
