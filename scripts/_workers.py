"""The one way the benchmark and check scripts start their worker processes and wait for them.

Each worker runs in its own session (``start_new_session``), so however the wait ends (success, a failed worker, a
timeout, Ctrl-C) every process group started here is killed before :func:`run_workers` returns or raises: nothing a
script starts outlives it. Only the standard library: the scripts import this before torch.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

__all__ = ["REPO", "Worker", "run_workers", "worker_env"]


@dataclass(frozen=True)
class Worker:
    """One process to start: its command line, its environment and the file its output goes to."""

    command: Sequence[str]
    env: Mapping[str, str]
    log: Path


def worker_env(master_addr: str, master_port: int | str, **extra: str) -> dict[str, str]:
    """This process's environment plus the rendezvous address, the repository on ``PYTHONPATH`` (first) and
    ``extra`` (e.g. ``WORLD_SIZE``, ``NODE_RANK``, ``LOCAL_RANK``)."""
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        **extra,
    }


def _tail(log: Path, chars: int = 3000) -> str:
    try:
        return log.read_text(errors="replace")[-chars:]
    except OSError as err:
        return f"(no log: {err})"


def run_workers(workers: Sequence[Worker], *, timeout: float, name: str, cwd: Path = REPO) -> None:
    """Start every worker, wait until all have exited with status 0, and end every process group started here.

    Args:
        workers: the processes, started in this order.
        timeout: seconds to wait for all of them.
        name: what the error messages call the job.
        cwd: their working directory.

    Raises:
        RuntimeError: a worker exited with a non-zero status (as soon as it did), or the timeout passed; the message
            names the worker and ends with its log's tail.
    """
    procs: list[subprocess.Popen[bytes]] = []
    logs = []
    try:
        for worker in workers:
            log = open(worker.log, "wb")  # noqa: SIM115 - closed in finally
            logs.append(log)
            procs.append(
                subprocess.Popen(
                    list(worker.command),
                    cwd=cwd,
                    env=dict(worker.env),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        deadline = time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in procs]
            failed = [i for i, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                i = failed[0]
                raise RuntimeError(
                    f"{name}: worker {i} exited with {codes[i]} (log {workers[i].log}):\n{_tail(workers[i].log)}"
                )
            if all(code == 0 for code in codes):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{name}: timed out after {timeout:.0f} s (log {workers[0].log}):\n{_tail(workers[0].log)}"
                )
            time.sleep(0.2)
    finally:
        for p in procs:  # only the process groups started here
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for log in logs:
            log.close()
