"""Hung- and dead-replica detection and its verdicts (one job: a stalled job ends within ``timeout``, naming the
replica(s), :func:`judge`)."""

from __future__ import annotations

import contextlib
import ctypes
import glob
import hashlib
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
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from enum import IntEnum
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from lightning_het._compat import batch_hooks
from lightning_het.cluster.rendezvous import sign, verify

log = logging.getLogger(__name__)  # without a handler configured: to stderr (logging.lastResort)


WATCHDOG_EXIT_CODE = 124  # exit status of a replica ended by the watchdog (as ``timeout(1)`` uses for "timed out")
INTERRUPTED_EXIT_CODE = 130  # exit status of a job interrupted by Ctrl-C (SIGINT), as shells report it


def is_sigterm_exit(exception: BaseException) -> bool:
    """Whether ``exception`` is a ``SIGTERMException`` of either Lightning package (e.g. preempted)."""
    return isinstance(exception, SystemExit) and any(
        cls.__name__ == "SIGTERMException" and cls.__module__.endswith(".utilities.exceptions")
        for cls in type(exception).__mro__
    )


class Phase(IntEnum):
    """Where a replica's main thread is (values increase with progress), and its :attr:`text`."""

    def __new__(cls, value: int, text: str) -> Phase:
        self = int.__new__(cls, value)  # the member being made
        self._value_, self.text = value, text
        return self

    SETUP = 0, "in setup (setup hooks, model wrapping, data loaders)"  # process group up, checkpoint restore
    PROFILING = 1, "profiling the training step (speed measurement)"
    TRAINING_STEP = 2, "in training_step"
    BACKWARD = 3, "in backward (gradient all-reduce)"
    OPTIMIZER_STEP = 4, "in the optimizer step"
    BETWEEN_BATCHES = 5, "between training batches (loading data, epoch hooks, checkpointing)"  # after batch k
    EVAL_LOADING = 6, "loading an evaluation batch"  # evaluation after batch k: between evaluation batches
    EVAL_STEP = 7, "in an evaluation step"
    EVAL_EPOCH_END = 8, "in the evaluation epoch-end hooks"  # all evaluation batches done
    EVAL_DONE = 9, "done with evaluation (synchronising metrics)"  # the loop ended: waiting for the others
    TEARDOWN = 10, "in teardown (end-of-run hooks)"  # the loops are over: waiting for the others to finish


_EVAL_HOOKS = {"validate": ("validation_step", "on_validation_epoch_end"), "test": ("test_step", "on_test_epoch_end"),
               "sanity_check": ("validation_step (sanity check)", "on_validation_epoch_end"),
               "predict": ("predict_step", "on_predict_epoch_end")}  # fmt: skip
_EVAL_PHASES = (Phase.EVAL_LOADING, Phase.EVAL_STEP, Phase.EVAL_EPOCH_END)


@dataclass(frozen=True)
class ReplicaStatus:
    """One replica as seen by an observer (the input of :func:`judge`)."""

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
        """Where the replica is, in words: the phase and the training (or evaluation) batch it concerns."""
        phase, batch, stage, where = self.phase, self.batch, self.eval_stage, f"{self.phase.text} of batch {self.batch}"
        if phase in (Phase.SETUP, Phase.PROFILING, Phase.TEARDOWN):
            where = phase.text
        elif phase in _EVAL_PHASES and stage:
            step, hook = _EVAL_HOOKS.get(stage, (f"{stage} step", "the evaluation epoch-end hooks"))
            if phase == Phase.EVAL_STEP:
                where = f"in {step} of evaluation batch {self.eval_batch}"
            elif phase == Phase.EVAL_EPOCH_END:
                where = f"in {hook}"
            else:
                where = f"loading evaluation batch {self.eval_batch + 1} for {step}"
            where = f"{where} (after training batch {batch})" if batch else where
        return f"rank {self.rank} on {self.host} (pid {self.pid}): {where}"


