"""Hung- and dead-replica detection: a stalled job ends within ``timeout``, naming the replica(s) that stopped.

Why this exists: on Gloo a replica waiting in a collective for a peer that never arrives raises after ``timeout``,
but the peer itself (stuck in its ``training_step``, its data loader or its device) never does, and Lightning's own
child-process observer lives in the launching process only. The job then neither finishes nor fails: the stuck
process outlives the others and holds the job's output open. On NCCL the waiting ranks abort, with the same effect.

How it works (one :class:`Watchdog` per replica, started by the strategy once the process group exists):

* **Progress markers.** The strategy and a callback it adds to the Trainer record where the main thread is: in setup
  (from the rendezvous on: setup hooks, model wrapping), profiling, in ``training_step``, ``backward`` or the
  optimizer step of training batch ``k``, between batches, loading or running evaluation batch ``i``, done with
  evaluation, or in teardown (:class:`Phase`). Markers are plain attribute writes (no I/O).
* **Heartbeats.** A daemon thread publishes the markers every ``interval`` seconds to a dedicated connection to the
  job's rendezvous store (the TCPStore that ``torch.distributed`` already runs; no new port; every record signed with
  the job token, see :mod:`lightning_het.cluster.rendezvous`), together with whether
  the main thread is inside a ``torch.distributed`` call, and reads every other replica's heartbeat. Ages are
  measured with the reader's own monotonic clock, so clock skew between hosts does not matter.
* **Judgement** (:func:`judge`, a pure function). From the rendezvous to the end of the run, a replica whose main
  thread made no progress for ``timeout`` seconds has *stalled*; a replica whose heartbeat stopped for ``timeout``
  has *gone silent* (process dead or frozen). The replica(s) to blame are the stalled ones furthest *behind*: with
  every replica running the same steps, the one stuck in ``training_step`` of batch ``k`` is behind those waiting
  for it in the all-reduce of ``backward`` of batch ``k``; one stuck loading batch ``k+1`` is behind those in batch
  ``k+1``. A replica inside a ``torch.distributed`` call or done with evaluation is waiting, never blamed.
* **Abort.** The first replica to decide writes one abort record (compare-and-set, so every replica reports the same
  verdict); every watchdog thread that reads it logs ``replica(s) [r] stopped responding for N s ...``, acknowledges,
  and ends its process with ``os._exit(WATCHDOG_EXIT_CODE)`` (``INTERRUPTED_EXIT_CODE`` for Ctrl-C; a thread can end
  a process whose main thread is blocked in a collective; nothing is registered with ``atexit``). The replica
  hosting the store waits (briefly) for the acknowledgements before exiting, and the launching process kills the
  local replicas it started that are still alive.
* **Fast paths.** A replica that raises (a real error, or a collective that timed out or lost its peer) publishes
  the failure from the Trainer's ``on_exception`` hook, so the others end at once instead of at their next
  collective's timeout; the launching process notices a local replica that exited non-zero within one interval.

``timeout`` is the strategy's ``timeout`` (as in ``DDPStrategy``): it must exceed the longest stretch a replica may
spend without a progress marker (the setup hooks, one profiling call, one training step, one evaluation batch, an
epoch-end hook, a checkpoint save, the end-of-run hooks). An exception inside the heartbeat thread that is not a
failing store call is a bug of the watchdog: it is logged once and the thread carries on.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from enum import IntEnum
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from lightning_het._compat import default_store, on_flavour, set_default_group_timeout
from lightning_het.arguments import as_timeout
from lightning_het.cluster.rendezvous import TOKEN_ENV, agree_on_token, key_prefix, sign, verify

__all__ = [
    "WATCHDOG_EXIT_CODE",
    "Phase",
    "ReplicaStatus",
    "Verdict",
    "Watchdog",
    "WatchdogCallback",
    "apply_collective_timeout",
    "as_timeout",
    "is_collective_failure",
    "judge",
    "rendezvous_timeout",
    "start_watchdog",
    "stop_watchdog",
    "validate_launch_environment",
]

log = logging.getLogger(__name__)

#: exit status of a replica ended by the watchdog (as ``timeout(1)`` uses for "timed out").
WATCHDOG_EXIT_CODE = 124
#: exit status of a job interrupted by Ctrl-C (SIGINT), as shells report it (128 + 2).
INTERRUPTED_EXIT_CODE = 130
#: replica states (and verdict kinds) that are an interruption from outside the job, not a failure, with the exit
#: status every replica ends with; everything else ends with :data:`WATCHDOG_EXIT_CODE`.
INTERRUPTION_EXIT_CODES: dict[str, int] = {"interrupted": INTERRUPTED_EXIT_CODE}
_INTERRUPTED_STATES = INTERRUPTION_EXIT_CODES  # the states are the keys
#: a local replica's exit status (or ``-signal``) that tells it was interrupted, with the verdict kind it gets
CHILD_INTERRUPTION_STATUS: dict[int, str] = {INTERRUPTED_EXIT_CODE: "interrupted", -2: "interrupted"}


def exit_code_for(verdict: Verdict) -> int:
    """The exit status of a replica ended by ``verdict``: 130 for Ctrl-C, else 124 (stalled, dead or failed)."""
    return INTERRUPTION_EXIT_CODES.get(verdict.kind, WATCHDOG_EXIT_CODE)


def interruption_of(exception: BaseException) -> str | None:
    """The replica state for an exception that interrupts the job from outside (Ctrl-C), else ``None``."""
    if isinstance(exception, KeyboardInterrupt):
        return "interrupted"
    return None


def is_sigterm_exit(exception: BaseException) -> bool:
    """Whether ``exception`` is a Lightning ``SIGTERMException`` (the job was told to stop, e.g. preempted), from
    ``lightning.pytorch`` or the standalone ``pytorch_lightning``: the two packages have separate classes."""
    return isinstance(exception, SystemExit) and any(
        cls.__name__ == "SIGTERMException" and cls.__module__.endswith(".utilities.exceptions")
        for cls in type(exception).__mro__
    )


#: start-up (rendezvous) timeout used when the strategy's ``timeout`` is shorter; see :func:`relaxed_startup_timeout`.
DEFAULT_STARTUP_TIMEOUT = timedelta(minutes=10)

_PREEMPTED_EXIT_CODE = 143  # lightning_het.reliability.preemption.PREEMPTION_EXIT_CODE (128 + SIGTERM)
_generation = itertools.count()  # one key space per watchdog started in this process (same order on every rank)


class Phase(IntEnum):
    """Where a replica's main thread is. Values increase with progress: through the job's stages, and within one
    training batch ``k``."""

    SETUP = 0  # process group up: setup hooks, model wrapping, checkpoint restore, building loaders
    PROFILING = 1  # timing the training step to measure the replica's speed
    TRAINING_STEP = 2
    BACKWARD = 3
    OPTIMIZER_STEP = 4
    BETWEEN_BATCHES = 5  # after batch k: loading batch k+1, epoch hooks, checkpointing
    EVAL_LOADING = 6  # evaluation after batch k: between evaluation batches
    EVAL_STEP = 7
    EVAL_DONE = 8  # all evaluation batches done; epoch-end metric synchronisation
    TEARDOWN = 9  # the loops are over: teardown and end-of-run hooks, waiting for the others to finish


_PHASE_TEXT = {
    Phase.SETUP: "in setup (setup hooks, model wrapping, data loaders)",
    Phase.PROFILING: "profiling the training step (speed measurement)",
    Phase.TRAINING_STEP: "in training_step",
    Phase.BACKWARD: "in backward (gradient all-reduce)",
    Phase.OPTIMIZER_STEP: "in the optimizer step",
    Phase.BETWEEN_BATCHES: "between training batches (loading data, epoch hooks, checkpointing)",
    Phase.EVAL_LOADING: "loading an evaluation batch",
    Phase.EVAL_STEP: "in an evaluation step",
    Phase.EVAL_DONE: "done with evaluation (synchronising metrics)",
    Phase.TEARDOWN: "in teardown (end-of-run hooks)",
}
_EVAL_STEP_NAMES = {"validate": "validation_step", "sanity_check": "validation_step (sanity check)",
                    "test": "test_step", "predict": "predict_step"}  # fmt: skip
_EVAL_PHASES = (Phase.EVAL_LOADING, Phase.EVAL_STEP)


def describe_phase(phase: Phase, batch: int, eval_stage: str = "", eval_batch: int = -1) -> str:
    """Where a replica is, in words: the phase and the training (or evaluation) batch it concerns.

    Args:
        phase: the phase.
        batch: training batches started so far (1-based index of the current training batch).
        eval_stage: Lightning's running stage during evaluation (``"validate"``, ``"test"``, ...).
        eval_batch: 0-based index of the evaluation batch last started (``-1``: none yet in this loop).
    """
    if phase in (Phase.SETUP, Phase.PROFILING, Phase.TEARDOWN):
        return _PHASE_TEXT[phase]
    if phase in _EVAL_PHASES and eval_stage:
        step = _EVAL_STEP_NAMES.get(eval_stage, f"{eval_stage} step")
        if phase == Phase.EVAL_STEP:
            where = f"in {step} of evaluation batch {eval_batch}"
        else:
            where = f"loading evaluation batch {eval_batch + 1} for {step}"
        return f"{where} (after training batch {batch})" if batch else where
    return f"{_PHASE_TEXT[phase]} of batch {batch}"


@dataclass(frozen=True)
class ReplicaStatus:
    """One replica as seen by an observer (the input of :func:`judge`).

    Args:
        rank: global rank.
        host: host name.
        pid: process id on that host.
        batch: training batches started so far (the same count on every replica in lock-step).
        phase: where the main thread is within that batch.
        armed: whether the replica is inside a training/evaluation loop (only then are stalls judged).
        waiting: whether its main thread is inside a ``torch.distributed`` call.
        state: ``"running"``, ``"finished"`` or ``"failed"``.
        silent_for: seconds since its heartbeat last changed.
        stalled_for: seconds since its main thread last made progress.
        error: for ``"failed"``: the error, one line.
        eval_stage: during evaluation, Lightning's running stage (``"validate"``, ``"test"``, ...).
        eval_batch: during evaluation, the 0-based index of the evaluation batch last started.
    """

    rank: int
    host: str = "?"
    pid: int = 0
    batch: int = 0
    phase: Phase = Phase.BETWEEN_BATCHES
    armed: bool = True
    waiting: bool = False
    state: str = "running"
    silent_for: float = 0.0
    stalled_for: float = 0.0
    error: str = ""
    eval_stage: str = ""
    eval_batch: int = -1

    @property
    def position(self) -> tuple[int, int]:
        """Progress through the lock-step schedule: later batches, then later phases, compare greater."""
        return self.batch, int(self.phase)

    def describe(self) -> str:
        where = describe_phase(self.phase, self.batch, self.eval_stage, self.eval_batch)
        return f"rank {self.rank} on {self.host} (pid {self.pid}): {where}"


@dataclass(frozen=True)
class Verdict:
    """Which replica(s) to blame, and the message every replica prints before ending."""

    kind: str  # "hung", "silent", "exited", "failed" or "lost_store"
    culprits: tuple[int, ...]
    seconds: float
    message: str

    def to_json(self) -> str:
        return json.dumps({"kind": self.kind, "culprits": list(self.culprits), "seconds": self.seconds,
                           "message": self.message})  # fmt: skip

    @classmethod
    def from_json(cls, text: str | bytes) -> Verdict:
        data = json.loads(text)
        return cls(data["kind"], tuple(data["culprits"]), float(data["seconds"]), data["message"])


_HINTS = {
    "interrupted": "the job was interrupted from outside (Ctrl-C); nothing failed.",
    "hung": "look at what the named replica(s) were doing (a stuck device, a deadlocked data loader, a step that"
    " waits on something outside the job); if they were only slow, raise the strategy's `timeout`.",
    "silent": "check the named replica(s)' host: a crash, an out-of-memory kill or a lost network link.",
    "exited": "the named replica(s)' own output shows why they exited.",
    "failed": "the named replica(s)' traceback shows the cause.",
    "lost_store": "check rank 0's output (it hosts the rendezvous store) and the network between the nodes.",
}


def _ranks(statuses: Sequence[ReplicaStatus]) -> list[int]:
    return sorted(s.rank for s in statuses)


def judge(
    statuses: Sequence[ReplicaStatus],
    timeout: float,
    *,
    silence_timeout: float | None = None,
    suspect_after: float | None = None,
) -> Verdict | None:
    """Decide whether the job must end and whom to blame. Pure: the same statuses give the same verdict.

    Rules, in order:

    0. a replica that was interrupted (Ctrl-C): end every replica the same way (not a failure);
    1. a replica that reported a failure: blame it;
    2. a running replica whose heartbeat is older than ``silence_timeout`` (default ``timeout``): its process died or
       froze;
    3. some replica inside a loop made no progress for ``timeout``: the job has stalled. Suspects are the replicas
       without progress for ``suspect_after`` (default ``timeout / 2``; observers see a peer's progress up to one
       heartbeat late) that are not known to be waiting (inside a ``torch.distributed`` call, or done with
       evaluation). Blame the suspects in an evaluation phase (evaluation has no collectives between batches), else
       the suspects furthest behind (:attr:`ReplicaStatus.position`), else the replicas still making progress that the
       others wait for.

    Args:
        statuses: every replica, as the observer sees it.
        timeout: seconds without progress after which the job has stalled.
        silence_timeout: seconds without a heartbeat after which a replica is presumed dead.
        suspect_after: seconds without progress that make a replica a suspect once the job has stalled.

    Returns:
        ``None`` while the job is healthy, else the :class:`Verdict`.
    """
    silence = timeout if silence_timeout is None else silence_timeout
    suspect = timeout / 2 if suspect_after is None else suspect_after
    interrupted = [s for s in statuses if s.state in _INTERRUPTED_STATES]
    if interrupted:
        detail = "; ".join(f"rank {s.rank} on {s.host} (pid {s.pid}): {s.error or s.state}" for s in interrupted)
        kind = interrupted[0].state
        return Verdict(kind, tuple(_ranks(interrupted)), 0.0, f"replica(s) {_ranks(interrupted)} {kind} ({detail})")
    failed = [s for s in statuses if s.state == "failed"]
    if failed:
        detail = "; ".join(f"rank {s.rank} on {s.host} (pid {s.pid}): {s.error or 'error'}" for s in failed)
        return Verdict("failed", tuple(_ranks(failed)), 0.0, f"replica(s) {_ranks(failed)} failed ({detail})")
    running = [s for s in statuses if s.state == "running"]
    silent = [s for s in running if s.silent_for > silence]
    if silent:
        seconds = max(s.silent_for for s in silent)
        detail = "; ".join(f"{s.describe()} when last heard of" for s in silent)
        return Verdict(
            "silent",
            tuple(_ranks(silent)),
            seconds,
            f"replica(s) {_ranks(silent)} stopped responding for {seconds:.1f} s: no heartbeat, the process died or"
            f" froze ({detail})",
        )
    armed = [s for s in running if s.armed]
    if not any(s.stalled_for > timeout for s in armed):
        return None
    seconds = max(s.stalled_for for s in armed)
    waiting = {s.rank for s in running if s.waiting or s.phase == Phase.EVAL_DONE}
    suspects = [s for s in armed if s.stalled_for > suspect and s.rank not in waiting]
    evaluating = [s for s in suspects if s.phase in _EVAL_PHASES]
    if evaluating:
        culprits = evaluating
    elif suspects:
        behind = min(s.position for s in suspects)
        culprits = [s for s in suspects if s.position == behind]
    else:
        culprits = [s for s in running if s.rank not in waiting]
    progressing = bool(culprits) and all(s.stalled_for <= suspect for s in culprits)
    if not culprits:  # everyone waits on everyone: report them all
        culprits = armed
    others = [s for s in running if s not in culprits]
    context = "; ".join(s.describe() for s in culprits)
    if others:
        context += "; the others wait: " + "; ".join(s.describe() for s in others)
    if progressing:
        text = f"kept the other replicas waiting for {seconds:.1f} s"
    else:
        seconds = max(s.stalled_for for s in culprits)
        text = f"stopped responding for {seconds:.1f} s"
    return Verdict("hung", tuple(_ranks(culprits)), seconds, f"replica(s) {_ranks(culprits)} {text} ({context})")


_COLLECTIVE_FAILURE_MARKERS = ("gloo", "nccl", "connection closed by peer", "connection reset by peer")


def is_collective_failure(exception: BaseException) -> bool:
    """Whether ``exception`` is a collective that failed because of a peer (timed out, lost connection).

    Such an error is a symptom on the replica that raises it; the cause is elsewhere, and :class:`Watchdog` names it.
    """
    dist_errors = tuple(getattr(dist, name) for name in ("DistError",) if hasattr(dist, name))
    if dist_errors and isinstance(exception, dist_errors):
        return True
    if not isinstance(exception, RuntimeError):
        return False
    text = str(exception).lower()
    return any(marker in text for marker in _COLLECTIVE_FAILURE_MARKERS)


def _first_line(exception: BaseException, limit: int = 300) -> str:
    """``Type: first line`` of ``exception``, at most about ``limit`` characters; a long message keeps its ``HINT:``
    (what to do), shortening the part before it instead."""
    text = str(exception).strip().splitlines()
    line = f"{type(exception).__name__}: {text[0] if text else ''}"
    if len(line) <= limit:
        return line
    head, sep, hint = line.partition(" HINT: ")
    if not sep:
        return line[: limit - 1] + "…"
    hint = hint if len(hint) <= limit else hint[: limit - 1] + "…"
    return f"{head[: max(limit // 2, limit - len(hint) - 8)].rstrip()}… HINT: {hint}"


def _inside_torch_distributed(frame: Any, depth: int = 12) -> bool:
    """Whether one of the innermost ``depth`` Python frames belongs to ``torch.distributed`` (a collective wait)."""
    marker = os.sep + os.path.join("torch", "distributed") + os.sep
    while frame is not None and depth > 0:
        if marker in frame.f_code.co_filename:
            return True
        frame = frame.f_back
        depth -= 1
    return False


class StoreUnreachable(RuntimeError):
    """A call to the job's store failed: its host (rank 0) ended, or the network between the nodes failed."""


