"""Preemption: on SIGTERM (or SLURM's ``--signal``), save a resumable checkpoint and end every replica with 143."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_het._compat import should_accumulate
from lightning_het._flavour import trainer_flavour
from lightning_het.config import DEFAULT_GRACE
from lightning_het.reliability.launch import ExitCleanup
from lightning_het.reliability.watchdog import die_with_parent, end_children, exit_job

PREEMPTION_EXIT_CODE = 128 + signal.SIGTERM  # what a shell reports for a process ended by SIGTERM
# signals treated as a preemption notice (plus a SLURM environment's ``requeue_signal``)
PREEMPTION_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGUSR1)
AGREE_EVERY_S = 0.25  # seconds of training between two agreements (at least one step, the same steps on every rank)
AGREE_MAX_STEPS = 64  # the most optimizer steps between two agreements


class PreemptedMixin:
    """Raised on every replica after the preemption checkpoint is written; ends the process with status 143."""

    def __init__(self, checkpoint: str | None, signals: Sequence[int]) -> None:
        super().__init__(PREEMPTION_EXIT_CODE)
        self.checkpoint, self.signals = checkpoint, list(signals)


class Preempted(PreemptedMixin, SIGTERMException):
    """Raised on every replica after the preemption checkpoint is written; ends the process with status 143."""


def _signal_name(signum: int) -> str:
    return next((s.name for s in signal.Signals if s == signum), f"signal {signum}")


class PreemptionHandler:
    """One replica's signal notice, deadline and step-boundary agreement; the Trainer's signal connector."""

    received_sigterm = False

    def __init__(
        self,
        grace: float = DEFAULT_GRACE,
        checkpoint: str | None = None,
        *,
        children: Callable[[], Sequence[Any]] = list,
        exit: Callable[[int], None] = exit_job,
    ) -> None:
        self.grace, self._children, self._exit = float(grace), children, exit
        self.checkpoint = checkpoint or None  # where to save (``None``: stop without saving)
        self.rank, self.world_size, self.fitting, self.extra_signals = 0, 1, True, ()
        # the signal this replica received (0: none): set by the pipe reader, and by the Python-level handler only
        self.received = self._handler_saw = 0
        self._signals: tuple[int, ...] = tuple(int(s) for s in PREEMPTION_SIGNALS)
        self._previous: dict[int, Any] = {}  # the signal handlers taken over, and the wakeup fd
        self._previous_wakeup_fd, self._pipe, self._reader, self._deadline = -1, None, None, None  # fds, threads
        self.deadline_at: float | None = None  # when (``time.monotonic()``) the armed deadline ends this process
        self._lock = threading.Lock()
        # the replicas agreed to stop; the optimizer step of the next agreement; (step, time.monotonic()) of the last
        self.preempting, self.next_agreement, self._last_agreement = False, 0, None

    def __deepcopy__(self, memo: dict[int, Any]) -> PreemptionHandler:
        return self  # shared: this process's signal handlers and threads

    def __getstate__(self) -> dict[str, Any]:
        return {}  # a pickled Trainer: the live handler stays in its process

    def register_signal_handlers(self) -> None:
        """The signal connector's: take over the preemption signals (main thread only; a no-op elsewhere)."""
        if self._pipe is not None or threading.current_thread() is not threading.main_thread():
            return
        self._signals = tuple(dict.fromkeys([*(int(s) for s in PREEMPTION_SIGNALS), *map(int, self.extra_signals)]))
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        self._pipe = (read_fd, write_fd)
        for signum in self._signals:
            self._previous[signum] = signal.getsignal(signum)
            signal.signal(signum, self._on_signal)
        self._previous_wakeup_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        name = "lightning-het-preemption"
        self._reader = threading.Thread(target=self._read_pipe, args=(read_fd,), name=name, daemon=True)
        self._reader.start()

    def teardown(self) -> None:
        """The signal connector's: give the signals back (main thread); an armed deadline keeps running."""
        if self._pipe is None or threading.current_thread() is not threading.main_thread():
            return
        with contextlib.suppress(ValueError):
            signal.set_wakeup_fd(self._previous_wakeup_fd)
        for signum, handler in self._previous.items():
            with contextlib.suppress(TypeError, ValueError):
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()
        read_fd, write_fd = self._pipe
        with contextlib.suppress(OSError):
            os.write(write_fd, b"\0")  # wakes the reader, which then ends
        if self._reader is not None:
            self._reader.join(timeout=1.0)
        self._pipe = None
        for fd in (read_fd, write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)

    def close(self) -> None:
        """End of a run: give the signals back; if preempting, wait for the launched replicas, then kill them."""
        self.teardown()
        if self.preempting:
            at = self.deadline_at
            end_children(self._children(), self.grace if at is None else max(at - time.monotonic() - 1.0, 0.0))

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._handler_saw = signum  # main thread, between bytecodes: the pipe reader does the rest

    def _read_pipe(self, read_fd: int) -> None:  # the one writer of `received`
        with contextlib.suppress(OSError):
            while (data := os.read(read_fd, 64)) and 0 not in data:
                for signum in (s for s in data if s in self._signals and not self.received):
                    self.received = signum  # outside fit there is nothing to save: end now
                    self.arm_deadline(self.grace if self.fitting else 0.0, f"received {_signal_name(signum)}")

    def arm_deadline(self, seconds: float, reason: str) -> None:
        """End this process (status 143) ``seconds`` from now unless it ends first; the earliest deadline wins."""
        at = time.monotonic() + seconds
        with self._lock:
            if self.deadline_at is not None and self.deadline_at <= at:
                return
            self.deadline_at = at
            if self._deadline is None:  # else the running thread re-reads `deadline_at`
                name = "lightning-het-preemption-deadline"
                self._deadline = threading.Thread(target=self._await_deadline, args=(reason,), name=name, daemon=True)
                self._deadline.start()

    def _await_deadline(self, reason: str) -> None:
        while (left := self.deadline_at - time.monotonic()) > 0:  # type: ignore[operator]
            time.sleep(min(left, 0.2))
        late = f"and did not end within preemption_grace={self.grace:g} s" if self.fitting else "outside fit"
        message = f"this replica {reason} {late}; ending it now with exit status {PREEMPTION_EXIT_CODE}."
        print(f"[rank {self.rank}] lightning_het preemption: {message}", file=sys.stderr, flush=True)
        self._exit(PREEMPTION_EXIT_CODE)  # SIGKILLs the launched replicas and loader workers (they ignore SIGTERM)

    def agree(self, device: torch.device, step: int = 0) -> list[int]:
        """Which replica received which signal (0: none), all-reduced if optimizer ``step`` is due, else all zeros."""
        local = [0] * (self.world_size + 1)
        local[self.rank] = int(self.received or self._handler_saw)
        if self.world_size < 2 or not (dist.is_available() and dist.is_initialized()):
            return local[:-1]
        if step < self.next_agreement:
            return [0] * self.world_size
        now, last = time.monotonic(), self._last_agreement
        local[-1] = -1
        if last is not None and step > last[0]:
            per_step = (now - last[1]) / (step - last[0])
            local[-1] = -min(max(int(AGREE_EVERY_S / max(per_step, 1e-6)), 1), AGREE_MAX_STEPS)
        flags = torch.tensor(local, dtype=torch.int32, device=device if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # the last entry: minus the fewest steps any replica asks for
        agreed = [int(v) for v in flags.tolist()]
        self.next_agreement, self._last_agreement = step - agreed[-1], (step, now)
        return agreed[:-1]

    def preempt(self, trainer: pl.Trainer, signals: Sequence[int]) -> PreemptedMixin:
        """Save the checkpoint (all ranks take part, rank 0 writes) and return the exception to raise."""
        self.preempting = True
        self.arm_deadline(self.grace, "was preempted")
        ExitCleanup.exit_code = PREEMPTION_EXIT_CODE  # once the exit handlers ran: no interpreter finalisation
        started, path, saved = time.monotonic(), self.checkpoint, None
        try:
            if path is not None:  # a local file: into ``path + ".tmp"`` (all ranks), then rank 0 renames it
                trainer.save_checkpoint(path if "://" in path else f"{path}.tmp")
                if trainer.is_global_zero and "://" not in path:
                    os.replace(f"{path}.tmp", path)
                saved = path
        finally:
            if self.rank == 0:
                who, names = [r for r, s in enumerate(signals) if s], sorted({_signal_name(s) for s in signals if s})
                done, resume = "saved no checkpoint (preemption_checkpoint=False)", ""
                if path is not None:
                    done = f"saved {saved}" if saved else "could NOT save a checkpoint"
                    resume = f" Resume with trainer.fit(..., ckpt_path={saved or path!r})."
                message = (
                    f"replica(s) {who} received {'/'.join(names)}; all {self.world_size} replica(s) stopped after"
                    f" global step {trainer.global_step} (epoch {trainer.current_epoch}); {done} in"
                    f" {time.monotonic() - started:.2f} s; exiting with status {PREEMPTION_EXIT_CODE}.{resume}"
                )
                print(f"lightning_het preemption: {message}", file=sys.stderr, flush=True)
        return trainer_flavour(trainer).Preempted(saved, signals)  # the trainer's package's SIGTERMException


def preemption_path(trainer: pl.Trainer, checkpoint: Any = None) -> str:
    """Where the preemption checkpoint goes for the strategy's ``preemption_checkpoint`` (``False``: where it would)."""
    if checkpoint is None or checkpoint is False:
        model_checkpoint = trainer_flavour(trainer).ModelCheckpoint  # the trainer's package's
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, model_checkpoint) and callback.dirpath:
                return os.path.join(callback.dirpath, callback.CHECKPOINT_NAME_LAST + callback.FILE_EXTENSION)
        return os.path.join(trainer.default_root_dir, "checkpoints", "last.ckpt")
    path = os.fspath(checkpoint)
    return os.path.join(path, "last.ckpt") if os.path.isdir(path) or path.endswith(("/", os.sep)) else path