@dataclass(frozen=True)
class Verdict:
    """Which replica(s) to blame, and the message every replica prints before ending."""

    kind: str  # "hung", "silent", "exited", "failed" or "lost_store"
    culprits: tuple[int, ...]
    seconds: float
    message: str

    @property
    def exit_code(self) -> int:
        """The exit status of a replica it ends: 130 for Ctrl-C, else 124 (stalled, dead or failed)."""
        return INTERRUPTED_EXIT_CODE if self.kind == "interrupted" else WATCHDOG_EXIT_CODE

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> Verdict:
        data = json.loads(text)
        return cls(**{**data, "culprits": tuple(data["culprits"]), "seconds": float(data["seconds"])})


HINTS = {
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
    statuses: Sequence[ReplicaStatus], timeout: float, *, silence: float | None = None, suspect: float | None = None
) -> Verdict | None:
    """Whether the job must end and whom to blame (pure; rules in ``docs/reliability.md``): silent ``silence`` seconds
    (default ``timeout``), stalled ``timeout``; a suspect: stalled ``suspect`` seconds (default ``timeout / 2``)."""
    silence = timeout if silence is None else silence
    suspect = timeout / 2 if suspect is None else suspect
    for kind in ("interrupted", "failed"):
        ended = [s for s in statuses if s.state == kind]
        if ended:
            detail = "; ".join(f"rank {s.rank} on {s.host} (pid {s.pid}): {s.error or s.state}" for s in ended)
            return Verdict(kind, tuple(_ranks(ended)), 0.0, f"replica(s) {_ranks(ended)} {kind} ({detail})")
    running = [s for s in statuses if s.state == "running"]
    silent = [s for s in running if s.silent_for > silence]
    if silent:
        seconds = max(s.silent_for for s in silent)
        detail = "; ".join(f"{s.describe()} when last heard of" for s in silent)
        message = f"replica(s) {_ranks(silent)} stopped responding for {seconds:.1f} s: no heartbeat, the process"
        return Verdict("silent", tuple(_ranks(silent)), seconds, f"{message} died or froze ({detail})")
    armed = [s for s in running if s.armed]
    if not any(s.stalled_for > timeout for s in armed):
        return None
    seconds = max(s.stalled_for for s in armed)
    waiting = {s.rank for s in running if s.waiting or s.phase == Phase.EVAL_DONE}
    suspects = [s for s in armed if s.stalled_for > suspect and s.rank not in waiting]
    behind = min((s.position for s in suspects), default=None)
    culprits = [s for s in suspects if s.phase in _EVAL_PHASES] or [s for s in suspects if s.position == behind]
    culprits = culprits or [s for s in running if s.rank not in waiting]
    progressing = bool(culprits) and all(s.stalled_for <= suspect for s in culprits)
    culprits = culprits or armed  # everyone waits on everyone: report them all
    others = [s for s in running if s not in culprits]
    context = "; ".join(s.describe() for s in culprits)
    if others:
        context += "; the others wait: " + "; ".join(s.describe() for s in others)
    seconds = seconds if progressing else max(s.stalled_for for s in culprits)
    text = f"{'kept the other replicas waiting' if progressing else 'stopped responding'} for {seconds:.1f} s"
    return Verdict("hung", tuple(_ranks(culprits)), seconds, f"replica(s) {_ranks(culprits)} {text} ({context})")


def is_collective_failure(exception: BaseException) -> bool:
    """Whether ``exception`` is a collective that failed because of a peer (timed out, lost connection)."""
    text, markers = str(exception).lower(), ("gloo", "nccl", "connection closed by peer", "connection reset by peer")
    marked = isinstance(exception, RuntimeError) and any(marker in text for marker in markers)
    return marked or isinstance(exception, dist.DistError)


def first_line(exception: BaseException, limit: int = 300) -> str:
    """``Type: first line`` of ``exception``, about ``limit`` characters at most, keeping its ``HINT:``."""
    text = str(exception).strip().splitlines()
    line = f"{type(exception).__name__}: {text[0] if text else ''}"
    if len(line) <= limit:
        return line
    head, sep, hint = line.partition(" HINT: ")
    if not sep:
        return line[: limit - 1] + "…"
    hint = hint if len(hint) <= limit else hint[: limit - 1] + "…"
    return f"{head[: max(limit // 2, limit - len(hint) - 8)].rstrip()}… HINT: {hint}"


