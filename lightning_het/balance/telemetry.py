"""Per-replica step telemetry: compute time, time waiting in gradient synchronisation, throughput; balance report.

How a step is split (:class:`StepClock`). For every training batch the strategy reads a monotonic clock at the start
of ``training_step`` and around every ``backward``. When backward starts, a tensor hook on the loss queues an
*autograd end-of-backward callback*. The autograd engine runs its final callbacks in the order they were queued, and
DDP queues its own (the one that waits for the gradient all-reduce and copies the result into ``.grad``) only when the
last gradient bucket becomes ready, so ours runs first: at the moment this replica has finished computing its local
gradients. Hence, per step:

* ``wait_s``: from the end of local backward compute to the return of ``backward()``: time blocked in gradient
  synchronisation (the slowest peer's lateness plus the part of the all-reduce not hidden behind backward). This
  composes with any DDP communication hook (the hook's future is what DDP waits for).
* ``compute_s``: the rest of the replica's training step, ``(end of last backward) - (start of training_step) -
  wait_s``: forward, backward, and an emulated slowdown. Data loading and ``optimizer.step`` fall between steps and
  are not counted.
* ``step_s``: start of this ``training_step`` to the start of the next one (for the last step of an epoch, to the end
  of its backward): the iteration time, so ``samples_per_s = batch_size / step_s`` is the achieved throughput.

Emulation (``emulate_slowdown``, see :class:`StepClock` and :func:`emulate_slower_device`): after ``training_step``
returns, the clock sleeps ``(f - 1) x`` the forward work it just measured; in the end-of-backward callback,
``(f - 1) x`` the backward work it just measured. Both happen *before* the gradients are synchronised, so a replica's
busy time becomes ``f`` times its real compute time and its peers see it late, as on slower hardware. On a CPU replica
the work is the smaller of the wall time and the process's CPU time over the same span: when replicas share cores, the
time a replica spends descheduled is not multiplied by ``f`` (that would turn every scheduling hiccup into an
``f``-fold one and make the emulated platform unbalanceable). On CUDA the work is the synchronised wall time. It is an
emulation: the sleeping replica releases its CPU (or GPU) instead of computing. The strategy's profiling reads this
clock on its first training steps (:meth:`StepClock.open_step`, :mod:`lightning_het.balance.profiler`), and Fabric's
(:func:`~lightning_het.balance.profiling.time_steps`) uses the same function, so profiled and trained steps agree.

Cost: about six clock reads, one tensor hook and one autograd callback per step, and one small all-gather per epoch
(:func:`gather_timings`). On CUDA replicas the clock synchronises the device at the two measurement points (host
clocks cannot see queued kernels); pass ``telemetry=False`` to the strategy to avoid that.

Report: :class:`TelemetryHistory` accumulates the gathered epochs on every rank; :func:`format_balance_table` and
:func:`plot_balance` (matplotlib, Agg canvas, no pyplot state) render it; :func:`write_balance_report` writes
``balance_report.{json,md,png}``.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from lightning.pytorch import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.autograd import Variable

from lightning_het._compat import on_flavour
from lightning_het.balance.rebalance import DEFAULT_MIN_GAIN, DEFAULT_THRESHOLD, is_check_epoch, plan_rebalance

__all__ = [
    "BalanceMonitor",
    "BalancedStrategy",
    "EpochTimings",
    "HeterogeneousBalanceCallback",
    "MonitorSettings",
    "StepClock",
    "TelemetryHistory",
    "attach_monitor",
    "emulate_slower_device",
    "epoch_summary",
    "format_balance_table",
    "gather_timings",
    "log_epoch_metrics",
    "monitor_callback",
    "plot_balance",
    "telemetry_section",
    "write_balance_report",
]

log = logging.getLogger(__name__)

_MAX_SERIES_POINTS = 20_000  # per replica; older points are thinned (every other one kept) beyond this


@dataclass
class EpochTimings:
    """One replica's per-step timings since the last flush, in seconds (one entry per training batch).

    Attributes:
        compute_s: busy time of each step (forward, backward, emulated slowdown), seconds.
        wait_s: time blocked in gradient synchronisation, seconds.
        step_s: iteration time, seconds.
        batch_sizes: samples of each step.
    """

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
        """Inverse of :meth:`as_tensor`."""
        data = rows.detach().cpu().tolist()
        return cls(
            compute_s=[r[0] for r in data],
            wait_s=[r[1] for r in data],
            step_s=[r[2] for r in data],
            batch_sizes=[round(r[3]) for r in data],
        )


def emulate_slower_device(slowdown: float, wall_s: float, cpu_s: float | None = None) -> float:
    """Sleep so that work which took ``wall_s`` seconds appears to take ``slowdown`` times as long; return the delay.

    The one slowdown emulation of the package (the step clock and profiling both call it).

    Args:
        slowdown: emulation factor ``f >= 1`` (1: no delay).
        wall_s: wall-clock seconds of the work just done.
        cpu_s: CPU seconds of the process over the same span (CPU replicas), or ``None`` (CUDA: the synchronised wall
            time is the work). The work is ``min(wall_s, cpu_s)``: time spent descheduled on shared cores is not
            stretched, and a multi-threaded step (CPU time above wall time) counts its wall time.

    Returns:
        The delay slept, ``(f - 1) x work`` seconds (``>= 0``).
    """
    work = max(wall_s if cpu_s is None else min(wall_s, cpu_s), 0.0)
    delay = (slowdown - 1.0) * work
    if delay > 0.0:
        time.sleep(delay)
    return max(delay, 0.0)


def _cpu_seconds(device: torch.device | None) -> Callable[[], float] | None:
    """The process CPU clock for a CPU replica, ``None`` for an accelerator (its work is synchronised wall time)."""
    return time.process_time if device is None or device.type == "cpu" else None


class StepClock:
    """Times one replica's training steps and, optionally, stretches them to emulate slower hardware.

    The strategy calls, for each training batch: :meth:`step_start` when ``training_step`` starts,
    :meth:`forward_end` when it returns, and :meth:`before_backward` / :meth:`after_backward` around every
    ``backward`` (inside ``training_step`` under manual optimisation, after it otherwise). A step is closed when the
    next one starts or on :meth:`flush`.

    Args:
        slowdown: emulation factor ``f >= 1``: the step's forward and backward compute each take ``f`` times their
            measured work (the clock sleeps ``(f - 1) x`` the work before the gradients are synchronised; see
            :func:`emulate_slower_device`). 1.0 disables the emulation.
        record: keep per-step timings (telemetry). With ``record=False`` the clock only emulates.
        device: the replica's device; CUDA devices are synchronised before each clock read.
    """

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

    # ------------------------------------------------------------------ driven by the strategy
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
        """The open step's batch size and compute seconds so far (at the end of a step: its whole compute, the wait
        in gradient synchronisation left out), or ``None`` when no step is open."""
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

    # ------------------------------------------------------------------ internals
    def _on_backward_start(self, grad: Tensor) -> None:
        self._backward_start = time.perf_counter()
        if self._cpu is not None:
            self._backward_start_cpu = self._cpu()
        Variable._execution_engine.queue_callback(self._on_local_backward_done)

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


def gather_timings(local: EpochTimings, world_size: int, device: torch.device) -> list[EpochTimings]:
    """All-gather every replica's timings (a collective: call it on every rank at the same point).

    Two all-gathers: the step counts, then the rows padded to the longest. ``device`` must suit the backend
    (the replica's root device).
    """
    if world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return [local]
    rows = local.as_tensor().to(device)
    count = torch.tensor([rows.shape[0]], dtype=torch.int64, device=device)
    counts = [torch.zeros_like(count) for _ in range(world_size)]
    dist.all_gather(counts, count)
    longest = max(int(c.item()) for c in counts)
    if longest == 0:  # the same on every rank: nothing recorded anywhere
        return [EpochTimings() for _ in range(world_size)]
    padded = torch.zeros(longest, 4, dtype=torch.float64, device=device)
    padded[: rows.shape[0]] = rows
    everyone = [torch.zeros_like(padded) for _ in range(world_size)]
    dist.all_gather(everyone, padded)
    return [EpochTimings.from_tensor(t[: int(c.item())]) for t, c in zip(everyone, counts)]


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def _typical_steps(t: EpochTimings) -> tuple[int, EpochTimings]:
    """The epoch's most common batch size (ties: the largest) and the steps that ran it.

    An epoch runs one allocation, plus the tail (a smaller last global batch) when the dataset is not a multiple of
    the global batch; the tail's step must not stand for the allocation (its size would pair with the full steps'
    median time and corrupt the cost refresh).
    """
    if not t.batch_sizes:
        return 0, t
    counts: dict[int, int] = {}
    for b in t.batch_sizes:
        counts[b] = counts.get(b, 0) + 1
    size = max(counts, key=lambda b: (counts[b], b))
    keep = [i for i, b in enumerate(t.batch_sizes) if b == size]
    return size, EpochTimings(
        [t.compute_s[i] for i in keep], [t.wait_s[i] for i in keep], [t.step_s[i] for i in keep], [size] * len(keep)
    )


def epoch_summary(timings: Sequence[EpochTimings]) -> dict[str, Any]:
    """Per-replica figures of one epoch (lists indexed by global rank) and the imbalance.

    Keys: ``steps``, ``batch_sizes`` (the epoch's most common batch size: the allocation it ran), ``compute_s`` /
    ``wait_s`` / ``step_s`` (medians over the steps at that batch size, seconds; the tail's smaller step is left
    out), ``compute_recent_s`` (median compute over the later half of those steps: what the replica does *now*),
    ``compute_total_s`` / ``wait_total_s`` (sums over all steps, seconds), ``wait_fraction``
    (wait / (compute + wait)), ``samples_per_s`` (samples / summed step time), and ``imbalance`` (max / min median
    compute time; NaN when a replica recorded nothing).
    """
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
    """Everything measured during one ``fit``, identical on every rank once gathered.

    Attributes:
        epochs: one :func:`epoch_summary` per gathered window, with ``epoch`` and ``global_step`` added.
        series: per replica, the step-by-step ``compute_s`` / ``wait_s`` and the ``batch`` number of each point
            (1-based count of training batches since ``fit`` started; thinned to at most ~20 000 points per replica).
        rebalances: one dict per adopted re-allocation (see :meth:`record_check`).
        checks: every rebalancing decision, adopted or not.
    """

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
        """Book a rebalancing decision (``decision`` from :meth:`RebalanceDecision.as_dict`), made after the batches
        recorded so far (``batch``)."""
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


def log_epoch_metrics(loggers: Iterable[Any], summary: dict[str, Any], step: int) -> None:
    """Send one epoch's per-replica figures to Lightning loggers (``logger.log_metrics``), keyed ``het/...``.

    Keys: ``het/imbalance`` and, per rank ``r``, ``het/compute_s/rank{r}``, ``het/wait_s/rank{r}``,
    ``het/samples_per_s/rank{r}``, ``het/batch_size/rank{r}``. Loggers decorate ``log_metrics`` with
    ``rank_zero_only``, so calling this on every rank logs once.
    """
    metrics: dict[str, float] = {}
    if math.isfinite(summary["imbalance"]):
        metrics["het/imbalance"] = float(summary["imbalance"])
    for key, name in (
        ("compute_s", "compute_s"),
        ("wait_s", "wait_s"),
        ("samples_per_s", "samples_per_s"),
        ("batch_sizes", "batch_size"),
    ):
        for rank, value in enumerate(summary[key]):
            if isinstance(value, (int, float)) and math.isfinite(value):
                metrics[f"het/{name}/rank{rank}"] = float(value)
    for logger in loggers:
        logger.log_metrics(metrics, step=step)


def format_balance_table(report: dict[str, Any]) -> str:
    """Markdown table of a :meth:`HeterogeneousStrategy.balance_report`: allocation plus last-epoch telemetry."""
    sizes = report.get("batch_sizes") or []
    if not sizes:
        return "HeterogeneousStrategy: no allocation yet"
    telemetry = report.get("telemetry") or {}
    epochs = telemetry.get("epochs") or []
    last = epochs[-1] if epochs else None
    speeds = report.get("speeds") or [float("nan")] * len(sizes)
    lines = [
        f"Global batch {report.get('global_batch_size')}, {len(sizes)} replicas"
        + (f"; last epoch {last['epoch']}: imbalance (max/min compute) {last['imbalance']:.3f}" if last else ""),
        "",
        "| rank | batch | speed (samples/s) | compute (ms, median) | wait (ms, median) | wait share | samples/s |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r, (b, s) in enumerate(zip(sizes, speeds)):
        if last:
            c, w = last["compute_s"][r] * 1e3, last["wait_s"][r] * 1e3
            cols = f"{c:.1f} | {w:.1f} | {last['wait_fraction'][r]:.1%} | {last['samples_per_s'][r]:.1f}"
        else:
            cols = "- | - | - | -"
        lines.append(f"| {r} | {b} | {s:.2f} | {cols} |")
    rebalances = telemetry.get("rebalances") or []
    if rebalances:
        lines += ["", "Rebalances:"]
        for e in rebalances:
            lines.append(
                f"- end of epoch {e['epoch']} (step {e['global_step']}): {e['from']} -> {e['batch_sizes']}"
                f" ({e['reason']})"
            )
    return "\n".join(lines)


def plot_balance(report: dict[str, Any], path: str | Path) -> Path:
    """PNG of compute vs wait time per replica over the global step, with rebalances marked.

    Up to 8 replicas get one panel each (compute and wait per step); larger jobs get two heat maps (rank x step).
    Uses matplotlib's Agg canvas directly, leaving pyplot and the user's backend alone.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    telemetry = report.get("telemetry") or {}
    series = telemetry.get("series") or {}
    compute, wait, steps = series.get("compute_s") or [], series.get("wait_s") or [], series.get("batch") or []
    world = len(compute)
    path = Path(path)
    rebalance_steps = [e["batch"] + 0.5 for e in telemetry.get("rebalances") or []]
    if world == 0:
        fig = Figure(figsize=(6, 2))
        fig.text(0.5, 0.5, "no telemetry recorded", ha="center", va="center")
    elif world <= 8:
        fig = Figure(figsize=(9, 1.8 * world + 0.8))
        axes = fig.subplots(world, 1, sharex=True, squeeze=False)[:, 0]
        for r, ax in enumerate(axes):
            ax.plot(steps[r], [c * 1e3 for c in compute[r]], lw=0.9, label="compute")
            ax.plot(steps[r], [w * 1e3 for w in wait[r]], lw=0.9, label="wait (gradient sync)")
            for s in rebalance_steps:
                ax.axvline(s, color="k", ls="--", lw=0.8)
            ax.set_ylabel(f"rank {r}\nms / step")
            ax.grid(alpha=0.3)
            values = sorted(v for v in compute[r] + wait[r] if math.isfinite(v))
            if len(values) > 20:  # keep the first steps (start-up costs) from flattening the rest
                ax.set_ylim(0, values[int(0.98 * (len(values) - 1))] * 1.3e3)
        axes[0].legend(loc="upper right", fontsize=8)
        axes[-1].set_xlabel("training batch" + ("  (dashed: rebalance)" if rebalance_steps else ""))
        fig.suptitle("Compute vs wait per replica")
    else:
        fig = Figure(figsize=(10, 6))
        axes = fig.subplots(2, 1, sharex=True)
        length = min(len(c) for c in compute)
        for ax, data, title in ((axes[0], compute, "compute (ms)"), (axes[1], wait, "wait (ms)")):
            image = ax.imshow([[v * 1e3 for v in row[:length]] for row in data], aspect="auto", interpolation="nearest")
            ax.set_ylabel("rank")
            ax.set_title(title)
            fig.colorbar(image, ax=ax)
        axes[-1].set_xlabel("recorded step")
    fig.tight_layout()
    FigureCanvasAgg(fig).print_png(str(path))
    return path


def write_balance_report(report: dict[str, Any], directory: str | Path) -> dict[str, Path]:
    """Write ``balance_report.json``, ``balance_report.md`` (table) and ``balance_report.png`` into ``directory``."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "json": out / "balance_report.json",
        "table": out / "balance_report.md",
        "plot": out / "balance_report.png",
    }
    paths["json"].write_text(json.dumps(_plain(report), indent=1) + "\n")
    paths["table"].write_text(format_balance_table(report) + "\n")
    plot_balance(report, paths["plot"])
    return paths


def _plain(value: Any) -> Any:
    """JSON-safe copy: non-finite floats become ``None``, tuples lists, unknown objects strings."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return str(value)


# ---------------------------------------------------------------------- the per-process driver used by the strategy
class BalancedStrategy(Protocol):
    """What :class:`BalanceMonitor` uses of the strategy it serves: public state and two public methods, nothing else.

    The monitor never writes the strategy's attributes; a rebalancing decision is handed to
    :meth:`adopt_allocation`, and the strategy changes its own state there.
    """

    @property
    def world_size(self) -> int: ...

    @property
    def root_device(self) -> torch.device: ...

    @property
    def batch_sizes(self) -> list[int] | None: ...

    @property
    def cost_model(self) -> list[Any] | None: ...

    def adopt_allocation(
        self, batch_sizes: list[int], speeds: list[float], costs: list[dict[str, float]] | None = None
    ) -> None: ...

    def balance_report(self, include_series: bool = False) -> dict[str, Any]: ...


@dataclass(frozen=True)
class MonitorSettings:
    """The strategy's telemetry and rebalancing settings for one replica, given explicitly to :func:`attach_monitor`.

    Attributes:
        record: collect telemetry (``telemetry=True`` on the strategy).
        slowdown: this replica's emulation factor (``>= 1``; ``1.0``: no emulation).
        every_n_epochs: rebalancing check period in epochs (``None``: see ``threshold``).
        threshold: imbalance that makes a check act; with ``every_n_epochs=None`` a check runs every epoch.
        min_batch_size: fewest training samples per replica and step that a new allocation may give (``>= 1``).
        max_batch_sizes: per-replica upper bounds, indexed by global rank (``None``: unbounded).
        min_gain: predicted relative step-time gain needed to adopt a new allocation.
        profile: the fit profiles on its first training steps (the clock then runs even without telemetry).
    """

    record: bool
    slowdown: float = 1.0
    every_n_epochs: int | None = None
    threshold: float | None = None
    min_batch_size: int = 1
    max_batch_sizes: tuple[int, ...] | None = None
    min_gain: float = DEFAULT_MIN_GAIN
    profile: bool = False

    @property
    def active(self) -> bool:
        """Whether the monitor has anything to do (telemetry, emulation or in-loop profiling, which reads the step
        clock); off, training has no per-step cost."""
        return self.record or self.slowdown != 1.0 or self.profile


class BalanceMonitor:
    """Drives telemetry, rebalancing and the balance report of one strategy in one process.

    Built by the strategy in ``setup`` (in every worker; it holds a reference to the strategy and is not pickled).
    Lightning calls it through :class:`HeterogeneousBalanceCallback`, which the strategy appends to
    ``trainer.callbacks``:

    * ``on_train_batch_end`` of an epoch's last batch (every rank): flush the :class:`StepClock`, all-gather every
      replica's timings (:func:`gather_timings`), add them to the :class:`TelemetryHistory`, send the epoch's figures
      to the loggers, and, when a check is due, re-allocate with
      :func:`~lightning_het.balance.rebalance.plan_rebalance` (see :meth:`maybe_rebalance`). Not at
      ``on_train_epoch_end``: there rank 0's progress bar starts the epoch metrics' ``sync_dist`` reduction alone, and
      a collective of ours in between would pair with it on the other ranks (a deadlock). An epoch that ends early
      (``max_steps``, ``should_stop``, ``on_train_batch_start`` returning ``-1``) is gathered when the next one
      starts, or at ``on_train_end``;
    * ``on_train_end`` (every rank): gather what is left and let rank 0 write the balance report into
      ``trainer.log_dir`` (only when the trainer has loggers).

    It reads only the strategy's public interface (:class:`BalancedStrategy`) and the explicit ``settings``.

    Args:
        strategy: the :class:`~lightning_het.HeterogeneousStrategy` it serves.
        settings: telemetry, emulation, rebalancing and batch bounds (see :class:`MonitorSettings`).
    """

    def __init__(self, strategy: BalancedStrategy, settings: MonitorSettings) -> None:
        self.strategy = strategy
        self.settings = settings
        self.record = settings.record
        self.clock: StepClock | None = (
            StepClock(settings.slowdown, record=settings.record, device=strategy.root_device)
            if settings.active
            else None
        )
        self.history = TelemetryHistory()
        self.every_n_epochs = settings.every_n_epochs
        self.threshold = settings.threshold
        self.min_gain = settings.min_gain
        self.report_paths: dict[str, Path] = {}
        self._saved_reload_every: int | None = None
        self._gathered_epoch: int | None = None  # the last epoch gathered at its last batch
        self._pending_epoch: int | None = None  # an epoch that ended before its last batch, not gathered yet

    @property
    def rebalancing(self) -> bool:
        """Whether any rebalancing check is configured."""
        return self.every_n_epochs is not None or self.threshold is not None

    def reset(self) -> None:
        """A new ``fit`` starts: forget the previous one's timings."""
        if self.clock is not None:
            self.clock.flush()
        self.history = TelemetryHistory()
        self.report_paths = {}
        self._gathered_epoch = self._pending_epoch = None

    def _gather(self, trainer: Any, epoch: int) -> dict[str, Any] | None:
        local = self.clock.flush() if self.clock is not None else EpochTimings()
        if not self.record:
            return None
        strategy = self.strategy
        timings = gather_timings(local, strategy.world_size, strategy.root_device)
        if not any(len(t) for t in timings):
            return None
        return self.history.add(timings, epoch=epoch, global_step=trainer.global_step)

    def on_train_batch_end(self, trainer: Any) -> None:
        """Collective at an epoch's last batch: gather, log and maybe rebalance (see the class docstring)."""
        if trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            self._end_epoch(trainer, trainer.current_epoch)

    def on_train_epoch_end(self, trainer: Any) -> None:
        """No collective here (see the class docstring): an epoch not gathered yet is gathered later."""
        if self._gathered_epoch != trainer.current_epoch:
            self._pending_epoch = trainer.current_epoch

    def _end_epoch(self, trainer: Any, epoch: int) -> None:
        self._gathered_epoch = epoch
        summary = self._gather(trainer, epoch)
        if summary is None:
            return
        log_epoch_metrics(trainer.loggers, summary, step=trainer.global_step)
        self.maybe_rebalance(trainer, summary, epoch)

    def _end_pending_epoch(self, trainer: Any) -> None:
        if self._pending_epoch is not None:
            epoch, self._pending_epoch = self._pending_epoch, None
            self._end_epoch(trainer, epoch)

    def check_due(self, trainer: Any, epoch: int | None = None) -> bool:
        """A rebalancing check runs at the end of ``epoch`` (default: the current one), and a next epoch exists to use
        its result."""
        if not self.rebalancing:
            return False
        epoch = trainer.current_epoch if epoch is None else epoch
        due = is_check_epoch(epoch, self.every_n_epochs) if self.every_n_epochs is not None else True
        max_epochs = trainer.max_epochs
        last_epoch = max_epochs is not None and max_epochs >= 0 and epoch + 1 >= max_epochs
        max_steps = trainer.max_steps
        out_of_steps = max_steps is not None and max_steps >= 0 and trainer.global_step >= max_steps
        return due and not (last_epoch or out_of_steps or trainer.should_stop)

    def maybe_rebalance(self, trainer: Any, summary: dict[str, Any], epoch: int | None = None) -> bool:
        """Re-allocate from this epoch's median compute times when a check is due and the hysteresis allows.

        Every rank holds the same gathered ``summary`` and so reaches the same decision. On adoption the decision
        goes to the strategy's ``adopt_allocation`` (it changes its own allocation and loss scale), and
        ``trainer.reload_dataloaders_every_n_epochs`` is set to 1 until the next epoch starts, so the fit loop rebuilds
        the training loader then (``train_dataloader()`` again, through the strategy's ``process_dataloader``) with the
        new per-replica batch sizes. The current loader stays in place meanwhile, so epoch-end callbacks (checkpoints)
        still see the finished epoch's sampler. Each global batch is the same as before, only its split changes, so
        gradients stay exact and step counts equal.

        Returns:
            Whether the allocation changed.
        """
        strategy = self.strategy
        sizes = strategy.batch_sizes
        cost_model = strategy.cost_model
        times = summary["compute_s"]
        epoch = trainer.current_epoch if epoch is None else epoch
        if not self.check_due(trainer, epoch) or not sizes or not all(math.isfinite(t) and t > 0 for t in times):
            return False
        if getattr(strategy, "profiling", False) or list(summary.get("batch_sizes", sizes)) != list(sizes):
            # still profiling (the fitted split is coming), or the epoch mostly ran other splits (a short epoch spent
            # profiling): its medians do not describe `sizes`
            return False
        decision = plan_rebalance(
            sizes,
            times,
            threshold=self.threshold if self.threshold is not None else DEFAULT_THRESHOLD,
            min_gain=self.min_gain,
            min_batch_size=self.settings.min_batch_size,
            max_batch_sizes=list(self.settings.max_batch_sizes) if self.settings.max_batch_sizes else None,
            fixed_costs=[c.fixed_s for c in cost_model] if cost_model else None,
            previous=self._previous_points(sizes),
            last_times=self._last_times(sizes),
            recent_times=summary.get("compute_recent_s"),
        )
        self.history.record_check(decision.as_dict(), epoch=epoch, global_step=trainer.global_step, old=sizes)
        if not decision.adopt:
            log.debug("lightning-het: keeping batch sizes %s (%s)", sizes, decision.reason)
            return False
        strategy.adopt_allocation(decision.batch_sizes, decision.speeds, costs=decision.costs)
        self._request_reload(trainer)
        rank_zero_info(
            f"HeterogeneousStrategy: rebalanced at the end of epoch {epoch}: {sizes} ->"
            f" {decision.batch_sizes} ({decision.reason})"
        )
        return True

    def _last_times(self, sizes: Sequence[int]) -> list[float] | None:
        """Median compute seconds of the epoch before the current one when it ran the same ``sizes`` (else ``None``):
        a sudden rise is confirmed by one more check before re-allocating."""
        if len(self.history.epochs) < 2:
            return None
        before = self.history.epochs[-2]
        times = before["compute_s"]
        if list(before["batch_sizes"]) != list(sizes) or not all(math.isfinite(t) and t > 0 for t in times):
            return None
        return [float(t) for t in times]

    def _previous_points(self, sizes: Sequence[int]) -> list[tuple[int, float] | None]:
        """Per replica, ``(batch size, median compute seconds)`` of the latest epoch before the current one that ran a
        batch size other than ``sizes[r]`` (``None`` if none): the second point of the affine refresh."""
        out: list[tuple[int, float] | None] = []
        earlier = self.history.epochs[:-1]
        for r, b in enumerate(sizes):
            point = None
            for epoch in reversed(earlier):
                size, t = epoch["batch_sizes"][r], epoch["compute_s"][r]
                if size != b and size > 0 and math.isfinite(t) and t > 0:
                    point = (int(size), float(t))
                    break
            out.append(point)
        return out

    def _request_reload(self, trainer: Any) -> None:
        """Make the fit loop rebuild the training loader when the next epoch starts, as
        ``reload_dataloaders_every_n_epochs`` does; the setting is restored once that happened."""
        if self._saved_reload_every is None:
            self._saved_reload_every = trainer.reload_dataloaders_every_n_epochs
        trainer.reload_dataloaders_every_n_epochs = 1

    def _restore_reload(self, trainer: Any) -> None:
        if self._saved_reload_every is not None:
            trainer.reload_dataloaders_every_n_epochs = self._saved_reload_every
            self._saved_reload_every = None

    def on_train_epoch_start(self, trainer: Any) -> None:
        """The fit loop has (re)built the training loader for this epoch: restore the user's reload setting; gather
        an epoch that ended early (a rebalance then applies from the next epoch on)."""
        self._restore_reload(trainer)
        self._end_pending_epoch(trainer)

    def on_train_end(self, trainer: Any) -> None:
        """Collective: gather an epoch that ended early or a trailing partial epoch, then rank 0 writes the balance
        report (with loggers)."""
        self._restore_reload(trainer)
        self._end_pending_epoch(trainer)
        self._gather(trainer, trainer.current_epoch)
        if not self.record or not trainer.loggers:
            return
        directory = trainer.log_dir  # a broadcast: every rank must ask
        if trainer.is_global_zero and directory:
            self.report_paths = write_balance_report(self.strategy.balance_report(include_series=True), directory)
            rank_zero_info(f"HeterogeneousStrategy: balance report written to {self.report_paths['table']}")


class _BalanceCallbackMixin:
    """Forwards the fit loop's epoch hooks to a :class:`BalanceMonitor` (mixed into the package's ``Callback``)."""

    def __init__(self, monitor: BalanceMonitor) -> None:
        self.monitor = monitor

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self.monitor.on_train_epoch_start(trainer)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        self.monitor.on_train_batch_end(trainer)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self.monitor.on_train_epoch_end(trainer)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.monitor.on_train_end(trainer)

    def __getstate__(self) -> dict[str, Any]:
        return {"monitor": None}  # per-process state (it references the strategy): never travels


class HeterogeneousBalanceCallback(_BalanceCallbackMixin, Callback):
    """Added by :class:`~lightning_het.HeterogeneousStrategy` to ``trainer.callbacks`` (``lightning.pytorch``)."""


def monitor_callback(monitor: BalanceMonitor, trainer: Any) -> Any:
    """The callback forwarding ``trainer``'s epoch hooks to ``monitor``.

    Subclasses the ``Callback`` of the package the trainer comes from (``lightning.pytorch``, or the standalone
    ``pytorch_lightning`` when the trainer is one of its; see :func:`lightning_het._compat.on_flavour`), so the
    trainer's callback plumbing (ordering, checkpoint state keys) treats it as any other callback.
    """
    return on_flavour(HeterogeneousBalanceCallback, trainer)(monitor)


def attach_monitor(
    strategy: BalancedStrategy, trainer: Any, settings: MonitorSettings, monitor: BalanceMonitor | None = None
) -> BalanceMonitor | None:
    """Build (or reset) the strategy's :class:`BalanceMonitor` for a new ``fit`` and hook it into ``trainer``.

    Args:
        strategy: the strategy the monitor serves (its public interface only, see :class:`BalancedStrategy`).
        trainer: the Trainer whose ``callbacks`` get the monitor's callback (replacing an older one).
        settings: this replica's settings, given by the strategy.
        monitor: the previous fit's monitor, reused (reset) when its settings are the same.

    Returns:
        The monitor, or ``None`` (no per-step cost at all) when neither telemetry nor emulation is on.
    """
    if not settings.active:
        return None
    if monitor is None or monitor.settings != settings:
        monitor = BalanceMonitor(strategy, settings)
    monitor.reset()
    callbacks = trainer.callbacks
    for i, cb in enumerate(callbacks):
        if isinstance(cb, _BalanceCallbackMixin):
            callbacks[i] = monitor_callback(monitor, trainer)
            break
    else:
        callbacks.append(monitor_callback(monitor, trainer))
    return monitor


def telemetry_section(
    monitor: BalanceMonitor | None, snapshot: dict[str, Any] | None, *, include_series: bool
) -> dict[str, Any] | None:
    """The ``"telemetry"`` entry of ``balance_report()``: JSON-safe, from the live monitor or a spawn snapshot."""
    if monitor is not None and monitor.record:
        data = monitor.history.as_dict()
    elif snapshot is not None:
        data = dict(snapshot)
    else:
        return None
    if not include_series:
        data.pop("series", None)
    return _plain(data)
