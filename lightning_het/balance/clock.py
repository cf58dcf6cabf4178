"""The step clock (compute time, time waiting in gradient synchronisation, slowdown emulation) and its history."""

from __future__ import annotations

import math
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_het._compat import queue_backward_callback


@dataclass
class EpochTimings:
    """One replica's per-step timings since the last flush, in seconds (one entry per training batch)."""

    compute_s: list[float] = field(default_factory=list)
    wait_s: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.compute_s)


def emulate_slower_device(slowdown: float, wall_s: float, cpu_s: float | None = None) -> float:
    """Sleep so that work which took ``wall_s`` seconds appears to take ``slowdown`` times as long; return the delay."""
    work = max(wall_s if cpu_s is None else min(wall_s, cpu_s), 0.0)
    delay = (slowdown - 1.0) * work
    if delay > 0.0:
        time.sleep(delay)
    return max(delay, 0.0)


class HostTimer:
    """Marks are host clock readings, complete when taken (a CPU replica's work is done when its call returns)."""

    lazy = False

    def mark(self) -> float:
        return time.perf_counter()

    def done(self, mark: float) -> bool:
        return True

    def wait(self, mark: float) -> None:
        return None

    def seconds(self, start: float, end: float) -> float:
        return end - start


class EventTimer:
    """Marks are CUDA events recorded on the step's stream, read without blocking (only :meth:`wait` blocks)."""

    lazy = True

    def __init__(self, event: Callable[[], Any] | None = None) -> None:
        self._event = event if event is not None else (lambda: torch.cuda.Event(enable_timing=True))

    def mark(self) -> Any:
        event = self._event()
        event.record()
        return event

    def done(self, mark: Any) -> bool:
        return bool(mark.query())

    def wait(self, mark: Any) -> None:
        mark.synchronize()

    def seconds(self, start: Any, end: Any) -> float:
        return float(start.elapsed_time(end)) / 1e3


def device_timer(device: torch.device | None, slowdown: float = 1.0) -> HostTimer | EventTimer:
    """The timer of a replica on ``device``: CUDA events on a GPU, unless the slowdown is emulated (the emulation
    stretches each phase as it ends, so it needs its duration then: the host clock after a synchronisation)."""
    if device is not None and device.type == "cuda" and slowdown == 1.0:
        return EventTimer()
    return HostTimer()


