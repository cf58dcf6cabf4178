"""One replica's reliability parts (:class:`Guards`) and the emergency checkpoint of a watchdog verdict's survivors."""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import socket
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_het._compat import _get_default_store, replace_signal_connector, restore_checkpoint, should_accumulate
from lightning_het._flavour import trainer_flavour
from lightning_het.cluster.rendezvous import TOKEN_ENV, agree_on_token
from lightning_het.reliability.checkpointing import (
    CHECKPOINT_KEY,
    EMERGENCY_CHECKPOINT_NAME,
    Candidate,
    at_position,
    checkpoint_candidates,
    choose_checkpoint,
    identity_differences,
    read_candidate,
    wants_resume,
)
from lightning_het.reliability.launch import PreemptionCallbackMixin, PreemptionHandler, preemption_path
from lightning_het.reliability.watchdog import BOOT_ID, Phase, Watchdog, WatchdogCallbackMixin, as_seconds

_KEYS = "emergency/"  # + the job's tag: a store kept across elastic restarts holds the keys of earlier attempts
_POLL_S = 0.02
_generation = itertools.count()  # one key space per watchdog started in this process (same order on every rank)


def rng_state() -> dict[str, Any]:
    """The CPU RNG states (torch, Python, NumPy) as ``torch.load(weights_only=True)`` reads."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    numpy = [name, keys.tolist(), int(pos), int(has_gauss), float(gauss)]
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": numpy}


def restore_rng(state: dict[str, Any] | None) -> None:
    """Put back what :func:`rng_state` recorded (``None``: nothing recorded)."""
    if not state:
        return
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


class LoopRecord:
    """A Lightning loop's ``state_dict()`` taken in microseconds (copies of its counters) and built when needed."""

    def __init__(self, loop: Any) -> None:
        self.loops: list[tuple[str, Any]] = []  # (key prefix, loop)
        self._empty_in: int | None = None  # the epoch in which the fit loop's own state is empty (no stateful loader)
        self.parts: list[tuple[str, str, Any]] = []  # (parent key, name, dataclass): progress trackers and their parts
        self._walk(loop, "")
        self._values = [vars(part) for *_, part in self.parts]  # the trackers' counters, copied at every step
        # asked at every step: the inner loops whose class overrides the base loop's `on_save_checkpoint` (`{}`)
        self._own = [x for _, x in self.loops[1:] if sum("on_save_checkpoint" in vars(c) for c in type(x).__mro__) > 1]

    def _walk(self, loop: Any, prefix: str) -> None:
        self.loops.append((prefix, loop))
        for key, value in vars(loop).items():
            if hasattr(value, "__dataclass_fields__") and hasattr(value, "load_state_dict"):  # a progress tracker
                self._part("", prefix + key, value)
            elif hasattr(value, "restarting") and hasattr(value, "on_save_checkpoint"):  # a loop
                self._walk(value, f"{prefix}{key}.")

    def _part(self, parent: str, name: str, value: Any) -> None:
        self.parts.append((parent, name, value))
        for field, inner in vars(value).items():
            if hasattr(inner, "__dataclass_fields__"):
                self._part(f"{parent}/{name}", field, inner)

    def take(self, epoch: int | None = None) -> tuple[list[Any], list[dict[str, Any]]]:
        """The loops' own states and copies of the counters now (training thread); after a training batch of
        ``epoch``, the fit loop's own only once an epoch when it has none (its loaders' states: ~10 us a step)."""
        own = {} if epoch is not None and self._empty_in == epoch else self.loops[0][1].on_save_checkpoint()
        self._empty_in = None if own or epoch is None else epoch
        return [own, *[loop.on_save_checkpoint() for loop in self._own]], list(map(dict.copy, self._values))

    def state_dict(self, taken: tuple[list[Any], list[dict[str, Any]]]) -> dict[str, Any]:
        """The loop's ``state_dict()`` at the time of :meth:`take`."""
        (own, *asked), copies = taken
        found = {id(loop): state for loop, state in zip(self._own, asked)} | {id(self.loops[0][1]): own}
        out = {prefix + "state_dict": found.get(id(loop), {}) for prefix, loop in self.loops}
        built: dict[str, dict[str, Any]] = {"": out}
        for (parent, name, _), values in zip(self.parts, copies):
            built[parent][name] = built[f"{parent}/{name}"] = dict(values)
        return out