class JobEnded(SystemExit):
    """Raised instead of an exception that only reflects the job ending elsewhere; exits with :attr:`code`."""


def check_children(children: Sequence[tuple[int, subprocess.Popen]]) -> Verdict | None:
    """A verdict for local replicas that exited with a non-zero status (143, preempted: none)."""
    exited = [(r, p.pid, code) for r, p in children if (code := p.poll()) and code != 128 + signal.SIGTERM]
    if not exited:
        return None
    ranks = sorted(r for r, _, _ in exited)
    detail = "; ".join(f"rank {r} (pid {pid}) exit status {code}" for r, pid, code in exited)
    if all(code in (INTERRUPTED_EXIT_CODE, -signal.SIGINT) for *_, code in exited):
        return Verdict("interrupted", tuple(ranks), 0.0, f"replica(s) {ranks} interrupted ({detail})")
    return Verdict("exited", tuple(ranks), 0.0, f"replica(s) {ranks} exited during the run ({detail})")


def die_with_parent() -> None:
    """Ask the kernel for SIGKILL when the parent thread ends (Linux ``PR_SET_PDEATHSIG``; elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)


def descendants(pid: int) -> list[int]:
    """Live descendants of ``pid`` (children first) from ``/proc`` (Linux; else ``[]``)."""
    found: list[int] = []
    pending = [pid]
    while pending:
        for path in glob.glob(f"/proc/{pending.pop(0)}/task/*/children"):
            with contextlib.suppress(OSError, ValueError), open(path) as fh:
                new = [c for c in map(int, fh.read().split()) if c not in found and c != pid]
                found += new
                pending += new
    return found


def _kill(pids: Sequence[int]) -> None:
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def exit_job(code: int) -> None:
    """End this process with ``code``, output flushed and descendants SIGKILLed (no worker outlives the job)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    _kill(descendants(os.getpid()))
    os._exit(code)