class _GuardedStore:
    """The watchdog's view of the store: every failure of a store call surfaces as :class:`StoreUnreachable`, so the
    heartbeat thread can tell a lost store from a bug of its own."""

    def __init__(self, store: Any) -> None:
        self._store = store

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._store, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return method(*args, **kwargs)
            except Exception as err:
                raise StoreUnreachable(f"{type(err).__name__}: {err}") from err

        return call


class Watchdog:
    """Per-replica heartbeat thread and judge; see the module docstring.

    Args:
        store: a store shared by all replicas (a dedicated client connection: the thread uses it concurrently with
            the training thread).
        rank: this replica's global rank.
        world_size: number of replicas.
        timeout: seconds without progress (or heartbeat) after which a replica is declared stopped.
        interval: seconds between heartbeats. Default: ``timeout / 10``, between 0.1 and 5 s.
        hosts_store: whether the store's server runs in this process (it then waits for the others to read the
            verdict before exiting).
        children: returns the local replicas this process launched, as ``(global_rank, Popen)`` pairs.
        exit: ends the process and its descendants (:func:`exit_job`, from the heartbeat thread only); replaced in
            tests.
        token: the job's secret (:mod:`lightning_het.cluster.rendezvous`): every record is signed with it, and records
            without a valid signature are ignored. ``""``: unsigned records (tests, single-process use).
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        timeout: float,
        *,
        interval: float | None = None,
        hosts_store: bool = False,
        children: Callable[[], Sequence[tuple[int, subprocess.Popen]]] | None = None,
        exit: Callable[[int], None] | None = None,
        token: str = "",
    ) -> None:
        if timeout <= 0:
            raise ValueError(f"Expected argument `timeout` to be positive seconds, but got {timeout!r}.")
        self.store = _GuardedStore(store)
        self.rank = rank
        self.world_size = world_size
        self.timeout = float(timeout)
        self.interval = float(interval) if interval else min(max(self.timeout / 10, 0.1), 5.0)
        self.grace = min(max(2 * self.interval, 1.0), 10.0)
        self.hosts_store = hosts_store
        self._children = children or (lambda: [])
        self._exit = exit or exit_job
        self._token = token
        self._host = socket.gethostname()
        self._pid = os.getpid()
        # written by the training thread, read by the heartbeat thread (single attribute stores: atomic under the GIL)
        self._progress: tuple[int, int, Phase, float] = (0, 0, Phase.SETUP, time.monotonic())
        self._eval_where: tuple[str, int] = ("", -1)  # (running stage, evaluation batch index) during evaluation
        self._armed: set[str] = {"job"}  # judged from start() on: setup, profiling, loops and teardown alike
        self._state = "running"
        self._error = ""
        self._local_failure = False
        self._waited_in_collective = False  # set when a collective failed here (the replica was waiting in it)
        self._handled: BaseException | None = None  # the exception on_exception already dealt with
        self._standing: Verdict | None = None  # the verdict on_exception reached
        # heartbeat thread only
        self._beat = 0
        self._seen: dict[int, tuple[Any, float, Any, float]] = {}
        self._store_lost_since: float | None = None
        self._bugs = 0
        self._forgeries = 0
        self._stop = threading.Event()
        self._reported = False
        self._main_ident = threading.get_ident()
        self._thread = threading.Thread(target=self._run, name=f"lightning-het-watchdog-{rank}", daemon=True)

    # ------------------------------------------------------------------ signed records
    def _write(self, key: str, payload: str) -> None:
        self.store.set(key, sign(self._token, key, payload) if self._token else payload)

    def _read(self, key: str, raw: Any) -> str | None:
        """The payload of a record read from ``key``, or ``None`` when its signature does not match (ignored)."""
        if not self._token:
            return raw.decode() if isinstance(raw, bytes) else raw
        payload = verify(self._token, key, raw)
        if payload is None:
            self._forgeries += 1
            if self._forgeries == 1:
                log.warning(
                    "[rank %d] lightning_het watchdog: ignored a record under %r without a valid signature (written"
                    " by a client outside the job?)",
                    self.rank,
                    key,
                )
        return payload

    # ------------------------------------------------------------------ training thread
    def start(self) -> None:
        """Publish the first heartbeat and start the thread."""
        self._main_ident = threading.get_ident()
        self._started = time.monotonic()
        self._publish()
        self._thread.start()
        log.debug("watchdog started on rank %d: timeout %.1f s, heartbeat every %.2f s", self.rank, self.timeout,
                  self.interval)  # fmt: skip

    @property
    def running(self) -> bool:
        """Whether the heartbeat thread runs (started and not stopped)."""
        return self._thread.is_alive() and not self._stop.is_set()

    def mark(self, phase: Phase, *, new_batch: bool = False, eval_batch: int | None = None, stage: str = "") -> None:
        """Record progress of the training thread (cheap; called from Trainer hooks).

        Args:
            phase: where the training thread is now.
            new_batch: a new training batch starts.
            eval_batch: during evaluation, the 0-based index of the evaluation batch that starts.
            stage: during evaluation, Lightning's running stage (``"validate"``, ``"test"``, ...).
        """
        if eval_batch is not None or stage:
            old_stage, old_batch = self._eval_where
            self._eval_where = (stage or old_stage, old_batch if eval_batch is None else eval_batch)
        seq, batch, _, _ = self._progress
        self._progress = (seq + 1, batch + 1 if new_batch else batch, phase, time.monotonic())

    def arm(self, loop: str) -> None:
        """Note that the training thread entered a loop (``"fit"`` or ``"eval"``); progress counts as made."""
        self._armed.add(loop)
        self.mark(self._progress[2])

    def disarm(self, loop: str) -> None:
        self._armed.discard(loop)
        self.mark(self._progress[2])

    def finish(self, *, wait: bool = True) -> None:
        """Normal end of this replica's run: say so, then (``wait``) wait until every replica has finished.

        While this replica waits, its heartbeat thread keeps judging the others: one that stalls in its own teardown
        for ``timeout`` ends the job, so no replica can outlive the job unnoticed. Returns early when the store is gone
        (the replica hosting it finished and left).
        """
        self.mark(Phase.TEARDOWN)
        if self._state == "running":
            self._state = "finished"
        try:
            self._publish()
            while wait and not self._stop.is_set():
                if self._all_finished():
                    break
                time.sleep(min(self.interval, 0.2))
        except StoreUnreachable:
            pass
        self.stop()

    def _all_finished(self) -> bool:
        others = [s for s in self._statuses() if s.rank != self.rank]
        return all(s.state == "finished" for s in others)

    def stop(self) -> None:
        """Stop the thread (normal end, or this replica's own exception is reaching the caller)."""
        if self._state == "running":
            self._state = "finished"
        self._stop.set()
        with contextlib.suppress(Exception):
            self._publish()
        if self._thread.is_alive() and threading.get_ident() != self._thread.ident:
            self._thread.join(timeout=2 * self.interval + 1.0)

    def on_exception(self, exception: BaseException) -> Verdict | None:
        """The training thread is raising: make sure the whole job ends, and say who is to blame.

        A collective that timed out or lost a peer is a symptom: the culprit is looked for among the others (waiting
        up to a few heartbeats for a dead peer's heartbeat to stop). Ctrl-C ends the job as an interruption (exit
        status 130 everywhere), not a failure. Any other exception is this replica's failure. Idempotent for the same
        exception; never raises (the original exception must propagate).

        Returns:
            The verdict that stands (``None`` when none could be reached).
        """
        if self._handled is exception or isinstance(exception, JobEnded):
            return self._standing
        self._handled = exception
        self._standing = None
        if is_sigterm_exit(exception):  # preemption (exit 143, lightning_het.reliability.preemption): not a failure
            self.stop()
            return None
        try:
            self._local_failure = True
            interruption = interruption_of(exception)
            record = self._abort_record()
            if record is not None:
                self._acknowledge()
                self._standing = record
                return record
            if interruption is not None:
                self._state, self._error = interruption, _first_line(exception)
                self._publish()
                verdict = judge(self._statuses(), self.timeout)
            elif is_collective_failure(exception):
                verdict = self._judge_collective_failure(exception)
            else:
                self._state, self._error = "failed", _first_line(exception)
                self._publish()
                verdict = judge(self._statuses(), self.timeout)
            if verdict is not None:
                self._standing = self._decide(verdict)
        except StoreUnreachable as err:  # its host (rank 0) has ended
            if self.rank != 0:
                self._standing = Verdict(
                    "lost_store",
                    (0,),
                    0.0,
                    f"replica 0 ended: replica {self.rank} lost its connection to the rendezvous store that"
                    f" replica 0 hosts ({err}) while raising {_first_line(exception)}",
                )
                self._report(self._standing)
        except Exception:  # a bug of the watchdog: report it, let the original exception propagate
            log.exception("[rank %d] lightning_het watchdog: internal error while handling an exception", self.rank)
        return self._standing

    def _exit_now(self, code: int) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        self._exit(code)

    # ------------------------------------------------------------------ heartbeat thread
    def _run(self) -> None:
        tick = min(self.interval, 0.5)  # a verdict or a local replica's exit is noticed within `tick`
        next_beat = 0.0
        while not self._stop.wait(tick):
            try:
                record = self._abort_record()
                if record is not None:
                    self._end(record)
                    return
                verdict = self._check_children()
                if verdict is None and time.monotonic() >= next_beat:
                    next_beat = time.monotonic() + self.interval
                    self._publish()
                    verdict = judge(self._statuses(), self.timeout)
                self._store_lost_since = None
                if verdict is not None:
                    self._end(self._decide(verdict))
                    return
            except StoreUnreachable as err:  # the store is gone: its host (rank 0) ended, or the network failed
                if self._stop.is_set():
                    return
                now = time.monotonic()
                self._store_lost_since = self._store_lost_since or now
                if now - self._store_lost_since > self.timeout:
                    verdict = Verdict(
                        "lost_store",
                        (0,),
                        now - self._store_lost_since,
                        f"replica {self.rank} lost contact with the job's rendezvous store for"
                        f" {now - self._store_lost_since:.1f} s ({err}); the replica hosting it (rank 0) ended or the"
                        " network failed",
                    )
                    self._end(verdict)
                    return
            except Exception:  # a bug of the watchdog itself: never a reason to end a healthy job
                self._bugs += 1
                if self._bugs == 1:
                    log.exception(
                        "[rank %d] lightning_het watchdog: internal error in the heartbeat thread; the job goes on"
                        " (this replica's stalls may go unnoticed until it recovers). Please report this.",
                        self.rank,
                    )

    def _publish(self) -> None:
        seq, batch, phase, _ = self._progress
        stage, eval_batch = self._eval_where
        self._beat += 1
        frame = sys._current_frames().get(self._main_ident)
        status = {
            "beat": self._beat,
            "seq": seq,
            "batch": batch,
            "phase": int(phase),
            "eval_stage": stage,
            "eval_batch": eval_batch,
            "armed": bool(self._armed),
            "waiting": self._waited_in_collective or _inside_torch_distributed(frame),
            "state": self._state,
            "error": self._error,
            "host": self._host,
            "pid": self._pid,
        }
        self._write(f"hb/{self.rank}", json.dumps(status))

    def _statuses(self) -> list[ReplicaStatus]:
        now = time.monotonic()
        keys = [f"hb/{r}" for r in range(self.world_size)]
        raw: dict[int, Any] = {}
        if self.store.check(keys):
            raw = dict(enumerate(self.store.multi_get(keys)))
        else:
            for r, key in enumerate(keys):
                if self.store.check([key]):
                    raw[r] = self.store.get(key)
        statuses = []
        for r in range(self.world_size):
            if r == self.rank:
                statuses.append(self._own_status(now))
                continue
            payload = self._read(keys[r], raw[r]) if r in raw else None
            data = json.loads(payload) if payload is not None else None
            old = self._seen.get(r)
            if data is None and old is not None and old[4] is not None:
                data = old[4]  # a forged or garbled record: keep the last genuine one
            beat, seq = (data["beat"], data["seq"]) if data else (None, None)
            if old is None:
                old = (beat, self._started, seq, self._started, None)
            beat_changed = old[1] if beat == old[0] else now
            seq_changed = old[3] if seq == old[2] else now
            self._seen[r] = (beat, beat_changed, seq, seq_changed, data)
            if data is None:
                statuses.append(ReplicaStatus(r, silent_for=now - beat_changed, stalled_for=now - seq_changed))
                continue
            statuses.append(
                ReplicaStatus(
                    rank=r,
                    host=data["host"],
                    pid=data["pid"],
                    batch=data["batch"],
                    phase=Phase(data["phase"]),
                    armed=data["armed"],
                    waiting=data["waiting"],
                    state=data["state"],
                    silent_for=now - beat_changed,
                    stalled_for=now - seq_changed,
                    error=data["error"],
                    eval_stage=data.get("eval_stage", ""),
                    eval_batch=data.get("eval_batch", -1),
                )
            )
        return statuses

    def _own_status(self, now: float) -> ReplicaStatus:
        _, batch, phase, last = self._progress
        stage, eval_batch = self._eval_where
        frame = sys._current_frames().get(self._main_ident)
        return ReplicaStatus(
            rank=self.rank,
            host=self._host,
            pid=self._pid,
            batch=batch,
            phase=phase,
            armed=bool(self._armed),
            waiting=self._waited_in_collective or _inside_torch_distributed(frame),
            state=self._state,
            stalled_for=now - last,
            error=self._error,
            eval_stage=stage,
            eval_batch=eval_batch,
        )

    def _check_children(self) -> Verdict | None:
        return check_children(self._children())

    def _judge_collective_failure(self, exception: BaseException) -> Verdict:
        """A collective failed here: find the peer at fault (a dead one shows within a few heartbeats)."""
        deadline = time.monotonic() + min(max(3 * self.interval, 1.0), self.timeout)
        self._waited_in_collective = True  # this replica was waiting for the others: never a suspect itself
        while True:
            self._publish()
            record = self._abort_record()
            if record is not None:
                return record
            verdict = self._check_children() or judge(
                self._statuses(), self.timeout, silence_timeout=2.5 * self.interval
            )
            if verdict is not None or time.monotonic() >= deadline:
                break
            time.sleep(self.interval)
        if verdict is None:  # nobody dead: blame whoever is furthest behind
            verdict = judge(self._statuses(), 0.0, silence_timeout=self.timeout, suspect_after=0.0)
        cause = _first_line(exception)
        if verdict is None:
            return Verdict("hung", (), 0.0, f"a collective failed on replica {self.rank} ({cause})")
        return Verdict(verdict.kind, verdict.culprits, verdict.seconds, f"{verdict.message}; on replica"
                       f" {self.rank} a collective failed: {cause}")  # fmt: skip

    # ------------------------------------------------------------------ ending the job
    def _abort_record(self) -> Verdict | None:
        if not self.store.check(["abort"]):
            return None
        payload = self._read("abort", self.store.get("abort"))
        return None if payload is None else Verdict.from_json(payload)

    def _decide(self, verdict: Verdict) -> Verdict:
        """Publish ``verdict`` unless another replica already did; return the one that stands."""
        record = sign(self._token, "abort", verdict.to_json()) if self._token else verdict.to_json()
        current = self.store.compare_set("abort", "", record)
        payload = self._read("abort", current)
        if payload is None:  # a forged record holds the key: replace it with ours
            self.store.set("abort", record)
            payload = verdict.to_json()
        standing = Verdict.from_json(payload)
        self._report(standing)
        self._acknowledge()
        if self.hosts_store:
            self._await_acknowledgements(standing)
        return standing

    def _report(self, verdict: Verdict) -> None:
        if self._reported:
            return
        self._reported = True
        message = (
            f"[rank {self.rank}] lightning_het watchdog: {verdict.message}. Ending the job (timeout={self.timeout:g}"
            f" s, exit status {exit_code_for(verdict)}). HINT: {_HINTS.get(verdict.kind, _HINTS['hung'])}"
        )
        if log.hasHandlers():
            log.error(message)
        else:
            print(message, file=sys.stderr, flush=True)

    def _acknowledge(self) -> None:
        with contextlib.suppress(Exception):
            self.store.set(f"ack/{self.rank}", "1")

    def _await_acknowledgements(self, verdict: Verdict) -> None:
        deadline = time.monotonic() + self.grace
        gone = set(verdict.culprits) if verdict.kind in ("exited", "silent") else set()
        pending = [f"ack/{r}" for r in range(self.world_size) if r != self.rank and r not in gone]
        while pending and time.monotonic() < deadline:
            pending = [key for key in pending if not self.store.check([key])]
            time.sleep(0.05)

    def _end(self, verdict: Verdict) -> None:
        """Heartbeat thread: end this process (unless its training thread is already raising)."""
        self._report(verdict)
        self._acknowledge()
        if self.hosts_store:
            with contextlib.suppress(Exception):
                self._await_acknowledgements(verdict)
        # the training thread is unwinding its own exception: let it end the process once the Trainer tore down (the
        # exception then reaches the caller, who decides); end it here only if the teardown hangs
        if self._local_failure and self._stop.wait(max(self.timeout, 10.0)):
            return
        kill_children(self._children())
        self._exit_now(exit_code_for(verdict))


class JobEnded(SystemExit):
    """Raised in a replica's main thread in place of an exception that only reflects how the job ended elsewhere
    (a peer stalled, died or was interrupted): the process exits with :attr:`code` (124 or 130), after the usual
    clean-up (``finally`` blocks, exit handlers). The watchdog has already printed the reason.
    """


def check_children(children: Sequence[tuple[int, subprocess.Popen]]) -> Verdict | None:
    """A verdict for local replicas that exited with a non-zero status (interrupted ones: ``"interrupted"``)."""
    exited = []
    for rank, proc in children:
        code = proc.poll()
        if code and code != _PREEMPTED_EXIT_CODE:  # 143: a preempted replica, ending with the others
            exited.append((rank, proc.pid, code))
    if not exited:
        return None
    ranks = sorted(r for r, _, _ in exited)
    kinds = {CHILD_INTERRUPTION_STATUS.get(code) for _, _, code in exited}
    if len(kinds) == 1 and None not in kinds:
        kind = kinds.pop()
        detail = "; ".join(f"rank {r} (pid {pid}) exit status {code}" for r, pid, code in exited)
        return Verdict(str(kind), tuple(ranks), 0.0, f"replica(s) {ranks} {kind} ({detail})")
    detail = "; ".join(f"rank {r} (pid {pid}) exit status {code}" for r, pid, code in exited)
    return Verdict("exited", tuple(ranks), 0.0, f"replica(s) {ranks} exited during the run ({detail})")


def descendants(pid: int) -> list[int]:
    """The live descendants of process ``pid`` (children first), read from ``/proc/<pid>/task/*/children`` (Linux;
    elsewhere, or without that file: ``[]``). Read them before ``pid`` ends: its orphans are then reparented."""
    found: list[int] = []
    pending = [pid]
    while pending:
        parent = pending.pop(0)
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{parent}/task"):
                with contextlib.suppress(OSError, ValueError), open(f"/proc/{parent}/task/{task}/children") as fh:
                    for child in (int(c) for c in fh.read().split()):
                        if child not in found and child != pid:
                            found.append(child)
                            pending.append(child)
    return found


def kill_pids(pids: Sequence[int]) -> None:
    """SIGKILL every process in ``pids`` that still exists."""
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def exit_job(code: int) -> None:
    """End this replica with ``code`` and its whole process tree with it: its DataLoader workers, compiler workers and
    any other descendants get SIGKILL first (a worker blocked in ``Dataset.__getitem__`` would otherwise outlive the
    job, reparented to init, and keep its output open)."""
    kill_pids(descendants(os.getpid()))
    os._exit(code)


def kill_children(children: Sequence[tuple[int, subprocess.Popen]]) -> list[int]:
    """SIGKILL the local replicas still running, and every descendant of theirs; returns the ranks of those that ran.

    The descendants are read before the replica is killed (orphans leave its tree), and killed after it (it can no
    longer start new ones)."""
    killed = []
    for rank, proc in children:
        with contextlib.suppress(Exception):
            if proc.poll() is None:
                tree = descendants(proc.pid)
                proc.kill()
                kill_pids(tree)
                killed.append(rank)
    return killed


class WatchdogCallback(Callback):
    """Feeds the :class:`Watchdog` with the training thread's progress; added to the Trainer by the strategy."""

    def __init__(self, watchdog: Watchdog) -> None:
        self.watchdog = watchdog

    def __deepcopy__(self, memo: dict[int, Any]) -> WatchdogCallback:
        """A copy that shares this process's running watchdog (its threads and store connection are not state to
        duplicate): ``copy.deepcopy(trainer.callbacks)`` works as for any callback."""
        return copy.copy(self)

    # loops
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.watchdog.arm("fit")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.watchdog.disarm("fit")

    def _eval_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.watchdog.arm("eval")
        self.watchdog.mark(Phase.EVAL_LOADING, eval_batch=-1, stage=_stage(trainer))

    def _eval_end(self, *args: Any) -> None:
        self.watchdog.disarm("eval")

    on_validation_start = on_test_start = on_predict_start = _eval_start
    on_validation_end = on_test_end = on_predict_end = _eval_end

    # training batch
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self.watchdog.mark(Phase.TRAINING_STEP, new_batch=True)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        self.watchdog.mark(Phase.BACKWARD)

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.watchdog.mark(Phase.OPTIMIZER_STEP)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.watchdog.mark(Phase.BETWEEN_BATCHES)

    def _between(self, *args: Any, **kwargs: Any) -> None:
        self.watchdog.mark(Phase.BETWEEN_BATCHES)

    on_train_epoch_start = on_train_epoch_end = _between

    # evaluation batches
    def _eval_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, *args: Any
    ) -> None:
        self.watchdog.mark(Phase.EVAL_STEP, eval_batch=batch_idx, stage=_stage(trainer))

    def _eval_batch_end(self, *args: Any, **kwargs: Any) -> None:
        self.watchdog.mark(Phase.EVAL_LOADING)

    def _eval_done(self, *args: Any, **kwargs: Any) -> None:
        self.watchdog.mark(Phase.EVAL_DONE)

    on_validation_batch_start = on_test_batch_start = on_predict_batch_start = _eval_batch_start
    on_validation_batch_end = on_test_batch_end = on_predict_batch_end = _eval_batch_end
    on_validation_epoch_end = on_test_epoch_end = on_predict_epoch_end = _eval_done

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: Any) -> None:
        self.watchdog.mark(self.watchdog._progress[2])

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.watchdog.on_exception(exception)


