"""The watchdog's signed records in the job's store, and one observer's view of the others' heartbeats."""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from lightning_het.cluster.rendezvous import sign, verify
from lightning_het.reliability.processes import process_alive
from lightning_het.reliability.verdicts import Phase, ReplicaStatus

log = logging.getLogger("lightning_het.reliability.watchdog")


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        return ""


#: this machine's boot id (Linux; else ``""``): with the host name, tells whether a replica runs on this node.
BOOT_ID = _boot_id()


def warn(message: str) -> None:
    """Log ``message`` as a warning, or print it to stderr when no logging handler is configured."""
    if log.hasHandlers():
        log.warning(message)
    else:
        print(message, file=sys.stderr, flush=True)


_TORCH_DISTRIBUTED = os.sep + os.path.join("torch", "distributed") + os.sep
#: packages whose barriers call a process group's C++ method directly (no Python frame in ``torch.distributed``)
_LIGHTNING_PACKAGES = tuple(os.sep + name + os.sep for name in ("lightning", "pytorch_lightning", "lightning_fabric",
                                                                 "lightning_het"))  # fmt: skip
#: their functions that wait for every replica (``strategy.barrier``, ``_sync_dir``, ``_InfiniteBarrier``)
_WAITING_FUNCTIONS = frozenset({"barrier", "_sync_dir", "_InfiniteBarrier.__exit__", "_InfiniteBarrier.__call__"})
_BARRIER_FILE = os.path.join("fabric", "utilities", "distributed.py")  # where _InfiniteBarrier lives


def _waits(code: Any) -> bool:
    if _TORCH_DISTRIBUTED in code.co_filename:
        return True
    if not any(package in code.co_filename for package in _LIGHTNING_PACKAGES):
        return False
    if code.co_name in _WAITING_FUNCTIONS or getattr(code, "co_qualname", None) in _WAITING_FUNCTIONS:
        return True
    # Python 3.10 has no co_qualname: the _InfiniteBarrier methods are known by their file
    infinite_barrier = code.co_filename.endswith(_BARRIER_FILE) and code.co_name in ("__exit__", "__call__")
    return not hasattr(code, "co_qualname") and infinite_barrier


def inside_torch_distributed(frame: Any, depth: int = 12) -> bool:
    """Whether one of the innermost ``depth`` frames waits for other replicas (a collective or a barrier)."""
    while frame is not None and depth > 0:
        if _waits(frame.f_code):
            return True
        frame = frame.f_back
        depth -= 1
    return False


class StoreUnreachable(RuntimeError):
    """A call to the job's store failed: its host (rank 0) ended, or the network between the nodes failed."""


class GuardedStore:
    """The store, every failing call raising :class:`StoreUnreachable` (a lost store, not a watchdog bug)."""

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


def status_from_record(rank: int, data: dict[str, Any], silent_for: float, stalled_for: float) -> ReplicaStatus:
    """The :class:`ReplicaStatus` of replica ``rank`` from its (verified) heartbeat record ``data``."""
    fields = {key: data[key] for key in ("host", "pid", "batch", "armed", "waiting", "state", "error")}
    evaluation = {"eval_stage": data.get("eval_stage", ""), "eval_batch": data.get("eval_batch", -1)}
    phase = Phase(data["phase"])
    return ReplicaStatus(rank=rank, phase=phase, silent_for=silent_for, stalled_for=stalled_for, **fields, **evaluation)