def end_children(children: Sequence[tuple[int, subprocess.Popen]], wait: float = 0.0) -> list[int]:
    """SIGKILL the local replicas (and descendants) still running after ``wait`` seconds; the ranks of those killed."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and any(proc.poll() is None for _, proc in children):
        time.sleep(0.05)
    running = [(rank, proc) for rank, proc in children if proc.poll() is None]
    for _, proc in running:
        _kill([proc.pid, *descendants(proc.pid)])  # what it started, read before it ends
    return [rank for rank, _ in running]


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` on this node exists and is not a zombie."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except ProcessLookupError:
        return False
    except (PermissionError, OSError, IndexError):
        return True


def as_seconds(value: timedelta | float | None) -> float | None:
    return value.total_seconds() if isinstance(value, timedelta) else None if value is None else float(value)


_BOOT_ID_FILE = Path("/proc/sys/kernel/random/boot_id")
#: this machine's boot id (Linux): with the host name, tells whether a replica runs on this node
BOOT_ID = _BOOT_ID_FILE.read_text().strip() if _BOOT_ID_FILE.exists() else ""


_TORCH_DISTRIBUTED = os.sep + os.path.join("torch", "distributed") + os.sep
#: packages whose barriers call a process group's C++ method directly, and those barriers
_LIGHTNING = [os.sep + n + os.sep for n in ("lightning", "pytorch_lightning", "lightning_fabric", "lightning_het")]
_WAITING_FUNCTIONS = frozenset({"barrier", "_sync_dir", "_InfiniteBarrier.__exit__", "_InfiniteBarrier.__call__"})
_BARRIER_FILE = os.path.join("fabric", "utilities", "distributed.py")  # where _InfiniteBarrier lives


def inside_torch_distributed(frame: Any, depth: int = 12) -> bool:
    """Whether one of the innermost ``depth`` frames waits for other replicas (a collective or a barrier)."""
    for _ in range(depth):
        if frame is None:
            return False
        code = frame.f_code
        name, file = getattr(code, "co_qualname", code.co_name), code.co_filename
        if not hasattr(code, "co_qualname") and file.endswith(_BARRIER_FILE):  # Python 3.10: no co_qualname
            name = f"_InfiniteBarrier.{name}"
        waiting = code.co_name in _WAITING_FUNCTIONS or name in _WAITING_FUNCTIONS
        if _TORCH_DISTRIBUTED in file or (waiting and any(package in file for package in _LIGHTNING)):
            return True
        frame = frame.f_back
    return False


def status_from_record(rank: int, data: dict[str, Any], silent_for: float, stalled_for: float) -> ReplicaStatus:
    keys = ("host", "pid", "batch", "armed", "waiting", "state", "error", "eval_stage", "eval_batch")
    ages = {"silent_for": silent_for, "stalled_for": stalled_for}
    return ReplicaStatus(rank, phase=Phase(data["phase"]), **ages, **{key: data[key] for key in keys})


class Watchdog:
    """Per-replica heartbeat thread and judge; the others' heartbeats are aged by this replica's monotonic clock."""

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
        namespace: str = "",
        peers: dict[int, tuple[str, str, int]] | None = None,
    ) -> None:
        self.store, self.rank, self.world_size, self.timeout = store, rank, world_size, float(timeout)
        self.interval = float(interval) if interval else min(max(self.timeout / 10, 0.1), 5.0)
        self.grace, self.hosts_store = min(max(2 * self.interval, 1.0), 10.0), hosts_store
        self._children, self._exit, self._token = children or list, exit or exit_job, token
        self._host, self._pid = socket.gethostname(), os.getpid()
        # written by the training thread, read by the heartbeat thread (single attribute stores: atomic under the GIL)
        self._progress: tuple[int, int, Phase] = (0, 0, Phase.SETUP)  # seq, batch, phase
        self._seq_seen = (-1, time.monotonic())  # heartbeat thread: the last progress number it saw, and when
        self._eval_where: tuple[str, int] = ("", -1)  # (running stage, evaluation batch index) during evaluation
        self._armed: set[str] = {"job"}  # judged from start() on: setup, profiling, loops and teardown alike
        # its state and error; whether a collective failed here (the replica was waiting in it)
        self._state, self._error, self._waited_in_collective = "running", "", False
        self._handled, self._standing = None, None  # the exception on_exception dealt with, and its verdict
        # heartbeat thread only
        self._beat, self._bugs, self._reported = 0, 0, False
        self.namespace, self.peers, self.alive = namespace, peers or {}, process_alive  # alive: whether a pid lives
        self.stale_after = max(3 * self.interval, 1.0)  # heartbeat older: check whether the process is alive
        self.seen: dict[int, tuple[float, float, dict[str, Any] | None]] = {}  # beat and seq changed at, last record
        self.tampered: set[str] = set()  # the keys found tampered with
        self._hidden, self._forged, self._started = set(), False, 0.0
        self._store_lost_since, self._stop, self._main_ident = None, threading.Event(), threading.get_ident()
        self.emergency: Any = None  # the EmergencyCheckpoint a verdict against other replicas saves (set by the owner)
        self._thread = threading.Thread(target=self._run, name=f"lightning-het-watchdog-{rank}", daemon=True)

    def __deepcopy__(self, memo: dict[int, Any]) -> Watchdog:
        return self  # shared, as the process group is (this process's thread and store connection)

    def start(self) -> None:
        """Publish the first heartbeat and start the thread."""
        self._main_ident, self._started = threading.get_ident(), time.monotonic()
        self._publish()
        self._thread.start()

    def mark(self, phase: Phase | None = None, *, eval_batch: int | None = None, stage: str = "") -> None:
        """Record progress of the training thread (``None``: in the same phase; cheap, called from Trainer hooks)."""
        if eval_batch is not None or stage:
            old_stage, old_batch = self._eval_where
            self._eval_where = (stage or old_stage, old_batch if eval_batch is None else eval_batch)
        self.step(self._progress[2] if phase is None else phase)

    def step(self, phase: Phase, batches: int = 0) -> None:
        """Progress into a training step's ``phase``, ``batches`` more batches started (a few bytecodes: every step)."""
        seq, batch, _ = self._progress  # no clock read: the heartbeat thread times the progress it sees
        self._progress = (seq + 1, batch + batches, phase)

    def arm(self, loop: str, armed: bool = True) -> None:
        """The training thread entered (``armed``) or left a loop (``"fit"`` or ``"eval"``); progress counts as made."""
        self._armed.add(loop) if armed else self._armed.discard(loop)
        self.mark()

    def finish(self) -> None:
        """Normal end of this replica's run: say so, wait until every replica has finished, stop."""
        self.mark(Phase.TEARDOWN)
        self._state = "finished" if self._state == "running" else self._state
        with contextlib.suppress(dist.DistError):
            self._publish()
            while not self._stop.is_set() and {s.state for s in self._statuses() if s.rank != self.rank} - {"finished"}:
                time.sleep(min(self.interval, 0.2))
        self.stop()

    def stop(self) -> None:
        """Stop the thread (normal end, or this replica's own exception is reaching the caller)."""
        self._state = "finished" if self._state == "running" else self._state
        self._stop.set()
        with contextlib.suppress(Exception):
            self._publish()
        if self._thread.is_alive() and threading.get_ident() != self._thread.ident:
            self._thread.join(timeout=2 * self.interval + 1.0)

    def on_exception(self, exception: BaseException) -> Verdict | None:
        """The training thread is raising: make sure the whole job ends, and say who is to blame."""
        if self._handled is exception or isinstance(exception, JobEnded):
            return self._standing
        self._handled, self._standing = exception, None
        if is_sigterm_exit(exception):  # preemption (exit 143): not a failure
            self.stop()
            return None
        try:
            verdict = self._abort_record()
            if verdict is None and not isinstance(exception, KeyboardInterrupt) and is_collective_failure(exception):
                verdict = self._judge_collective_failure(exception)
            elif verdict is None:
                self._state = "interrupted" if isinstance(exception, KeyboardInterrupt) else "failed"
                self._error = first_line(exception)
                self._publish()
                verdict = judge(self._statuses(), self.timeout)
            if verdict is not None:
                self._standing = self._conclude(verdict)
        except dist.DistError as err:  # its host (rank 0) has ended
            if self.rank != 0:
                message = f"replica 0 ended: replica {self.rank} lost the store ({first_line(err)}) while raising"
                lost = Verdict("lost_store", (0,), 0.0, f"{message} {first_line(exception)}")
                self._standing = self._conclude(lost, publish=False)
        except Exception:  # a bug of the watchdog: report it, let the original exception propagate
            self._log(logging.ERROR, "internal error while handling an exception", exc_info=True)
        return self._standing

    def _run(self) -> None:
        tick = min(self.interval, 0.5)  # a verdict or a local replica's exit is noticed within `tick`
        next_beat, verdict, publish = 0.0, None, True
        while verdict is None and not self._stop.wait(tick):
            try:
                self._progress_seen(time.monotonic())
                verdict = self._abort_record() or check_children(self._children())
                if verdict is None and time.monotonic() >= next_beat:
                    next_beat = time.monotonic() + self.interval
                    self._publish()
                    verdict = judge(self._statuses(), self.timeout)
                self._store_lost_since = None
            except dist.DistError as err:  # the store is gone: its host (rank 0) ended, or the network failed
                if self._stop.is_set():
                    return
                self._store_lost_since = self._store_lost_since or time.monotonic()
                lost = time.monotonic() - self._store_lost_since
                if lost > self.timeout:
                    message = f"replica {self.rank} lost the store on rank 0 for {lost:.1f} s ({first_line(err)})"
                    verdict, publish = Verdict("lost_store", (0,), lost, message), False
            except Exception:  # a bug of the watchdog itself: never a reason to end a healthy job
                self._bugs += 1
                if self._bugs == 1:
                    stalls = "this replica's stalls may go unnoticed until it recovers"
                    message = f"internal error in the heartbeat thread; the job goes on ({stalls}). Please report this."
                    self._log(logging.ERROR, message, exc_info=True)
        if verdict is None:
            return
        try:
            verdict = self._conclude(verdict, publish)
        except Exception:  # the store went away while publishing (or a bug): end with the verdict reached here
            verdict = self._conclude(verdict, publish=False)
        # the training thread is unwinding its own exception: it ends the process once the Trainer tore down (the
        # exception then reaches the caller); end it here only if the teardown hangs
        if self._handled is not None and self._stop.wait(max(self.timeout, 10.0)):
            return
        end_children(self._children())
        self._exit(verdict.exit_code)

    def _record(self) -> dict[str, Any]:
        """This replica's heartbeat record (without its ``beat`` number)."""
        (seq, batch, phase), (stage, eval_batch) = self._progress, self._eval_where
        waiting = self._waited_in_collective or inside_torch_distributed(sys._current_frames().get(self._main_ident))
        return {"seq": seq, "batch": batch, "phase": int(phase), "eval_stage": stage, "eval_batch": eval_batch,
                "armed": bool(self._armed), "waiting": waiting, "state": self._state, "error": self._error,
                "host": self._host, "boot": BOOT_ID, "rank": self.rank, "pid": self._pid}  # fmt: skip

    def _publish(self) -> None:
        self._beat += 1
        key = f"hb/{self.rank}"
        self.store.set(key, self.sign(key, json.dumps({"beat": self._beat, **self._record()})))

    def _statuses(self) -> list[ReplicaStatus]:
        now = time.monotonic()
        keys = [f"hb/{r}" for r in range(self.world_size)]
        if self.store.check(keys):
            raw = dict(enumerate(self.store.multi_get(keys)))
        else:
            raw = {r: self.store.get(key) for r, key in enumerate(keys) if self.store.check([key])}
        children = dict(self._children())
        mine = status_from_record(self.rank, self._record(), 0.0, now - self._progress_seen(now))
        return [mine if r == self.rank else self.status(r, raw.get(r), now, children.get(r)) for r in range(len(keys))]

    def _progress_seen(self, now: float) -> float:
        """When the training thread's progress was last seen to change (checked every tick and by every judgement)."""
        seq = self._progress[0]
        if seq != self._seq_seen[0]:
            self._seq_seen = (seq, now)
        return self._seq_seen[1]

    def _log(self, level: int, message: str, exc_info: bool = False) -> None:
        log.log(level, f"[rank {self.rank}] lightning_het watchdog: {message}", exc_info=exc_info)

    def sign(self, key: str, payload: str) -> str:
        return sign(self._token, self.namespace + key, payload) if self._token else payload

    def verify(self, key: str, raw: Any) -> str | None:
        """The payload of a record read from ``key``, or ``None`` when its signature does not match (ignored)."""
        if not self._token:
            return raw.decode() if isinstance(raw, bytes) else raw
        payload = verify(self._token, self.namespace + key, raw)
        if payload is None and not self._forged:
            self._forged = True
            self._log(logging.WARNING, f"ignored a record under {key!r} without a valid signature")
        return payload

    def genuine(self, r: int, raw: Any) -> dict[str, Any] | None:
        """Replica ``r``'s record ``raw`` (``None``: the key is missing) if it is genuine and fresh, else ``None``."""
        key, last, data = f"hb/{r}", self.seen.get(r, (0, 0, None))[2], None
        payload = None if raw is None else self.verify(key, raw)
        with contextlib.suppress(ValueError):
            data = None if payload is None else json.loads(payload)
        if raw is None:
            problem = "the record was deleted" if last is not None else None
        elif payload is None:
            problem = "a record without a valid signature"
        elif not isinstance(data, dict):
            problem = "a record that is not a heartbeat"
        elif data.get("rank", r) != r:
            problem = f"a record of replica {data.get('rank')}"
        elif last is not None and data["beat"] < last["beat"]:
            problem = f"an older record replayed (beat {data['beat']} after {last['beat']})"
        else:
            return data
        if problem is not None and key not in self.tampered:
            self.tampered.add(key)
            self._log(logging.WARNING, f"tampering with the job's store detected under {key!r}: {problem}; ignored")
        return None

    def status(self, r: int, raw: Any, now: float, child: subprocess.Popen | None = None) -> ReplicaStatus:
        """Replica ``r``'s status from the record just read (``None``: missing) and, launched here, its process."""
        last = self.seen.get(r)
        data = self.genuine(r, raw) or (last and last[2])  # forged, replayed, deleted: keep the last genuine one
        last = last or (self._started, self._started, data)
        old = last[2] or {}
        beat_at, seq_at = (now if data and data[k] != old.get(k) else t for k, t in zip(("beat", "seq"), last))
        self.seen[r] = (beat_at, seq_at, data)
        silent, stalled = now - beat_at, now - seq_at
        status = ReplicaStatus(r, silent_for=silent, stalled_for=stalled)
        status = status if data is None else status_from_record(r, data, silent, stalled)
        code = None if child is None else child.poll()
        if code == 0:
            return replace(status, state="finished")
        host, boot, pid = self.peers.get(r) or (data and (data["host"], data.get("boot", ""), data["pid"])) or ("",) * 3
        # the second signal: a replica whose process is alive (on this node) is not dead, whatever its heartbeat
        alive = code is None if child is not None else host == self._host and boot == BOOT_ID and self.alive(int(pid))
        if silent <= self.stale_after or not alive:
            return status
        if r not in self._hidden:
            self._hidden.add(r)
            alive = f"its process (pid {pid}) on this node is alive: not presumed dead"
            hidden = f"its heartbeat under 'hb/{r}' is hidden by tampering, or it is frozen"
            self._log(logging.WARNING, f"no heartbeat of replica {r} for {silent:.1f} s, but {alive} ({hidden})")
        return replace(status, silent_for=0.0, stalled_for=0.0)

    def _judge_collective_failure(self, exception: BaseException) -> Verdict:
        """A collective failed here: find the peer at fault (a dead one shows within a few heartbeats)."""
        deadline = time.monotonic() + min(max(3 * self.interval, 1.0), self.timeout)
        self._waited_in_collective = True  # this replica was waiting for the others: never a suspect itself
        while True:
            self._publish()  # a verdict already published stands (see _conclude)
            verdict = self._abort_record() or check_children(self._children())
            verdict = verdict or judge(self._statuses(), self.timeout, silence=2.5 * self.interval)
            if verdict is not None or time.monotonic() >= deadline:
                break
            time.sleep(self.interval)
        if verdict is None:  # nobody dead: blame whoever is furthest behind
            verdict = judge(self._statuses(), 0.0, silence=self.timeout, suspect=0.0)
        cause = first_line(exception)
        if verdict is None:
            return Verdict("hung", (), 0.0, f"a collective failed on replica {self.rank} ({cause})")
        return replace(verdict, message=f"{verdict.message}; on replica {self.rank} a collective failed: {cause}")

    def _abort_record(self) -> Verdict | None:
        if not self.store.check(["abort"]):
            return None
        payload = self.verify("abort", self.store.get("abort"))
        return None if payload is None else Verdict.from_json(payload)

    def _conclude(self, verdict: Verdict, publish: bool = True) -> Verdict:
        """Publish ``verdict`` unless another replica did; report, acknowledge and (survivors) save the standing one."""
        if publish:
            record = self.sign("abort", verdict.to_json())
            payload = self.verify("abort", self.store.compare_set("abort", "", record))
            if payload is None:  # a forged record holds the key: replace it with ours
                self.store.set("abort", record)
                payload = verdict.to_json()
            verdict = Verdict.from_json(payload)
        if not self._reported:
            self._reported = True
            ending = f"Ending the job (timeout={self.timeout:g} s, exit status {verdict.exit_code})"
            hint = HINTS.get(verdict.kind, HINTS["hung"])
            self._log(logging.ERROR, f"{verdict.message}. {ending}. HINT: {hint}")
        with contextlib.suppress(Exception):
            self.store.set(f"ack/{self.rank}", "1")
        # a replica stalled, went silent or exited: the survivors save an emergency checkpoint (its writer: 120 s)
        saves = verdict.kind in ("hung", "silent", "exited") and self.rank not in verdict.culprits
        if self.emergency is not None and saves:
            survivors = [r for r in range(self.world_size) if r not in verdict.culprits]
            try:
                tag = hashlib.sha256(self._token.encode()).hexdigest()[:16]  # this attempt's keys (not the secret)
                self.emergency.save(self.store, survivors, max(self.grace, 5.0), 120.0, tag)
            except Exception:  # the store is gone or the save failed: the job ends as it would without it
                self._log(logging.ERROR, "the emergency checkpoint failed", exc_info=True)
        deadline = time.monotonic() + self.grace
        gone = set(verdict.culprits) if verdict.kind in ("exited", "silent") else set()
        pending = [f"ack/{r}" for r in range(self.world_size) if self.hosts_store and r not in gone | {self.rank}]
        with contextlib.suppress(Exception):
            while pending and time.monotonic() < deadline:
                pending = [key for key in pending if not self.store.check([key])]
                time.sleep(0.05)
        return verdict