@dataclass
class _Marks:
    """One step's marks on an :class:`EventTimer`, read once they are complete."""

    batch: int
    start: Any
    end: Any
    next_start: Any = None
    ready: Any = None  # the local backward's end (compute stream), if seen
    spans: list[tuple[Any, Any]] = field(default_factory=list)  # (local backward done, backward returned)

    @property
    def last(self) -> Any:
        """The step's last mark (the next step's start once it began): complete means all of them are."""
        return self.next_start if self.next_start is not None else self.end


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
        "_done_hook",
        "_end",
        "_hook",
        "_inner",
        "_lazy",
        "_open",
        "_pending",
        "_ready",
        "_start",
        "_start_hook",
        "_step_batch",
        "_timer",
        "_timings",
        "_wait",
        "record",
        "slowdown",
    )

    def __init__(
        self,
        slowdown: float = 1.0,
        record: bool = True,
        device: torch.device | None = None,
        timer: HostTimer | EventTimer | None = None,
    ) -> None:
        if not math.isfinite(slowdown) or slowdown < 1.0:
            raise ValueError(f"Expected argument `slowdown` to be a finite number >= 1, but got {slowdown!r}.")
        self.slowdown = float(slowdown)
        self.record = record
        self._timer = timer if timer is not None else device_timer(device, self.slowdown)
        if self._timer.lazy and self.slowdown != 1.0:
            raise ValueError("A lazy device timer cannot emulate a slowdown: pass `slowdown=1.0`.")
        # the emulation on a GPU: the host clock, after synchronising the device (emulation only)
        self._device = device if device is not None and device.type == "cuda" and not self._timer.lazy else None
        self._lazy: _Marks | None = None  # the open step's marks (lazy timer)
        self._pending: list[_Marks] = []  # closed steps whose marks are not all complete yet
        self._cpu = _cpu_seconds(device) if self.slowdown != 1.0 else None
        self._cpu_start = self._cpu_inner = self._backward_call_cpu = self._backward_start_cpu = 0.0
        self._timings = EpochTimings()
        self._open = False
        self._start = self._end = self._inner = self._wait = 0.0
        self._backward_call = self._backward_start = 0.0
        self._ready: float | None = None
        self._hook: Any = None
        self._step_batch = 0
        self._start_hook, self._done_hook = self._on_backward_start, self._on_local_backward_done  # bound once

    def _now(self) -> float:
        if self._device is not None:
            torch.cuda.synchronize(self._device)
        return time.perf_counter()

    def step_start(self, batch_size: int) -> None:
        """A training batch starts (``training_step`` entry); closes the previous step."""
        if self._timer.lazy:
            mark = self._timer.mark()
            if self._lazy is not None:
                self._lazy.next_start = mark
                self._pending.append(self._lazy)
            self._lazy = _Marks(int(batch_size), mark, mark)
            self._read_completed()  # the previous steps' events, as far as the device has run them
            return
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
        if self._lazy is not None:
            self._lazy.end = self._timer.mark()
            return
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
        if self._lazy is not None:
            self._lazy.ready = None
        self._backward_call = time.perf_counter()
        if self._cpu is not None:
            self._backward_call_cpu = self._cpu()
        self._ready = None
        if isinstance(loss, Tensor) and loss.requires_grad:
            self._hook = loss.register_hook(self._start_hook)

    def after_backward(self) -> None:
        """``backward`` returned (gradients synchronised): book the wait."""
        if self._hook is not None:  # a retained graph backwarded again must not fire this step's hook
            self._hook.remove()
            self._hook = None
        marks = self._lazy
        if marks is not None:
            after = self._timer.mark()  # after the gradient synchronisation queued on the compute stream
            marks.spans.append((marks.ready if marks.ready is not None else after, after))
            marks.end = after
            return
        now = self._now()
        ready = self._ready if self._ready is not None else now
        self._wait += max(now - ready, 0.0)
        self._inner += now - self._backward_call
        if self._cpu is not None:
            self._cpu_inner += self._cpu() - self._backward_call_cpu
        self._end = now

    def open_step(self) -> tuple[int, float | Callable[[], float]] | None:
        """The open step's batch size and compute seconds so far (wait left out), or ``None``."""
        marks = self._lazy
        if marks is not None:
            end, spans = marks.end, list(marks.spans)

            def seconds() -> float:
                self._timer.wait(end)
                return self._busy(marks.start, end, spans)[0]

            return marks.batch, seconds
        if not self._open:
            return None
        return self._step_batch, max(self._end - self._start - self._wait, 0.0)

    def _busy(self, start: Any, end: Any, spans: list[tuple[Any, Any]]) -> tuple[float, float]:
        """Compute and wait seconds of a step's marks (all complete)."""
        seconds = self._timer.seconds
        wait = sum(max(seconds(ready, after), 0.0) for ready, after in spans)
        return max(seconds(start, end) - wait, 0.0), wait

    def _read_completed(self) -> None:
        """Book the closed steps whose events the device has completed, oldest first (no synchronisation)."""
        timer = self._timer
        while self._pending and timer.done(self._pending[0].last):
            self._book(self._pending.pop(0))

    def _book(self, marks: _Marks) -> None:
        busy, wait = self._busy(marks.start, marks.end, marks.spans)
        step = self._timer.seconds(marks.start, marks.next_start) if marks.next_start is not None else busy + wait
        if self.record:
            t = self._timings
            t.compute_s.append(busy)
            t.wait_s.append(wait)
            t.step_s.append(max(step, busy + wait))
            t.batch_sizes.append(marks.batch)

    def flush(self) -> EpochTimings:
        """Close the open step and hand over (and forget) everything recorded so far (a lazy timer waits for the last
        step's events here: call it where the job synchronises anyway, e.g. an epoch's gather)."""
        if self._lazy is not None:
            self._pending.append(self._lazy)
            self._lazy = None
            self._timer.wait(self._pending[-1].end)
            for marks in self._pending:
                self._book(marks)
            self._pending = []
        if self._open:
            self._close(self._end - self._start)
            self._open = False
        timings, self._timings = self._timings, EpochTimings()
        return timings

    def _on_backward_start(self, grad: Tensor) -> None:
        self._backward_start = time.perf_counter()
        if self._cpu is not None:
            self._backward_start_cpu = self._cpu()
        queue_backward_callback(self._done_hook)

    def _on_local_backward_done(self) -> None:
        if self._lazy is not None:  # on the compute stream: the gradient all-reduces in flight are not waited for
            self._lazy.ready = self._timer.mark()
            return
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


_MAX_SERIES_POINTS = 20_000  # per replica; older points are thinned (every other one kept) beyond this