class HeartbeatBook:
    """One observer's knowledge of the other replicas' heartbeats; ages use the observer's monotonic clock."""

    def __init__(
        self,
        rank: int,
        token: str,
        namespace: str,
        host: str,
        stale_after: float,
        alive: Callable[[int], bool] = process_alive,
        peers: dict[int, tuple[str, str, int]] | None = None,
    ) -> None:
        self.peers = peers or {}
        self.rank, self.token, self.namespace, self.host = rank, token, namespace, host
        self.stale_after = stale_after
        self.alive = alive
        self.started = 0.0
        self.seen: dict[int, tuple[Any, float, Any, float, dict[str, Any] | None]] = {}
        self.tampered: set[str] = set()
        self._hidden: set[int] = set()
        self._forgeries = 0

    def sign(self, key: str, payload: str) -> str:
        return sign(self.token, self.namespace + key, payload) if self.token else payload

    def verify(self, key: str, raw: Any) -> str | None:
        """The payload of a record read from ``key``, or ``None`` when its signature does not match (ignored)."""
        if not self.token:
            return raw.decode() if isinstance(raw, bytes) else raw
        payload = verify(self.token, self.namespace + key, raw)
        if payload is None:
            self._forgeries += 1
            if self._forgeries == 1:
                warn(
                    f"[rank {self.rank}] lightning_het watchdog: ignored a record under {key!r} without a valid"
                    " signature (written by a client outside the job?)"
                )
        return payload

    def tamper(self, key: str, what: str) -> None:
        """Note tampering with ``key`` (one warning per key)."""
        if key not in self.tampered:
            self.tampered.add(key)
            warn(
                f"[rank {self.rank}] lightning_het watchdog: tampering with the job's store detected under {key!r}:"
                f" {what}; ignored, the last genuine record is kept (a client outside the job writes to the store)"
            )

    def genuine(self, r: int, raw: Any) -> dict[str, Any] | None:
        """Replica ``r``'s record ``raw`` (``None``: the key is missing) if it is genuine and fresh, else ``None``."""
        key = f"hb/{r}"
        last = self.seen.get(r, (None, 0.0, None, 0.0, None))[4]
        if raw is None:
            if last is not None:
                self.tamper(key, "the record was deleted")
            return None
        payload = self.verify(key, raw)
        if payload is None:
            self.tamper(key, "a record without a valid signature")
            return None
        try:
            data = json.loads(payload)
        except ValueError:
            self.tamper(key, "a record that is not a heartbeat")
            return None
        if data.get("rank", r) != r:
            self.tamper(key, f"a record of replica {data.get('rank')}")
            return None
        if last is not None and data["beat"] < last["beat"]:
            self.tamper(key, f"an older record replayed (beat {data['beat']} after {last['beat']})")
            return None
        return data

    def status(self, r: int, raw: Any, now: float) -> ReplicaStatus:
        """Replica ``r``'s status from the record just read (``None``: missing), judged against what was seen."""
        data = self.genuine(r, raw)
        old = self.seen.get(r)
        if data is None and old is not None and old[4] is not None:
            data = old[4]  # a forged, replayed, deleted or garbled record: keep the last genuine one
        beat, seq = (data["beat"], data["seq"]) if data else (None, None)
        if old is None:
            old = (beat, self.started, seq, self.started, None)
        beat_changed = old[1] if beat == old[0] else now
        seq_changed = old[3] if seq == old[2] else now
        self.seen[r] = (beat, beat_changed, seq, seq_changed, data)
        if data is None:
            status = ReplicaStatus(r, silent_for=now - beat_changed, stalled_for=now - seq_changed)
        else:
            status = status_from_record(r, data, now - beat_changed, now - seq_changed)
        identity = self.peers.get(r) or (data and (data.get("host"), data.get("boot", ""), data["pid"]))
        if status.silent_for > self.stale_after and identity and self._alive_here(*identity):
            self._note_hidden(r, status.silent_for, identity[2])
            return replace(status, silent_for=0.0, stalled_for=0.0)
        return status

    def child_status(self, status: ReplicaStatus, exit_code: int | None) -> ReplicaStatus:
        """Second signal for a replica this process launched: exited 0 is finished; running is not silent."""
        if exit_code == 0:
            return replace(status, state="finished")
        if exit_code is None and status.silent_for > self.stale_after:
            self._note_hidden(status.rank, status.silent_for, status.pid)
            return replace(status, silent_for=0.0, stalled_for=0.0)
        return status

    def _alive_here(self, host: str, boot: str, pid: int) -> bool:
        """The second signal: a replica on this node whose process is alive is not dead, whatever its heartbeat."""
        return host == self.host and boot == BOOT_ID and self.alive(int(pid))

    def _note_hidden(self, r: int, seconds: float, pid: int) -> None:
        if r in self._hidden:
            return
        self._hidden.add(r)
        warn(
            f"[rank {self.rank}] lightning_het watchdog: no new heartbeat of replica {r} for {seconds:.1f} s, but its"
            f" process (pid {pid}) on this node is alive: not presumed dead (its heartbeat under 'hb/{r}' is hidden"
            " by tampering with the store, or the process is frozen)"
        )
