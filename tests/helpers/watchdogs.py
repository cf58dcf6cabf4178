"""In-process watchdog pairs for the watchdog tests: two ranks over one HashStore, exits recorded instead of taken."""

from __future__ import annotations

import threading

import torch.distributed as dist

from lightning_het.reliability.watchdog import Phase, ReplicaStatus, Watchdog


class ExitRecorder:
    """Stands in for ``os._exit``: records each exit code and sets ``done``."""

    def __init__(self) -> None:
        self.codes: list[int] = []
        self.done = threading.Event()

    def __call__(self, code: int) -> None:
        self.codes.append(code)
        self.done.set()


def watchdog_pair(
    timeout: float, *, prefix: str, start: bool = False, **watchdog_kwargs
) -> tuple[list[Watchdog], list[ExitRecorder], dist.Store]:
    """Two watchdogs (ranks 0 and 1, heartbeat every 0.05 s) over one in-memory store, and the store itself.

    ``timeout`` is in seconds; rank 0 hosts the store. ``watchdog_kwargs`` go to both watchdogs.
    """
    store = dist.HashStore()
    recorders = [ExitRecorder(), ExitRecorder()]
    dogs = [
        Watchdog(
            dist.PrefixStore(prefix, store),
            rank,
            2,
            timeout,
            interval=0.05,
            exit=recorders[rank],
            hosts_store=rank == 0,
            **watchdog_kwargs,
        )
        for rank in range(2)
    ]
    if start:
        for dog in dogs:
            dog.start()
    return dogs, recorders, store


def describe_phase(phase: Phase, batch: int, eval_stage: str = "", eval_batch: int = -1) -> str:
    """What :meth:`ReplicaStatus.describe` says of a replica in ``phase`` at ``batch``, without the replica's name."""
    status = ReplicaStatus(0, "h", 1, batch, phase, eval_stage=eval_stage, eval_batch=eval_batch)
    return status.describe().removeprefix("rank 0 on h (pid 1): ")
