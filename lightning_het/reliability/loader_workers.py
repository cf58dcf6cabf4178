"""DataLoader workers that ignore the preemption signals and die with their replica however it ends."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Sequence
from typing import Any

from lightning_het.reliability.preemption import PREEMPTION_SIGNALS
from lightning_het.reliability.processes import die_with_parent


class _ShieldedWorkerInit:
    """``worker_init_fn``: ignore the preemption signals, die with the replica, then run the original."""

    def __init__(self, inner: Callable[[int], Any] | None, rank: int, signals: Sequence[int]) -> None:
        self.inner = inner
        self.rank = rank
        self.signals = tuple(int(s) for s in signals)

    def __call__(self, worker_id: int) -> None:
        die_with_parent()  # a worker stuck in __getitem__ never reaches torch's own parent check
        for signum in self.signals:
            signal.signal(signum, signal.SIG_IGN)  # the worker ends with its replica (torch watches the parent)
        with contextlib.suppress(ValueError):
            signal.set_wakeup_fd(-1)  # a forked worker inherits the replica's wakeup pipe
        if self.inner is not None:
            self.inner(worker_id)
        elif int(os.environ.get("PL_SEED_WORKERS", 0)):
            from lightning.fabric.utilities.seed import pl_worker_init_function

            pl_worker_init_function(worker_id, rank=self.rank)


def shield_loader_workers(dataloader: object, rank: int, signals: Sequence[int] = PREEMPTION_SIGNALS) -> object:
    """Make ``dataloader``'s workers ignore the preemption signals and die with their replica; return it."""
    if getattr(dataloader, "num_workers", 0) and hasattr(dataloader, "worker_init_fn"):
        current = dataloader.worker_init_fn
        if not isinstance(current, _ShieldedWorkerInit):
            dataloader.worker_init_fn = _ShieldedWorkerInit(current, rank, signals)
    return dataloader