def _stage(trainer: pl.Trainer) -> str:
    stage = trainer.state.stage
    return str(stage.value) if stage is not None else ""


def _seconds(value: timedelta | float | None) -> float | None:
    if value is None:
        return None
    return value.total_seconds() if isinstance(value, timedelta) else float(value)


def start_watchdog(
    strategy: Any, timeout: timedelta | float | None, trainer: pl.Trainer | None = None
) -> Watchdog | None:
    """Start a :class:`Watchdog` for this replica (multi-replica jobs only), in phase ``SETUP``.

    Collective: every rank calls it right after the process group exists (the replicas agree on the job token).

    Args:
        strategy: the :class:`~lightning_het.HeterogeneousStrategy` (its process group must exist); its public
            ``launcher``, ``node_rank`` and ``num_processes`` name the replicas this process launched.
        timeout: the strategy's collective timeout (``None``: no watchdog).
        trainer: the Trainer that gets the :class:`WatchdogCallback` (else see :func:`attach_watchdog`).

    Returns:
        The running watchdog, or ``None`` for a single replica or without a process group.
    """
    seconds = _seconds(timeout)
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2 or not seconds:
        return None
    token = agree_on_token(os.environ.get(TOKEN_ENV, ""))
    base = default_store()
    connection = base.clone() if hasattr(base, "clone") else base
    store = dist.PrefixStore(f"lightning_het/watchdog/{key_prefix(token)}/{next(_generation)}/", connection)
    rank = dist.get_rank()
    hosts_store = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true"
    watchdog = Watchdog(
        store,
        rank,
        dist.get_world_size(),
        seconds,
        hosts_store=hosts_store,
        children=_launched_replicas(strategy),
        token=token,
    )
    watchdog.start()
    if trainer is not None:
        attach_watchdog(watchdog, trainer)
    return watchdog


