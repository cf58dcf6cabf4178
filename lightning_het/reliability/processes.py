"""Child processes of a replica: local replicas that exited, and ending a whole process tree (Linux ``/proc``)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Sequence

from lightning_het.reliability.verdicts import CHILD_INTERRUPTION_STATUS, Verdict

_PREEMPTED_EXIT_CODE = 143  # lightning_het.reliability.preemption.PREEMPTION_EXIT_CODE (128 + SIGTERM)
_PR_SET_PDEATHSIG = 1


def launched_replicas(launcher: object) -> list[subprocess.Popen]:
    """The replicas that ``launcher`` started from this process (Lightning's ``popen`` launcher: its ``procs``).

    A spawn or fork launcher's ``procs`` are the launching process's ``multiprocessing`` workers: a replica forked
    from it inherits that list (of an earlier Trainer call) but did not start them and cannot wait for them."""
    return [proc for proc in getattr(launcher, "procs", None) or [] if isinstance(proc, subprocess.Popen)]


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
    detail = "; ".join(f"rank {r} (pid {pid}) exit status {code}" for r, pid, code in exited)
    if len(kinds) == 1 and None not in kinds:
        kind = kinds.pop()
        return Verdict(str(kind), tuple(ranks), 0.0, f"replica(s) {ranks} {kind} ({detail})")
    return Verdict("exited", tuple(ranks), 0.0, f"replica(s) {ranks} exited during the run ({detail})")


def die_with_parent() -> None:
    """Ask the kernel for SIGKILL when the parent thread ends (Linux ``PR_SET_PDEATHSIG``; elsewhere nothing)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def descendants(pid: int) -> list[int]:
    """Live descendants of ``pid`` (children first) from ``/proc`` (Linux; else ``[]``); read before it ends."""
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
    """End this replica with ``code``, SIGKILLing its descendants first (workers must not outlive the job)."""
    kill_pids(descendants(os.getpid()))
    os._exit(code)


def kill_children(children: Sequence[tuple[int, subprocess.Popen]]) -> list[int]:
    """SIGKILL the local replicas still running, and every descendant of theirs; returns the ranks of those that ran."""
    killed = []
    for rank, proc in children:
        with contextlib.suppress(Exception):
            if proc.poll() is None:
                tree = descendants(proc.pid)
                proc.kill()
                kill_pids(tree)
                killed.append(rank)
    return killed


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` on this node exists and is not a zombie (``os.kill(pid, 0)``, ``/proc/<pid>/stat``)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")