def gather_timings(local: EpochTimings, world_size: int, device: torch.device) -> list[EpochTimings]:
    """All-gather every replica's timings (a collective: call it on every rank at the same point)."""
    if world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return [local]
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, local)  # once per epoch: a few floats per step
    return everyone


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def _typical_steps(t: EpochTimings) -> tuple[int, EpochTimings]:
    """The epoch's most common batch size (ties: the largest) and the steps that ran it (not the tail batch's)."""
    if not t.batch_sizes:
        return 0, t
    counts = Counter(t.batch_sizes)
    size = max(counts, key=lambda b: (counts[b], b))
    keep = [i for i, b in enumerate(t.batch_sizes) if b == size]
    return size, EpochTimings(
        [t.compute_s[i] for i in keep], [t.wait_s[i] for i in keep], [t.step_s[i] for i in keep], [size] * len(keep)
    )


def epoch_summary(timings: Sequence[EpochTimings]) -> dict[str, Any]:
    """Per-replica figures of one epoch (lists indexed by global rank) and the imbalance."""
    typical = [_typical_steps(t) for t in timings]
    compute = [_median(t.compute_s) for _, t in typical]
    total_c = [math.fsum(t.compute_s) for t in timings]
    total_w = [math.fsum(t.wait_s) for t in timings]
    positive = [c for c in compute if math.isfinite(c) and c > 0]
    return {
        "steps": [len(t) for t in timings],
        "batch_sizes": [size for size, _ in typical],
        "compute_s": compute,
        "compute_recent_s": [_median(t.compute_s[len(t.compute_s) // 2 :]) for _, t in typical],
        "wait_s": [_median(t.wait_s) for _, t in typical],
        "step_s": [_median(t.step_s) for _, t in typical],
        "compute_total_s": total_c,
        "wait_total_s": total_w,
        "wait_fraction": [w / (c + w) if c + w > 0 else 0.0 for c, w in zip(total_c, total_w)],
        "samples_per_s": [
            sum(t.batch_sizes) / math.fsum(t.step_s) if t.step_s and math.fsum(t.step_s) > 0 else 0.0 for t in timings
        ],
        "imbalance": (max(positive) / min(positive)) if len(positive) == len(compute) and positive else float("nan"),
    }


class TelemetryHistory:
    """Everything measured during one ``fit``, identical on every rank once gathered."""

    def __init__(self) -> None:
        self.epochs: list[dict[str, Any]] = []
        self.series: dict[str, list[list[float]]] = {"compute_s": [], "wait_s": [], "batch": []}
        self.rebalances: list[dict[str, Any]] = []
        self.checks: list[dict[str, Any]] = []
        self._stride = 1
        self._seen = 0

    def add(self, timings: Sequence[EpochTimings], *, epoch: int, global_step: int) -> dict[str, Any]:
        """Book one gathered window (usually an epoch); returns its summary."""
        summary = epoch_summary(timings)
        summary.update(epoch=epoch, global_step=global_step)
        self.epochs.append(summary)
        world = len(timings)
        if not self.series["compute_s"]:
            self.series = {key: [[] for _ in range(world)] for key in ("compute_s", "wait_s", "batch")}
        steps = max((len(t) for t in timings), default=0)
        for i in range(steps):
            if (self._seen + i) % self._stride:
                continue
            for r, t in enumerate(timings):
                if i < len(t):
                    self.series["compute_s"][r].append(t.compute_s[i])
                    self.series["wait_s"][r].append(t.wait_s[i])
                    self.series["batch"][r].append(float(self._seen + i + 1))
        self._seen += steps
        while self.series["compute_s"] and len(self.series["compute_s"][0]) > _MAX_SERIES_POINTS:
            self.series = {key: [v[::2] for v in values] for key, values in self.series.items()}
            self._stride *= 2
        return summary

    def record_check(self, decision: dict[str, Any], *, epoch: int, global_step: int, old: Sequence[int]) -> None:
        """Book a rebalancing decision (``RebalanceDecision.as_dict``) made after ``batch`` batches."""
        entry = {"epoch": epoch, "global_step": global_step, "batch": self._seen, "from": list(old), **decision}
        self.checks.append(entry)
        if decision.get("adopt"):
            self.rebalances.append(entry)

    def as_dict(self) -> dict[str, Any]:
        """Plain data (JSON-serialisable)."""
        return {
            "epochs": [dict(e) for e in self.epochs],
            "series": {k: [list(v) for v in vals] for k, vals in self.series.items()},
            "rebalances": [dict(r) for r in self.rebalances],
            "checks": [dict(c) for c in self.checks],
        }