class PreemptionCallbackMixin:
    """Runs the agreement after optimizer steps (mixed into each package's ``Callback``)."""

    def __init__(self, handler: PreemptionHandler) -> None:
        self.handler: PreemptionHandler | None = handler

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "handler": None}  # pickled: the live handler stays in its process

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        handler = self.handler  # the cheap test first: most steps are between agreements
        if handler is None or trainer.global_step < handler.next_agreement or should_accumulate(trainer):
            return  # accumulating: the gradients of this batch wait for the next ones, not a place to stop
        signals = handler.agree(pl_module.device, trainer.global_step)
        if any(signals):
            raise handler.preempt(trainer, signals)


class PreemptionCallback(PreemptionCallbackMixin, Callback):
    """Runs the agreement after optimizer steps; added to the Trainer by the strategy (after its callbacks)."""


def _shielded_init(inner: Callable[[int], Any] | None, rank: int, signals: Sequence[int], worker_id: int) -> None:
    """``worker_init_fn``: ignore the preemption signals, die with the replica, then run the original ``inner``."""
    die_with_parent()  # a worker stuck in __getitem__ never reaches torch's own parent check
    for signum in signals:
        signal.signal(signum, signal.SIG_IGN)  # the worker ends with its replica (torch watches the parent)
    with contextlib.suppress(ValueError):
        signal.set_wakeup_fd(-1)  # a forked worker inherits the replica's wakeup pipe
    if inner is not None:
        inner(worker_id)
    elif int(os.environ.get("PL_SEED_WORKERS", 0)):
        from lightning.fabric.utilities.seed import pl_worker_init_function

        pl_worker_init_function(worker_id, rank=rank)


def shield_loader_workers(dataloader: object, rank: int, signals: Sequence[int] = PREEMPTION_SIGNALS) -> object:
    """Make ``dataloader``'s workers ignore the preemption signals and die with their replica; return it."""
    if getattr(dataloader, "num_workers", 0) and hasattr(dataloader, "worker_init_fn"):
        current = dataloader.worker_init_fn
        if getattr(current, "func", None) is not _shielded_init:
            shielded = functools.partial(_shielded_init, current, rank, tuple(int(s) for s in signals))
            dataloader.worker_init_fn = shielded
    return dataloader
