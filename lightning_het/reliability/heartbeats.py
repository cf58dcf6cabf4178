"""The watchdog's heartbeat records in the job's store: the guarded store connection, reading a record back into a
:class:`~lightning_het.reliability.verdicts.ReplicaStatus`, and whether a thread's stack is waiting in
``torch.distributed``."""

from __future__ import annotations

import os
from typing import Any

from lightning_het.reliability.verdicts import Phase, ReplicaStatus

__all__ = ["GuardedStore", "StoreUnreachable", "inside_torch_distributed", "status_from_record"]


def inside_torch_distributed(frame: Any, depth: int = 12) -> bool:
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


class GuardedStore:
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


def status_from_record(rank: int, data: dict[str, Any], silent_for: float, stalled_for: float) -> ReplicaStatus:
    """The :class:`ReplicaStatus` of replica ``rank`` from its (verified) heartbeat record ``data``."""
    return ReplicaStatus(
        rank=rank,
        host=data["host"],
        pid=data["pid"],
        batch=data["batch"],
        phase=Phase(data["phase"]),
        armed=data["armed"],
        waiting=data["waiting"],
        state=data["state"],
        silent_for=silent_for,
        stalled_for=stalled_for,
        error=data["error"],
        eval_stage=data.get("eval_stage", ""),
        eval_batch=data.get("eval_batch", -1),
    )