def attach_watchdog(watchdog: Watchdog | None, trainer: pl.Trainer) -> None:
    """Give ``trainer`` the :class:`WatchdogCallback` of ``watchdog`` (replacing an older one)."""
    callback_cls = on_flavour(WatchdogCallback, trainer)  # the standalone pytorch_lightning's Callback for its trainers
    trainer.callbacks[:] = [cb for cb in trainer.callbacks if not isinstance(cb, callback_cls)]
    if watchdog is not None:
        trainer.callbacks.append(callback_cls(watchdog))


def stop_watchdog(watchdog: Watchdog | None, trainer: pl.Trainer | None = None, *, finished: bool = False) -> None:
    """Stop ``watchdog`` and remove its callback; ``finished``: first wait until every replica finished."""
    if watchdog is None:
        return
    if finished:
        watchdog.finish()
    else:
        watchdog.stop()
    if trainer is not None:
        callback_cls = on_flavour(WatchdogCallback, trainer)
        trainer.callbacks[:] = [cb for cb in trainer.callbacks if not isinstance(cb, callback_cls)]


def _launched_replicas(strategy: Any) -> Callable[[], list[tuple[int, subprocess.Popen]]]:
    """The local replicas that this process launched (Lightning's ``popen`` launcher), with their global ranks."""

    def children() -> list[tuple[int, subprocess.Popen]]:
        procs = getattr(getattr(strategy, "launcher", None), "procs", None) or []
        first = strategy.node_rank * strategy.num_processes
        return [(first + local_rank, proc) for local_rank, proc in enumerate(procs, start=1)]

    return children


