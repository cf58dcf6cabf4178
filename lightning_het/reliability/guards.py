"""The reliability parts of one Trainer replica, called from the strategy's hooks: watchdog, preemption handler,
emergency checkpoint and ``resume="auto"`` (``docs/reliability.md``)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from lightning_het.reliability.checkpointing import CHECKPOINT_KEY
from lightning_het.reliability.emergency import (
    EMERGENCY_CHECKPOINT_NAME,
    EmergencyCheckpoint,
    LoopRecord,
    StepState,
    rng_state,
)
from lightning_het.reliability.preemption import (
    PreemptionHandler,
    attach_preemption,
    detach_preemption,
    preemption_path,
)
from lightning_het.reliability.resume import Candidate, auto_resume, retire_emergencies
from lightning_het.reliability.verdicts import Phase
from lightning_het.reliability.watchdog import Watchdog, attach_watchdog, start_watchdog, stop_watchdog


class Guards:
    """This replica's watchdog (from ``setup_environment`` to the end of the run), preemption handler and emergency
    checkpoint (one fit each); ``None`` where they do not apply (one replica, outside ``fit``)."""

    def __init__(self) -> None:
        self.watchdog: Watchdog | None = None
        self.preemption: PreemptionHandler | None = None
        self.emergency: EmergencyCheckpoint | None = None
        self.job: dict[str, Any] | None = None  # this fit's identity, written into every checkpoint
        self._emergencies: list[Candidate] = []  # this job's emergency checkpoints, retired when the fit ends
        self._capture: tuple[int, StepState, list[dict[str, Any]]] | None = None  # an emergency checkpoint being built
        self._loops: LoopRecord | None = None  # the fit loop's record of this fit

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (a spawn launch, a pickled Trainer): the running parts stay in their process."""
        return {"watchdog": None, "preemption": None, "emergency": None, "_capture": None, "_loops": None}

    def start(self, strategy: Any, timeout: timedelta | float | None, trainer: Any) -> None:
        """Start watching this replica (a multi-replica job with a ``timeout``), in phase ``SETUP``."""
        self.watchdog = start_watchdog(strategy, timeout, trainer)

    def resume(self, trainer: Any, config: Any, job: dict[str, Any], broadcast: Callable[[Any], Any]) -> bool:
        """``resume="auto"`` (``job``: this fit's identity): load this job's checkpoint with the most progress."""
        self.job = job
        path = preemption_path(trainer, config.preemption_checkpoint)
        before = trainer.ckpt_path
        self._emergencies = auto_resume(trainer, config.resume, path, job, config.global_batch_size, broadcast)
        return trainer.ckpt_path != before

    def finish(self, trainer: Any) -> None:
        """A fit that reached its end replaces this job's earlier emergency checkpoints with its state (every rank)."""
        emergencies, self._emergencies = self._emergencies, []
        retire_emergencies(trainer, emergencies)

    def attach(self, strategy: Any, trainer: Any, config: Any, record: Callable[[], dict], saves: bool) -> None:
        """Give ``trainer`` the watchdog's and preemption handler's callbacks and (``saves``) an emergency checkpoint
        beside the preemption checkpoint; ``record``: the strategy's checkpoint record now."""
        attach_watchdog(self.watchdog, trainer)
        self.preemption = attach_preemption(strategy, trainer, config.preemption_grace, config.preemption_checkpoint)
        self.emergency = None
        if self.watchdog is None:
            return
        self.watchdog.emergency = None
        if saves:
            folder = os.path.dirname(preemption_path(trainer, config.preemption_checkpoint))
            path = os.path.join(folder, EMERGENCY_CHECKPOINT_NAME)

            self._loops = loops = LoopRecord(trainer.fit_loop)

            def observe() -> StepState:
                state = loops.take()
                return StepState(trainer.global_step, trainer.current_epoch, state, record(), rng_state(numpy=False))

            dump = lambda state: self._dump(trainer, state)  # noqa: E731
            self.emergency = EmergencyCheckpoint(trainer.global_rank, observe, dump, lambda: path)
            self.watchdog.emergency = self.emergency

    def _dump(self, trainer: Any, state: StepState) -> dict[str, Any]:
        """The checkpoint of ``state``: what ``trainer.save_checkpoint`` builds now, kept by :meth:`captured`."""
        kept: list[dict[str, Any]] = []
        self._capture = (threading.get_ident(), state, kept)
        try:
            trainer.save_checkpoint(EMERGENCY_CHECKPOINT_NAME)
        finally:
            self._capture = None
        return kept[0]

    def capturing(self) -> bool:
        """Whether this thread builds an emergency checkpoint (no file written, no barrier: the others are gone)."""
        capture = self._capture
        return capture is not None and capture[0] == threading.get_ident()

    def captured(self, checkpoint: dict[str, Any]) -> bool:
        """The strategy's ``save_checkpoint``: keep ``checkpoint`` with the step's state if :meth:`capturing`."""
        if not self.capturing():
            return False
        assert self._capture is not None
        _, state, kept = self._capture
        checkpoint.update(epoch=state.epoch, global_step=state.step)  # the tensors: unchanged since the step
        checkpoint["loops"]["fit_loop"] = self._loops.state_dict(state.loops)
        checkpoint[CHECKPOINT_KEY] = {**state.record, "rng": {**rng_state(), **state.rng}}  # NumPy's: as of now
        kept.append(checkpoint)
        return True

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
        """At teardown: give the signals back; stop the watchdog after an exception or without a launcher that waits
        for every replica's end, else keep it watching the end-of-run hooks."""
        if interrupted or not launcher_finishes:
            stop_watchdog(self.release_watchdog(), trainer, finished=not interrupted)
        elif self.watchdog is not None:
            self.watchdog.mark(Phase.TEARDOWN)
        detach_preemption(self.preemption, trainer)
        self.preemption = None