class StepState(NamedTuple):
    """What a checkpoint at the end of optimizer ``step`` holds besides the tensors."""

    step: int
    epoch: int
    loops: Any
    record: dict[str, Any]
    rng: torch.Tensor  # torch's CPU generator's state


def agreed_writer(steps: dict[int, int]) -> tuple[int, int | None]:
    """From each survivor's last completed step (-1: unknown), the agreed (smallest) step and its lowest holder."""
    step = min(steps.values(), default=-1)
    if step < 0:
        return -1, None
    return step, min(rank for rank, s in steps.items() if s == step)


class EmergencyCheckpoint:
    """One replica's side of the emergency save: ``observe`` gives the step's state, ``dump`` its checkpoint."""

    def __init__(
        self,
        rank: int,
        observe: Callable[[], StepState],
        dump: Callable[[StepState], dict[str, Any]],
        path: Callable[[], str],
    ) -> None:
        self.rank, self._observe, self._dump, self._path = rank, observe, dump, path
        self._lock = threading.RLock()  # held by a parameter update, and by a save from settling to the end
        self._updated = -1  # optimizer steps completed by the last update (written under the lock)
        self.state: StepState | None = None
        self.saved: str | None = None
        self._claim, self._finished = threading.Lock(), threading.Event()

    def __deepcopy__(self, memo: dict[int, Any]) -> EmergencyCheckpoint:
        return self  # shared: the lock that orders this process's parameter updates and saves

    def update(self, step: Callable[[Callable[[], Any]], Any], closure: Callable[[], Any], step_after: int) -> Any:
        """``step(closure)``, the parameter update (once the closure returned) under the lock; it is ``step_after``."""
        held = False

        def locked() -> Any:
            nonlocal held
            result = closure()
            if not held:
                self._lock.acquire()
                held = True
            return result

        try:
            output = step(locked)
            if held:
                self._updated = step_after
            return output
        finally:
            if held:
                self._lock.release()

    def step_ended(self) -> None:
        """The end of an optimizer step (training thread): keep its :class:`StepState`."""
        self.state = self._observe()

    def _settle(self, deadline: float) -> tuple[int, bool]:
        """Hold the lock with the last step's state complete: (its step or -1, whether the lock is held)."""
        while True:
            if self._lock.acquire(timeout=max(deadline - time.monotonic(), 0.0)):
                state = self.state
                if state is not None and state.step == self._updated:
                    return state.step, True
                self._lock.release()
                if state is None and self._updated < 0:  # no step of this fit completed: nothing to save
                    return -1, False
            if time.monotonic() >= deadline:
                return -1, False
            time.sleep(_POLL_S)

    def save(self, store: Any, survivors: Sequence[int], agree_s: float, write_s: float, tag: str = "") -> str | None:
        """Agree with ``survivors`` through ``store`` and let the writer save; the checkpoint's path or ``None``."""
        if not self._claim.acquire(blocking=False):
            self._finished.wait(agree_s + write_s)
            return self.saved
        held = False
        try:
            deadline = time.monotonic() + agree_s
            step, held = self._settle(deadline)
            keys = f"{_KEYS}{tag}/"
            store.set(f"{keys}step/{self.rank}", str(step))
            steps = {r: int(v) for r, v in _read(store, f"{keys}step/", survivors, deadline).items()}
            _, writer = agreed_writer(steps)
            if writer == self.rank and self.state is not None:
                self.saved = self._write(self.state, steps)
                store.set(f"{keys}path", self.saved or "")
            elif writer is not None:
                self.saved = _read(store, keys, ["path"], time.monotonic() + write_s).get("path") or None
            elif any(s >= 0 for s in steps.values()):
                _say(f"no emergency checkpoint: a survivor could not tell its last completed step ({steps})")
            return self.saved
        finally:
            if held:
                self._lock.release()
            self._finished.set()

    def _write(self, state: StepState, steps: dict[int, int]) -> str | None:
        started, path = time.monotonic(), self._path()
        tmp = f"{path}.tmp"
        try:
            checkpoint = self._dump(state)
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            torch.save(checkpoint, tmp)  # no fsync: it can take seconds on a busy disk, and the job waits for it
            os.replace(tmp, path)
        except Exception as err:  # a failed save falls back to the last periodic checkpoint
            _say(f"could NOT write the emergency checkpoint {path}: {type(err).__name__}: {err}")
            with contextlib.suppress(OSError):
                os.remove(tmp)
            return None
        _say(
            f"emergency checkpoint of global step {state.step} (epoch {state.epoch}), the last step every survivor"
            f" {sorted(steps)} completed, saved to {path} by rank {self.rank} in {time.monotonic() - started:.2f} s."
            f" Resume: run the same command with the strategy's resume='auto' (or trainer.fit(..., ckpt_path={path!r}))"
        )
        return path


