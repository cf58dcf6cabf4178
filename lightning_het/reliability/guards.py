"""The reliability parts of one Trainer replica: its watchdog, preemption handler and emergency checkpoint.

The Trainer strategy owns one :class:`Guards` and calls it from its hooks; each method is one hook's share of the work
(``docs/reliability.md`` tells the story, ``docs/architecture.md`` the order).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

from lightning_het.reliability.emergency import EmergencyCheckpoint, attach_emergency
from lightning_het.reliability.preemption import (
    PreemptionHandler,
    attach_preemption,
    detach_preemption,
    preemption_path,
)
from lightning_het.reliability.resume import Candidate, auto_resume, retire_emergencies
from lightning_het.reliability.supervision import LaunchingReplicas, attach_watchdog, start_watchdog, stop_watchdog
from lightning_het.reliability.verdicts import Phase
from lightning_het.reliability.watchdog import Watchdog


class Guards:
    """The watchdog (from ``setup_environment`` to the end of the run), the preemption handler and the emergency
    checkpoint (one fit each) of this replica; ``None`` where they do not apply (one replica, outside ``fit``)."""

    def __init__(self) -> None:
        self.watchdog: Watchdog | None = None
        self.preemption: PreemptionHandler | None = None
        self.emergency: EmergencyCheckpoint | None = None
        self.job: dict[str, Any] | None = None  # this fit's identity, written into every checkpoint
        self._emergencies: list[Candidate] = []  # this job's emergency checkpoints, retired when the fit ends

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (a spawn launch, a pickled Trainer): the running parts stay in their process."""
        return {"watchdog": None, "preemption": None, "emergency": None}

    def start(self, replicas: LaunchingReplicas, timeout: timedelta | float | None, trainer: Any) -> None:
        """Start watching this replica (a multi-replica job with a ``timeout``), in phase ``SETUP``."""
        self.watchdog = start_watchdog(replicas, timeout, trainer)

    def resume(self, trainer: Any, config: Any, job: dict[str, Any], broadcast: Callable[[Any], Any]) -> bool:
        """Once the optimizers exist (``job``: this fit's identity): ``resume="auto"`` loads into ``trainer`` the
        checkpoint of this job with the most progress in the run directory; whether it loaded one."""
        self.job = job
        path = preemption_path(trainer, config.preemption_checkpoint)
        before = trainer.ckpt_path
        self._emergencies = auto_resume(trainer, config.resume, path, job, config.global_batch_size, broadcast)
        return trainer.ckpt_path != before

    def finish(self, trainer: Any) -> None:
        """At the end of training: a fit that reached its end replaces this job's earlier emergency checkpoints with
        its finished state (every rank)."""
        emergencies, self._emergencies = self._emergencies, []
        retire_emergencies(trainer, emergencies)

    def attach(
        self, strategy: Any, trainer: Any, config: Any, record: Callable[[], dict], saves: bool
    ) -> None:
        """Give ``trainer`` the watchdog's and the preemption handler's callbacks, and (``saves``) an emergency
        checkpoint beside the preemption checkpoint; ``record``: the strategy's checkpoint record now."""
        attach_watchdog(self.watchdog, trainer)
        self.preemption = attach_preemption(strategy, trainer, config.preemption_grace, config.preemption_checkpoint)
        path = preemption_path(trainer, config.preemption_checkpoint)
        self.emergency = attach_emergency(self.watchdog, trainer, trainer.global_rank, record, path, saves)

    def optimizer_step(self, step: Callable[[Callable[[], Any]], Any], closure: Callable[[], Any], trainer: Any) -> Any:
        """``step(closure)``, with the parameter update under the emergency checkpoint's lock while one can save."""
        if self.emergency is None or trainer is None:
            return step(closure)
        with self.emergency.update(closure, trainer.global_step + 1) as locked:
            return step(locked)

    def release_watchdog(self) -> Watchdog | None:
        """Hand the running watchdog over (to the launcher's end-of-run barrier, which stops it)."""
        watchdog, self.watchdog = self.watchdog, None
        return watchdog

    def end(self, trainer: Any, interrupted: bool, launcher_finishes: bool) -> None:
        """At teardown: give the signals back; after an exception (or without a launcher that waits for every
        replica's end) stop the watchdog, else keep it watching the end-of-run hooks."""
        if interrupted or not launcher_finishes:
            stop_watchdog(self.release_watchdog(), trainer, finished=not interrupted)
        elif self.watchdog is not None:
            self.watchdog.mark(Phase.TEARDOWN)
        detach_preemption(self.preemption, trainer)
        self.preemption = None