def rendezvous_timeout(timeout: timedelta | None, startup_timeout: timedelta | float | None = None) -> timedelta | None:
    """The timeout the rendezvous should use instead of the strategy's ``timeout``, or ``None`` to keep ``timeout``.

    ``torch.distributed.init_process_group(timeout=...)`` uses one timeout for the rendezvous and for every
    collective; a ``timeout`` short enough to end a hung job quickly would also fail a job whose replicas take longer
    to start (imports, a busy node, a scheduler starting nodes apart). The rendezvous therefore waits
    ``startup_timeout`` (default 10 minutes) when that is longer; the strategy applies it to itself during the
    rendezvous and then restores ``timeout`` with :func:`apply_collective_timeout`.

    Args:
        timeout: the strategy's collective timeout (``None``: torch's default, kept).
        startup_timeout: the rendezvous timeout (seconds or ``timedelta``; ``None``: 10 minutes).

    Returns:
        The longer rendezvous timeout, or ``None`` when ``timeout`` is unset or already at least as long, or when the
        default process group already exists (nothing to rendezvous).
    """
    startup = startup_timeout if startup_timeout is not None else DEFAULT_STARTUP_TIMEOUT
    startup = timedelta(seconds=startup) if isinstance(startup, (int, float)) else startup
    if timeout is None or startup <= timeout or dist.is_initialized():
        return None
    return startup