def _read(store: Any, prefix: str, names: Sequence[Any], deadline: float) -> dict[Any, str]:
    """The values under ``prefix + name`` published by ``deadline`` (polled: a timed-out ``store.wait`` desyncs)."""
    found: dict[Any, str] = {}
    while True:
        for name in names:
            if name not in found and store.check([f"{prefix}{name}"]):
                found[name] = store.get(f"{prefix}{name}").decode()
        if len(found) == len(names) or time.monotonic() >= deadline:
            return found
        time.sleep(_POLL_S)


def _say(message: str) -> None:
    print(f"lightning_het watchdog: {message}", file=sys.stderr, flush=True)


def _replace_callback(trainer: Any, mixin: type, callback: Any) -> None:
    """``trainer``'s callbacks without those of class ``mixin``, plus ``callback`` (if any)."""
    kept = [cb for cb in trainer.callbacks if not isinstance(cb, mixin)]
    trainer.callbacks[:] = [*kept, callback] if callback else kept


class Guards:
    """This replica's watchdog (setup to the end of the run), preemption handler and emergency checkpoint (per fit)."""

    def __init__(self) -> None:
        self.watchdog: Watchdog | None = None
        self.preemption: PreemptionHandler | None = None
        self.emergency: EmergencyCheckpoint | None = None
        self.job: dict[str, Any] | None = None  # this fit's identity, written into every checkpoint
        self._emergencies: list[Candidate] = []  # this job's emergency checkpoints, retired when the fit ends
        self._capture: tuple[int, StepState, list[dict[str, Any]]] | None = None  # an emergency checkpoint being built
        self._loops: LoopRecord | None = None  # the fit loop's record of this fit

    def __getstate__(self) -> dict[str, Any]:  # pickled (spawn): the running parts stay in their process
        return {"watchdog": None, "preemption": None, "emergency": None, "_capture": None, "_loops": None}

    def start(self, strategy: Any, timeout: timedelta | float | None, trainer: Any) -> None:
        """Start a :class:`Watchdog` (multi-replica jobs with a ``timeout``), in phase ``SETUP``."""
        seconds, self.watchdog = as_seconds(timeout), None
        if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2 or not seconds:
            return
        token = agree_on_token(os.environ.get(TOKEN_ENV, ""))
        base = _get_default_store()  # torchrun's agent store outlives rank 0
        namespace = f"lightning_het/watchdog/{next(_generation)}/"
        store = dist.PrefixStore(namespace, base.clone() if hasattr(base, "clone") else base)
        rank, world_size = dist.get_rank(), dist.get_world_size()
        peers: list[Any] = [None] * world_size
        dist.all_gather_object(peers, (socket.gethostname(), BOOT_ID, os.getpid()))  # not through the store
        children = getattr(strategy.launcher, "children", list)  # the local replicas a popen launcher started
        hosts_store = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true"
        self.watchdog = Watchdog(store, rank, world_size, seconds, hosts_store=hosts_store, children=children,
                                 token=token, namespace=namespace, peers=dict(enumerate(peers)))  # fmt: skip
        self.watchdog.start()
        if trainer is not None:
            _replace_callback(trainer, WatchdogCallbackMixin, trainer_flavour(trainer).WatchdogCallback(self.watchdog))

    def resume(self, trainer: Any, config: Any, job: dict[str, Any], broadcast: Callable[[Any], Any]) -> bool:
        """``resume="auto"`` (every rank): load the checkpoint rank 0 chooses for this fit's identity ``job``."""
        self.job, self._emergencies = job, []
        if trainer.ckpt_path is not None or not wants_resume(config.reliability.resume):
            return False
        decision: tuple[str | None, list[Candidate]] = (None, [])
        if trainer.global_rank == 0:
            dirpaths = [getattr(callback, "dirpath", None) for callback in trainer.checkpoint_callbacks]
            found = checkpoint_candidates(preemption_path(trainer, config.reliability.preemption_checkpoint), dirpaths)
            candidates = [read_candidate(path) for path in found]
            chosen, lines = choose_checkpoint(candidates, job, config.global_batch_size)
            for line in lines:
                warnings.warn(f"HeterogeneousStrategy: {line}", UserWarning, stacklevel=2)
            emergencies = [c for c in candidates if os.path.basename(c.path) == EMERGENCY_CHECKPOINT_NAME
                           and c.error is None and not identity_differences(c.job, job)]  # fmt: skip
            decision = (chosen, emergencies)
        path, self._emergencies = broadcast(decision)
        if path is not None:
            rank_zero_info(f"HeterogeneousStrategy: resume='auto': resuming from {path}")
            restore_checkpoint(trainer, path)
        return path is not None

    def finish(self, trainer: Any) -> None:
        """A fit that reached its end (every rank): this job's earlier emergency checkpoints now hold its state."""
        emergencies, self._emergencies = self._emergencies, []
        max_steps, max_epochs, step = trainer.max_steps, trainer.max_epochs, trainer.global_step
        ended = max_steps is not None and 0 <= max_steps <= step
        if not ended and not (max_epochs is not None and 0 <= max_epochs <= trainer.current_epoch):
            return
        for emergency in emergencies:
            if step > emergency.step:
                trainer.save_checkpoint(emergency.path)
                rank_zero_info(
                    f"HeterogeneousStrategy: the emergency checkpoint {emergency.path} (global step {emergency.step})"
                    f" now holds the finished fit (global step {step})"
                )

    def attach(self, strategy: Any, trainer: Any, config: Any, record: Callable, saves: bool, after: Callable) -> None:
        """The watchdog's and preemption handler's callbacks and signals, and (``saves``) the emergency checkpoint
        (``record``: the checkpoint entry, its sampler's place left to the save); ``after(trainer, batch_idx)``: the
        strategy's other work at a training batch's end, run by the preemption callback after its agreement."""
        flavour, checkpoint = trainer_flavour(trainer), config.reliability.preemption_checkpoint  # its package's
        watchdog, path = self.watchdog, preemption_path(trainer, checkpoint)
        _replace_callback(trainer, WatchdogCallbackMixin, watchdog and flavour.WatchdogCallback(watchdog))
        children = getattr(strategy.launcher, "children", list)  # the local replicas a popen launcher started
        saves_to = None if checkpoint is False else path  # ``preemption_checkpoint=False``: stop without saving
        self.preemption = handler = PreemptionHandler(config.reliability.preemption_grace, saves_to, children=children)
        handler.rank, handler.world_size = trainer.global_rank, trainer.world_size
        handler.fitting = trainer.state.fn == flavour.TrainerFn.FITTING
        requeue = getattr(strategy.cluster_environment, "requeue_signal", None)
        handler.extra_signals = () if requeue is None else (int(requeue),)
        callback = handler.fitting and flavour.PreemptionCallback(handler, self.batch_ended, after)
        _replace_callback(trainer, PreemptionCallbackMixin, callback)
        replace_signal_connector(trainer, handler)
        self.emergency = None
        if watchdog is not None and saves:
            self._loops = loops = LoopRecord(trainer.fit_loop)

            def observe() -> StepState:  # Python's and NumPy's RNG states (~10 us): as of the save
                epoch = trainer.current_epoch
                rng = torch.default_generator.get_state()
                return StepState(trainer.global_step, epoch, loops.take(epoch), record(), rng)

            dump = lambda state: self._dump(trainer, state)  # noqa: E731
            emergency = os.path.join(os.path.dirname(path), EMERGENCY_CHECKPOINT_NAME)
            self.emergency = EmergencyCheckpoint(trainer.global_rank, observe, dump, lambda: emergency)
        if watchdog is not None:
            watchdog.emergency = self.emergency

    def _dump(self, trainer: Any, state: StepState) -> dict[str, Any]:
        """The checkpoint of ``state``: what ``trainer.save_checkpoint`` builds now (kept by :meth:`captured`)."""
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
        _, state, kept = self._capture  # type: ignore[misc]
        checkpoint.update(epoch=state.epoch, global_step=state.step)  # the tensors: unchanged since the step
        loops = checkpoint["loops"]["fit_loop"] = self._loops.state_dict(state.loops)  # type: ignore[union-attr]
        batches, epochs = (loops[k]["current"]["processed"] for k in ("epoch_loop.batch_progress", "epoch_progress"))
        record = at_position(state.record, batches, epochs)  # the record kept at each step: its epoch's first one
        checkpoint[CHECKPOINT_KEY] = {**record, "rng": {**rng_state(), "torch": state.rng}}  # NumPy's: as of now
        kept.append(checkpoint)
        return True

    def batch_ended(self, trainer: Any, batch_idx: int) -> None:
        """A training batch ended: the watchdog's mark and, after an optimizer step, the emergency record."""
        watchdog = self.watchdog
        if watchdog is not None:
            watchdog.step(Phase.BETWEEN_BATCHES)
            emergency = watchdog.emergency
            if emergency is not None and not should_accumulate(trainer):
                emergency.step_ended()  # what an emergency checkpoint of this step holds besides the tensors

    def mark(self, phase: Phase, batches: int = 0) -> None:
        """The training step's progress, from the strategy's hooks (no callback dispatch), for the watchdog."""
        if self.watchdog is not None:
            self.watchdog.step(phase, batches)

    def optimizer_step(self, step: Callable[[Callable[[], Any]], Any], closure: Callable[[], Any], trainer: Any) -> Any:
        """``step(closure)``, with the parameter update under the emergency checkpoint's lock while one can save."""
        if self.emergency is None or trainer is None:
            return step(closure)
        return self.emergency.update(step, closure, trainer.global_step + 1)

    def stop_watchdog(self, trainer: Any, *, finished: bool) -> None:
        """Stop the watchdog and remove its callback; ``finished``: first wait until every replica finished."""
        watchdog, self.watchdog = self.watchdog, None
        if watchdog is not None:
            watchdog.finish() if finished else watchdog.stop()
            if trainer is not None:
                _replace_callback(trainer, WatchdogCallbackMixin, None)

    def end(self, trainer: Any, interrupted: bool, launcher_finishes: bool) -> None:
        """Teardown: give the signals back; stop the watchdog unless the launcher waits for every replica's end."""
        if interrupted or not launcher_finishes:
            self.stop_watchdog(trainer, finished=not interrupted)
        elif self.watchdog is not None:
            self.watchdog.mark(Phase.TEARDOWN)
        if self.preemption is not None:
            self.preemption.close()
        if trainer is not None:
            _replace_callback(trainer, PreemptionCallbackMixin, None)
        self.preemption = None
