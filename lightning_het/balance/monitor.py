"""The per-process driver of telemetry and rebalancing: :class:`BalanceMonitor`, its settings and its callback."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_het._flavour import trainer_flavour
from lightning_het.balance.clock import EpochTimings, StepClock, TelemetryHistory, gather_timings
from lightning_het.balance.rebalance import DEFAULT_MIN_GAIN, DEFAULT_THRESHOLD, RebalancePolicy, is_check_epoch
from lightning_het.balance.report import log_epoch_metrics, write_balance_report

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MonitorSettings:
    """The strategy's telemetry and rebalancing settings for one replica, given explicitly to :func:`attach_monitor`."""

    record: bool
    slowdown: float = 1.0
    every_n_epochs: int | None = None
    threshold: float | None = None
    min_batch_size: int = 1
    max_batch_sizes: tuple[int, ...] | None = None
    min_gain: float = DEFAULT_MIN_GAIN
    profile: bool = False

    @classmethod
    def of(cls, config: Any, rank: int, world_size: int, min_batch_size: int) -> MonitorSettings:
        """This replica's settings from the strategy's config, and the batch bounds a rebalance keeps."""
        factors, bounds = config.emulate_slowdown, config.max_batch_sizes
        return cls(
            record=config.telemetry,
            slowdown=factors[rank] if factors else 1.0,
            profile=config.speeds is None and world_size > 1,
            every_n_epochs=config.rebalance_every_n_epochs,
            threshold=config.rebalance_threshold,
            min_batch_size=min_batch_size,
            max_batch_sizes=tuple(bounds) if bounds is not None else None,
        )

    @property
    def active(self) -> bool:
        """Whether the monitor has anything to do; off, training has no per-step cost."""
        return self.record or self.slowdown != 1.0 or self.profile


class BalanceMonitor:
    """Drives telemetry, rebalancing and the balance report of one strategy in one process."""

    def __init__(self, strategy: Any, settings: MonitorSettings) -> None:
        self.strategy = strategy
        self.settings = settings
        self.record = settings.record
        self.clock: StepClock | None = None
        if settings.active:
            self.clock = StepClock(settings.slowdown, record=settings.record, device=strategy.root_device)
        self.history = TelemetryHistory()
        self.every_n_epochs = settings.every_n_epochs
        self.threshold = settings.threshold
        self.min_gain = settings.min_gain
        #: the decision across this fit's checks (smoothed costs, confirmed changes, gain net of the rebuild)
        self.policy = RebalancePolicy(
            threshold=settings.threshold if settings.threshold is not None else DEFAULT_THRESHOLD,
            min_gain=settings.min_gain,
            min_batch_size=settings.min_batch_size,
            max_batch_sizes=list(settings.max_batch_sizes) if settings.max_batch_sizes else None,
        )
        self.report_paths: dict[str, Path] = {}
        self._saved_reload_every: int | None = None
        self._gathered_epoch: int | None = None  # the last epoch gathered at its last batch
        self._pending_epoch: int | None = None  # an epoch that ended before its last batch, not gathered yet

    @property
    def rebalancing(self) -> bool:
        return self.every_n_epochs is not None or self.threshold is not None

    def reset(self) -> None:
        """A new ``fit`` starts: forget the previous one's timings."""
        if self.clock is not None:
            self.clock.flush()
        self.history = TelemetryHistory()
        self.policy.reset()
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
        """Whether a rebalancing check runs at the end of ``epoch`` (default: the current one), with a next epoch."""
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
        """Re-allocate from this epoch's median compute times when a check is due and the hysteresis allows."""
        strategy = self.strategy
        sizes = strategy.batch_sizes
        cost_model = strategy.cost_model
        times = summary["compute_s"]
        epoch = trainer.current_epoch if epoch is None else epoch
        if not self.check_due(trainer, epoch) or not sizes or not all(math.isfinite(t) and t > 0 for t in times):
            return False
        if strategy.profiling or list(summary.get("batch_sizes", sizes)) != list(sizes):
            # still profiling, or the epoch mostly ran other splits: its medians do not describe `sizes`
            return False
        steps = max(summary["steps"]) * (self.every_n_epochs or 1) if summary.get("steps") else None
        decision = self.policy.check(
            sizes,
            times,
            costs=list(cost_model) if cost_model else None,
            recent_times=summary.get("compute_recent_s"),
            steps_per_check=steps,
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

    def _request_reload(self, trainer: Any) -> None:
        """Make the fit loop rebuild the training loader when the next epoch starts (restored afterwards)."""
        if self._saved_reload_every is None:
            self._saved_reload_every = trainer.reload_dataloaders_every_n_epochs
        trainer.reload_dataloaders_every_n_epochs = 1

    def _restore_reload(self, trainer: Any) -> None:
        if self._saved_reload_every is not None:
            trainer.reload_dataloaders_every_n_epochs = self._saved_reload_every
            self._saved_reload_every = None

    def on_train_epoch_start(self, trainer: Any) -> None:
        """Restore the user's reload setting; gather an epoch that ended early."""
        self._restore_reload(trainer)
        self._end_pending_epoch(trainer)

    def on_train_end(self, trainer: Any) -> None:
        """Collective: gather what is left, then rank 0 writes the balance report (with loggers)."""
        self._restore_reload(trainer)
        self._end_pending_epoch(trainer)
        self._gather(trainer, trainer.current_epoch)
        if not self.record or not trainer.loggers:
            return
        directory = trainer.log_dir  # a broadcast: every rank must ask
        if trainer.is_global_zero and directory:
            self.report_paths = write_balance_report(self.strategy.balance_report(include_series=True), directory)
            rank_zero_info(f"HeterogeneousStrategy: balance report written to {self.report_paths['table']}")


class BalanceCallbackMixin:
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


class HeterogeneousBalanceCallback(BalanceCallbackMixin, Callback):
    """Added by :class:`~lightning_het.HeterogeneousStrategy` to ``trainer.callbacks`` (``lightning.pytorch``)."""


def monitor_callback(monitor: BalanceMonitor, trainer: Any) -> Any:
    """The callback forwarding ``trainer``'s epoch hooks to ``monitor``."""
    return trainer_flavour(trainer).BalanceCallback(monitor)  # the trainer's package's Callback


def attach_monitor(
    strategy: Any, trainer: Any, settings: MonitorSettings, monitor: BalanceMonitor | None = None
) -> BalanceMonitor | None:
    """Build (or reset) the strategy's :class:`BalanceMonitor` for a new ``fit`` and hook it into ``trainer``."""
    if strategy.world_size < 2:
        settings = replace(settings, record=False)
    if not settings.active:
        return None
    if monitor is None or monitor.settings != settings:
        monitor = BalanceMonitor(strategy, settings)
    monitor.reset()
    callbacks = trainer.callbacks
    for i, cb in enumerate(callbacks):
        if isinstance(cb, BalanceCallbackMixin):
            callbacks[i] = monitor_callback(monitor, trainer)
            break
    else:
        callbacks.append(monitor_callback(monitor, trainer))
    return monitor
