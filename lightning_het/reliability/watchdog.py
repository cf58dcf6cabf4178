"""Hung- and dead-replica detection: a stalled job ends within ``timeout``, naming the replica(s) that stopped.

One :class:`Watchdog` per replica: progress markers, a heartbeat thread on the job's store, the pure :func:`judge` and
one compare-and-set abort record that ends every replica (``docs/reliability.md``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from lightning_het.reliability.emergency import EmergencyCheckpoint
from lightning_het.reliability.heartbeats import (
    BOOT_ID,
    GuardedStore,
    HeartbeatBook,
    StoreUnreachable,
    inside_torch_distributed,
    status_from_record,
)
from lightning_het.reliability.processes import check_children, exit_job, kill_children
from lightning_het.reliability.verdicts import (
    HINTS,
    JobEnded,
    Phase,
    ReplicaStatus,
    Verdict,
    exit_code_for,
    first_line,
    interruption_of,
    is_collective_failure,
    is_sigterm_exit,
    judge,
)

#: verdicts after which the survivors save an emergency checkpoint: a replica stalled, went silent or exited
EMERGENCY_KINDS = ("hung", "silent", "exited")
#: seconds the survivors wait for the writer of the emergency checkpoint
EMERGENCY_WRITE_S = 120.0

log = logging.getLogger(__name__)


class Watchdog:
    """Per-replica heartbeat thread and judge."""

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
        if timeout <= 0:
            raise ValueError(f"Expected argument `timeout` to be positive seconds, but got {timeout!r}.")
        self.store = GuardedStore(store)
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
        self._book = HeartbeatBook(
            rank, token, namespace, self._host, stale_after=max(3 * self.interval, 1.0), peers=peers
        )
        self._store_lost_since: float | None = None
        self._bugs = 0
        self._stop = threading.Event()
        self._reported = False
        self._main_ident = threading.get_ident()
        #: the emergency checkpoint a verdict against other replicas saves (set by the owner; ``None``: none)
        self.emergency: EmergencyCheckpoint | None = None
        self._thread = threading.Thread(target=self._run, name=f"lightning-het-watchdog-{rank}", daemon=True)

    def __deepcopy__(self, memo: dict[int, Any]) -> Watchdog:
        """Not copied (this process's heartbeat thread, store connection and lock):
        a deep copy of the Trainer, of its callbacks or of its strategy shares this one, as it shares the process
        group."""
        return self

    def _write(self, key: str, payload: str) -> None:
        self.store.set(key, self._book.sign(key, payload))

    def start(self) -> None:
        """Publish the first heartbeat and start the thread."""
        self._main_ident = threading.get_ident()
        self._started = self._book.started = time.monotonic()
        self._publish()
        self._thread.start()
        log.debug("watchdog started on rank %d: timeout %.1f s, heartbeat every %.2f s", self.rank, self.timeout,
                  self.interval)  # fmt: skip

    @property
    def running(self) -> bool:
        """Whether the heartbeat thread runs (started and not stopped)."""
        return self._thread.is_alive() and not self._stop.is_set()

    @property
    def phase(self) -> Phase:
        """Where the training thread was at its last :meth:`mark`."""
        return self._progress[2]

    def mark(self, phase: Phase, *, new_batch: bool = False, eval_batch: int | None = None, stage: str = "") -> None:
        """Record progress of the training thread (cheap; called from Trainer hooks)."""
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
        """Normal end of this replica's run: say so, then (``wait``) wait until every replica has finished."""
        self.mark(Phase.TEARDOWN)
        if self._state == "running":
            self._state = "finished"
        try:
            self._publish()
            while wait and not self._stop.is_set():
                if all(s.state == "finished" for s in self._statuses() if s.rank != self.rank):
                    break
                time.sleep(min(self.interval, 0.2))
        except StoreUnreachable:
            pass
        self.stop()

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
        """The training thread is raising: make sure the whole job ends, and say who is to blame."""
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
                self._save_emergency(record)
                return record
            if interruption is None and is_collective_failure(exception):
                verdict = self._judge_collective_failure(exception)
            else:
                self._state, self._error = interruption or "failed", first_line(exception)
                self._publish()
                verdict = judge(self._statuses(), self.timeout)
            if verdict is not None:
                self._standing = self._decide(verdict)
                self._save_emergency(self._standing)
        except StoreUnreachable as err:  # its host (rank 0) has ended
            if self.rank != 0:
                message = (
                    f"replica 0 ended: replica {self.rank} lost its connection to the rendezvous store that"
                    f" replica 0 hosts ({err}) while raising {first_line(exception)}"
                )
                self._standing = Verdict("lost_store", (0,), 0.0, message)
                self._report(self._standing)
        except Exception:  # a bug of the watchdog: report it, let the original exception propagate
            log.exception("[rank %d] lightning_het watchdog: internal error while handling an exception", self.rank)
        return self._standing

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
                self._store_lost_since = self._store_lost_since or time.monotonic()
                lost = time.monotonic() - self._store_lost_since
                if lost > self.timeout:
                    message = (
                        f"replica {self.rank} lost contact with the job's rendezvous store for {lost:.1f} s ({err});"
                        " the replica hosting it (rank 0) ended or the network failed"
                    )
                    self._end(Verdict("lost_store", (0,), lost, message))
                    return
            except Exception:  # a bug of the watchdog itself: never a reason to end a healthy job
                self._bugs += 1
                if self._bugs == 1:
                    log.exception(
                        "[rank %d] lightning_het watchdog: internal error in the heartbeat thread; the job goes on"
                        " (this replica's stalls may go unnoticed until it recovers). Please report this.",
                        self.rank,
                    )

    def _record(self) -> dict[str, Any]:
        """This replica's heartbeat record (without its ``beat`` number)."""
        seq, batch, phase, _ = self._progress
        stage, eval_batch = self._eval_where
        frame = sys._current_frames().get(self._main_ident)
        return {
            "seq": seq,
            "batch": batch,
            "phase": int(phase),
            "eval_stage": stage,
            "eval_batch": eval_batch,
            "armed": bool(self._armed),
            "waiting": self._waited_in_collective or inside_torch_distributed(frame),
            "state": self._state,
            "error": self._error,
            "host": self._host,
            "boot": BOOT_ID,
            "rank": self.rank,
            "pid": self._pid,
        }

    def _publish(self) -> None:
        self._beat += 1
        self._write(f"hb/{self.rank}", json.dumps({"beat": self._beat, **self._record()}))

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
        children = dict(self._children())
        statuses = []
        for r in range(self.world_size):
            if r == self.rank:
                statuses.append(self._own_status(now))
                continue
            status = self._book.status(r, raw.get(r), now)
            child = children.get(r)
            statuses.append(status if child is None else self._book.child_status(status, child.poll()))
        return statuses

    def _own_status(self, now: float) -> ReplicaStatus:
        return status_from_record(self.rank, self._record(), 0.0, now - self._progress[3])

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
        cause = first_line(exception)
        if verdict is None:
            return Verdict("hung", (), 0.0, f"a collective failed on replica {self.rank} ({cause})")
        return Verdict(verdict.kind, verdict.culprits, verdict.seconds, f"{verdict.message}; on replica"
                       f" {self.rank} a collective failed: {cause}")  # fmt: skip

    def _abort_record(self) -> Verdict | None:
        if not self.store.check(["abort"]):
            return None
        payload = self._book.verify("abort", self.store.get("abort"))
        return None if payload is None else Verdict.from_json(payload)

    def _decide(self, verdict: Verdict) -> Verdict:
        """Publish ``verdict`` unless another replica already did; return the one that stands."""
        record = self._book.sign("abort", verdict.to_json())
        current = self.store.compare_set("abort", "", record)
        payload = self._book.verify("abort", current)  # None: the signature does not match
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
            f" s, exit status {exit_code_for(verdict)}). HINT: {HINTS.get(verdict.kind, HINTS['hung'])}"
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

    def _save_emergency(self, verdict: Verdict) -> None:
        """A replica died or hung: the survivors save the last step they all completed (:mod:`.emergency`)."""
        if self.emergency is None or verdict.kind not in EMERGENCY_KINDS or self.rank in verdict.culprits:
            return
        survivors = [r for r in range(self.world_size) if r not in verdict.culprits]
        try:
            tag = hashlib.sha256(self._token.encode()).hexdigest()[:16]  # this attempt's keys (not the secret)
            self.emergency.save(self.store, survivors, max(self.grace, 5.0), EMERGENCY_WRITE_S, tag)
        except Exception:  # the store is gone or the save failed: the job ends as it would without it
            log.exception("[rank %d] lightning_het watchdog: the emergency checkpoint failed", self.rank)

    def _end(self, verdict: Verdict) -> None:
        """Heartbeat thread: end this process (unless its training thread is already raising)."""
        self._report(verdict)
        self._acknowledge()
        self._save_emergency(verdict)
        if self.hosts_store:
            with contextlib.suppress(Exception):
                self._await_acknowledgements(verdict)
        # the training thread is unwinding its own exception: let it end the process once the Trainer tore down (the
        # exception then reaches the caller, who decides); end it here only if the teardown hangs
        if self._local_failure and self._stop.wait(max(self.timeout, 10.0)):
            return
        kill_children(self._children())
        sys.stdout.flush()
        sys.stderr.flush()
        self._exit(exit_code_for(verdict))