def apply_collective_timeout(timeout: timedelta) -> None:
    """Give the default process group's collectives and its store ``timeout`` (after a longer rendezvous)."""
    if dist.is_initialized():
        set_default_group_timeout(timeout)


def validate_launch_environment(num_nodes: int, cluster_environment: Any, environ: Any = None) -> None:
    """Refuse multi-node launches that would wait forever for a rendezvous that cannot happen.

    Called by the strategy's launchers when they start the processes (``fit``, ``validate``, ...), before any starts;
    not at Trainer construction, so that a Trainer can be built where the variables are not set (a login node, a unit
    test, printing a config), as Lightning allows.

    With Lightning's default environment (no SLURM, torchrun, ...), every node must be given the same
    ``MASTER_ADDR`` and ``MASTER_PORT``; otherwise each node silently rendezvouses on its own localhost / a random
    port and waits until the start-up timeout.

    Raises:
        ValueError: naming the missing variable(s).
    """
    environ = os.environ if environ is None else environ
    if num_nodes <= 1 or cluster_environment is None or cluster_environment.creates_processes_externally:
        return
    if type(cluster_environment).__name__ != "LightningEnvironment":
        return
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK") if not environ.get(name)]
    if missing:
        raise ValueError(
            f"You set num_nodes={num_nodes}, but the environment variable(s) {', '.join(missing)} are not set, so the"
            " nodes cannot find each other (each would wait for its own rendezvous until the start-up timeout)."
            " HINT: on every node export MASTER_ADDR=<host of node 0>, MASTER_PORT=<free port, same on all nodes>"
            " and NODE_RANK=<0..num_nodes-1>, or launch through SLURM / torchrun."
        )
