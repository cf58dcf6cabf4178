"""The per-process driver of telemetry and rebalancing: the :class:`BalanceMonitor` callback and its history."""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch.distributed as dist
from lightning.pytorch import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_het._compat import batch_hooks
from lightning_het._flavour import trainer_flavour
from lightning_het.allocation import positive_finite
from lightning_het.balance import rebalance
from lightning_het.balance.clock import EpochTimings, StepClock
from lightning_het.balance.cost import AffineCost, costs_from_speeds
from lightning_het.balance.report import log_epoch_metrics, write_balance_report
from lightning_het.config import Profiling

_MAX_SERIES_POINTS = 20_000  # per replica; older points are thinned (every other one kept) beyond this
_SERIES = ("compute_s", "wait_s", "batch")  # per step and replica, in the telemetry
TIMED_EVERY = 4  # once profiling has ended, telemetry times one training step in this many (all under emulation)


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def epoch_summary(timings: Sequence[EpochTimings]) -> dict[str, Any]:
    """Per-replica figures of one epoch (medians over the steps at its most common batch size) and the imbalance."""
    sizes = [max(Counter(t.batch_sizes).items(), key=lambda bn: (bn[1], bn[0]), default=(0, 0))[0] for t in timings]
    typical = [[i for i, b in enumerate(t.batch_sizes) if b == size] for t, size in zip(timings, sizes)]
    compute = [[t.compute_s[i] for i in keep] for t, keep in zip(timings, typical)]
    scale = [t.covered / len(t) if len(t) else 1.0 for t in timings]  # timed every few steps: the totals estimated
    total_c = [math.fsum(t.compute_s) * f for t, f in zip(timings, scale)]
    total_w = [math.fsum(t.wait_s) * f for t, f in zip(timings, scale)]
    medians = [_median(c) for c in compute]
    positive = [c for c in medians if math.isfinite(c) and c > 0]
    return {
        "steps": [t.covered for t in timings],
        "batch_sizes": sizes,
        "compute_s": medians,
        "compute_recent_s": [_median(c[len(c) // 2 :]) for c in compute],
        "wait_s": [_median([t.wait_s[i] for i in keep]) for t, keep in zip(timings, typical)],
        "step_s": [_median([t.step_s[i] for i in keep]) for t, keep in zip(timings, typical)],
        "compute_total_s": total_c,
        "wait_total_s": total_w,
        "wait_fraction": [w / (c + w) if c + w > 0 else 0.0 for c, w in zip(total_c, total_w)],
        "samples_per_s": [
            sum(t.batch_sizes) / math.fsum(t.step_s) if t.step_s and math.fsum(t.step_s) > 0 else 0.0 for t in timings
        ],
        "imbalance": (max(positive) / min(positive)) if len(positive) == len(medians) and positive else float("nan"),
    }


@batch_hooks()
class BalanceMonitor:
    """Callback hooks (mixed into the trainer package's ``Callback``): times the steps, gathers each epoch's timings (a
    collective at its last batch), logs them, rebalances when due and writes the balance report."""

    def __init__(self, strategy: Any, profiling: Profiling, slowdown: float = 1.0, **bounds: Any) -> None:
        self.strategy, self.profiling = strategy, profiling
        self.record = profiling.telemetry and strategy.world_size > 1
        self.clock = StepClock(slowdown, record=self.record, device=strategy.root_device)
        self._sampling = False  # whether the clock's sampling was decided (once profiling has ended)
        #: everything measured during the fit, identical on every rank once gathered (the report's ``telemetry``)
        self.history = {"epochs": [], "series": dict.fromkeys(_SERIES, ()), "rebalances": [], "checks": []}
        self._stride, self._seen = 1, 0  # series: every _stride-th step kept; steps seen
        #: the rebalancing decision across this fit's checks: each replica's cost shape and its smoothed scale
        self.threshold, self.bounds = profiling.rebalance_threshold or rebalance.DEFAULT_THRESHOLD, bounds
        self._shape: list[AffineCost] | None = None
        self._tracks: list[rebalance.Track] = []
        self.report_paths: dict[str, Path] = {}
        self._saved_reload_every: int | None = None
        self._gathered_epoch: int | None = None  # the last epoch gathered at its last batch
        self._pending_epoch: int | None = None  # an epoch that ended before its last batch, not gathered yet

    def __getstate__(self) -> dict[str, Any]:
        return {}  # per-process state (it references the strategy): never travels; the next setup replaces it

    def _gather(self, trainer: Any, epoch: int) -> dict[str, Any] | None:
        local = self.clock.flush()
        if not self.record:
            return None
        timings = [local]
        if dist.is_available() and dist.is_initialized():
            timings = [None] * self.strategy.world_size
            dist.all_gather_object(timings, local)  # once per epoch: a few floats per step
        return self.add(timings, epoch=epoch, global_step=trainer.global_step) if any(map(len, timings)) else None

    def add(self, timings: Sequence[EpochTimings], *, epoch: int, global_step: int) -> dict[str, Any]:
        """Book one gathered window (usually an epoch) in :attr:`history`; returns its summary."""
        summary = {**epoch_summary(timings), "epoch": epoch, "global_step": global_step}
        self.history["epochs"].append(summary)
        series = self.history["series"]
        if not series["compute_s"]:
            series.update({key: [[] for _ in timings] for key in series})
        for r, t in enumerate(timings):
            index = t.index or range(self._seen + 1, self._seen + len(t) + 1)  # each entry's step in the fit
            keep = [i for i, n in enumerate(index) if (n - 1) % self._stride == 0]
            series["compute_s"][r] += [t.compute_s[i] for i in keep]
            series["wait_s"][r] += [t.wait_s[i] for i in keep]
            series["batch"][r] += [float(index[i]) for i in keep]
        self._seen += max(t.covered for t in timings)
        while len(series["compute_s"][0]) > _MAX_SERIES_POINTS:
            series.update({key: [v[::2] for v in values] for key, values in series.items()})
            self._stride *= 2
        return summary

    def _end_epoch(self, trainer: Any, epoch: int | None) -> None:
        if epoch is None:
            return
        self._gathered_epoch, self._pending_epoch = epoch, None
        summary = self._gather(trainer, epoch)
        if summary is not None:
            log_epoch_metrics(trainer.loggers, summary, step=trainer.global_step)
            self.maybe_rebalance(trainer, summary, epoch)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        """Restore the user's reload setting; gather an epoch that ended before its last batch."""
        if self._saved_reload_every is not None:
            trainer.reload_dataloaders_every_n_epochs, self._saved_reload_every = self._saved_reload_every, None
        self._end_epoch(trainer, self._pending_epoch)

    def batch_ended(self, trainer: Any, batch_idx: int) -> None:
        """A training batch ended (from the strategy's one batch-end callback): the epoch's gather at its last batch."""
        if trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            self._end_epoch(trainer, trainer.current_epoch)
        profiler = self.strategy.policy.profiler  # the first steps' profiling reads their compute times
        if profiler is not None:
            profiler.on_train_batch_end(trainer.current_epoch, batch_idx)
        if not self._sampling and not self.strategy.profiling:  # profiled: telemetry needs no more than a sample
            self._sampling = True
            if not self.strategy.config.emulate_slowdown:  # emulating: every replica times every step, alike
                self.clock.every = TIMED_EVERY

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if self._gathered_epoch != trainer.current_epoch:  # no collective here: gathered at the next epoch's start
            self._pending_epoch = trainer.current_epoch

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """Collective: gather what is left, then rank 0 writes the balance report (with loggers)."""
        self.on_train_epoch_start(trainer, pl_module)  # the same catching up
        self._gather(trainer, trainer.current_epoch)
        if not self.record or not trainer.loggers:
            return
        directory = trainer.log_dir  # a broadcast: every rank must ask
        if trainer.is_global_zero and directory:
            self.report_paths = write_balance_report(self.strategy.balance_report(include_series=True), directory)
            rank_zero_info(f"HeterogeneousStrategy: balance report written to {self.report_paths['table']}")

    def maybe_rebalance(self, trainer: Any, summary: dict[str, Any], epoch: int) -> bool:
        """Re-allocate from this epoch's median compute times when a check is due and the hysteresis allows."""
        strategy, every = self.strategy, self.profiling.rebalance_every_n_epochs
        sizes, times = strategy.batch_sizes, summary["compute_s"]
        last_epoch = trainer.max_epochs is not None and 0 <= trainer.max_epochs <= epoch + 1
        out_of_steps = trainer.max_steps is not None and 0 <= trainer.max_steps <= trainer.global_step
        due = (epoch + 1) % every == 0 if every is not None else self.profiling.rebalance_threshold is not None
        if not due or last_epoch or out_of_steps or trainer.should_stop or not sizes or strategy.profiling:
            return False
        # the epoch's medians must describe `sizes` (not the trial splits of profiling)
        if not all(math.isfinite(t) and t > 0 for t in times) or list(summary.get("batch_sizes", sizes)) != sizes:
            return False
        steps = max(summary["steps"]) * (every or 1) if summary.get("steps") else None
        recent = summary.get("compute_recent_s")
        decision = self.check(sizes, times, costs=strategy.cost_model, recent_times=recent, steps_per_check=steps)
        check = {"epoch": epoch, "global_step": trainer.global_step, "batch": self._seen, "from": sizes}
        self.history["checks"].append({**check, **asdict(decision)})
        if not decision.adopt:  # (the reason is in the history)
            return False
        self.history["rebalances"].append(self.history["checks"][-1])
        strategy.adopt_allocation(decision.batch_sizes, decision.speeds, costs=decision.costs)
        if self._saved_reload_every is None:  # the fit loop rebuilds the training loader when the next epoch starts
            self._saved_reload_every = trainer.reload_dataloaders_every_n_epochs
        trainer.reload_dataloaders_every_n_epochs = 1
        rank_zero_info(
            f"HeterogeneousStrategy: rebalanced at the end of epoch {epoch}: {sizes} ->"
            f" {decision.batch_sizes} ({decision.reason})"
        )
        return True

    def check(
        self,
        batch_sizes: Sequence[int],
        compute_times: Sequence[float],
        *,
        costs: Sequence[AffineCost] | None = None,
        recent_times: Sequence[float] | None = None,
        steps_per_check: int | None = None,
    ) -> rebalance.RebalanceDecision:
        """Book one check's median busy times (at ``batch_sizes``) and decide (pure: no collective, no trainer)."""
        sizes = [int(b) for b in batch_sizes]
        times = positive_finite("compute_times", compute_times, len(sizes))
        recent = positive_finite("recent_times", recent_times, len(sizes)) if recent_times is not None else None
        if self._shape is None or len(self._shape) != len(sizes):
            self._shape = list(costs) if costs is not None else costs_from_speeds([1.0] * len(sizes))
            self._tracks = [rebalance.Track() for _ in sizes]
        for r, (track, cost, b) in enumerate(zip(self._tracks, self._shape, sizes)):
            track.add(math.log(times[r] / cost(b)), math.log(recent[r] / cost(b)) if recent is not None else None)
        scales = [math.exp(t.level) for t in self._tracks]
        smoothed = [AffineCost(c.fixed_s * f, c.per_sample_s * f, c.micro_batch) for c, f in zip(self._shape, scales)]
        return rebalance.plan_rebalance(
            sizes,
            [c(b) for c, b in zip(smoothed, sizes)],
            threshold=self.threshold,
            **self.bounds,
            fixed_costs=[c.fixed_s for c in smoothed],
            micro_batch_sizes=[c.micro_batch for c in smoothed],
            uncertainty=[t.spread / math.sqrt(len(t.values)) for t in self._tracks],  # the levels' standard errors
            reallocation_cost=rebalance.REALLOCATION_COST_STEPS / steps_per_check if steps_per_check else 0.0,
        )


class HeterogeneousBalanceCallback(BalanceMonitor, Callback):
    """Added by :class:`~lightning_het.HeterogeneousStrategy` to ``trainer.callbacks`` (``lightning.pytorch``)."""


def attach_monitor(
    strategy: Any, trainer: Any, profiling: Profiling, slowdown: float = 1.0, **bounds: Any
) -> BalanceMonitor | None:
    """A new ``fit``'s monitor in ``trainer.callbacks`` (replacing the last fit's); ``None``: nothing to time."""
    trainer.callbacks[:] = [cb for cb in trainer.callbacks if not isinstance(cb, BalanceMonitor)]
    if slowdown == 1.0 and (strategy.world_size < 2 or (not profiling.telemetry and strategy.speeds_given)):
        return None
    monitor = trainer_flavour(trainer).HeterogeneousBalanceCallback(strategy, profiling, slowdown, **bounds)
    trainer.callbacks.append(monitor)
    return monitor
