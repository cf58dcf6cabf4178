"""The one gloo harness of the test suite: run a worker function on ``world_size`` forked processes over localhost.

Each process joins a gloo process group (one intra-op thread), runs ``worker(rank, world_size)`` and saves what it
returns with ``torch.save``; the parent loads and returns the results in rank order. Forking pays the slow imports
once. Every process has ended when :func:`run_gloo` returns (``torch.multiprocessing`` joins them and raises when one
fails).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_het.cluster.rendezvous import LOOPBACK
from tests.helpers.jobs import free_port

__all__ = ["free_port", "run_gloo"]

Worker = Callable[[int, int], Any]


def _entry(rank: int, world_size: int, port: int, out: str, worker: Worker, timeout_s: float) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{LOOPBACK}:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    try:
        torch.save(worker(rank, world_size), Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_gloo(worker: Worker, world_size: int, out: Path, *, timeout_s: float = 60.0) -> list[Any]:
    """Run ``worker(rank, world_size)`` in ``world_size`` forked gloo processes; return their results by rank.

    Args:
        worker: a module-level function (what it returns must survive ``torch.save``/``torch.load``).
        world_size: number of processes (>= 1).
        out: a folder for the per-rank result files (``rank<r>.pt``).
        timeout_s: the process group's timeout, seconds (a hung collective fails the run after that long).
    """
    mp.start_processes(
        _entry, args=(world_size, free_port(), str(out), worker, timeout_s), nprocs=world_size, start_method="fork"
    )
    return [torch.load(Path(out) / f"rank{r}.pt") for r in range(world_size)]