def _marks(phase: Phase | None) -> Callable[..., None]:
    return lambda self, *args, **kwargs: self.watchdog.mark(phase)


@batch_hooks(
    "on_validation_batch_start", "on_validation_batch_end", "on_test_batch_start", "on_test_batch_end",
    "on_predict_batch_start", "on_predict_batch_end",
)  # fmt: skip
class WatchdogCallbackMixin:
    """Feeds the :class:`Watchdog` with the training thread's progress (mixed into each package's ``Callback``); the
    strategy marks the training step's phases and its end itself (no callback dispatch on them)."""

    def __init__(self, watchdog: Watchdog) -> None:
        self.watchdog = watchdog

    def on_train_start(self, *args: Any) -> None:
        self.watchdog.arm("fit")

    def on_train_end(self, *args: Any) -> None:
        self.watchdog.arm("fit", False)
        self.watchdog.emergency = None  # the fit is over: nothing left to save

    def _eval_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.watchdog.arm("eval")
        self.watchdog.mark(Phase.EVAL_LOADING, eval_batch=-1, stage=getattr(trainer.state.stage, "value", ""))

    def _eval_end(self, *args: Any) -> None:
        self.watchdog.mark(Phase.EVAL_DONE)
        self.watchdog.arm("eval", False)

    def _eval_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int, *args: Any) -> None:
        self.watchdog.mark(Phase.EVAL_STEP, eval_batch=batch_idx, stage=getattr(trainer.state.stage, "value", ""))

    def on_exception(self, trainer: pl.Trainer, pl_module: Any, exception: BaseException) -> None:
        self.watchdog.on_exception(exception)

    on_validation_start = on_test_start = on_predict_start = _eval_start
    on_validation_end = on_test_end = on_predict_end = _eval_end
    on_train_epoch_start = on_train_epoch_end = _marks(Phase.BETWEEN_BATCHES)
    on_save_checkpoint = _marks(None)  # progress, in the same phase
    on_validation_batch_start = on_test_batch_start = on_predict_batch_start = _eval_batch_start
    on_validation_batch_end = on_test_batch_end = on_predict_batch_end = _marks(Phase.EVAL_LOADING)
    # the callbacks' epoch-end hooks run before the LightningModule's
    on_validation_epoch_end = on_test_epoch_end = on_predict_epoch_end = _marks(Phase.EVAL_EPOCH_END)


class WatchdogCallback(WatchdogCallbackMixin, Callback):
    """Feeds the :class:`Watchdog` with the training thread's progress; added to the Trainer by the strategy."""
