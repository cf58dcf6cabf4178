"""Run a helper script as a multi-process Lightning job in its own session, leaving no process behind."""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_next_port = itertools.count()


def free_port() -> int:
    """A loopback port for one test job's rendezvous, free now and kept from being taken before the job binds it.

    A port the kernel hands out (``bind(0)``) lies in its ephemeral range, where any outgoing connection of a parallel
    test (Gloo opens many) may take it as a source port before the job listens on it. These ports lie below that range,
    in a slice of their own for each pytest-xdist worker, so only this worker's jobs ever use them.
    """
    first_ephemeral = 32768  # Linux's default when the range cannot be read
    with contextlib.suppress(OSError, ValueError):
        first_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    lowest = 20000  # above the ports SLURM jobs derive from their job ids (15000 + id, 12910)
    span = (first_ephemeral - lowest) // 8
    if span < 100:  # no room below the ephemeral range: the kernel's choice
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return int(sock.getsockname()[1])
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0) % 8
    for _ in range(span):
        port = lowest + worker * span + (os.getpid() + next(_next_port)) % span
        with socket.socket() as sock, contextlib.suppress(OSError):
            sock.bind(("127.0.0.1", port))
            return port
    raise RuntimeError(f"no free loopback port in {lowest + worker * span}..{lowest + (worker + 1) * span - 1}")


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group ``pgid``."""
    alive = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                alive.append(int(entry))
    return alive


def alive(pids: list[int]) -> list[int]:
    """The processes among ``pids`` that still run (zombies count as ended), whatever process group they are in."""
    running = []
    for pid in pids:
        with contextlib.suppress(OSError, IndexError):
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                running.append(pid)
    return running


@dataclass
class JobResult:
    returncode: int
    output: str
    ended: float  # wall-clock time (time.time()) when the last process holding the output ended
    survivors: list[int] = field(default_factory=list)  # processes of the job still alive after it ended


def job_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of a fresh localhost job: repo importable, its own rendezvous port, no inherited LOCAL_RANK."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    env.pop("LOCAL_RANK", None)
    env.update(extra or {})
    return env


def run_in_session(
    command: list[str], *, cwd: Path, env: dict[str, str], timeout: float, merge_stderr: bool = True
) -> subprocess.CompletedProcess:
    """Run ``command`` in a new session and wait for it; nothing of its process group outlives the call.

    A command still running after ``timeout`` seconds is killed (whole group) and reported as ``AssertionError`` with
    the tail of its output. With ``merge_stderr`` the output is all in ``stdout``.
    """
    proc = subprocess.Popen(
        command,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{command} timed out after {timeout}s:\n{out[-3000:]}\n{(err or '')[-3000:]}") from None
    finally:
        with contextlib.suppress(ProcessLookupError):  # nothing of the job may outlive the caller
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def start_job(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    """``python args...`` started in a new session with ``env``, its output (stdout and stderr) piped as text."""
    return subprocess.Popen(
        [sys.executable, *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


class OutputWatch:
    """Reads the output of a job :func:`start_job` started as it comes (a thread), so that a test can wait for a line
    while the job runs; give it to :func:`wait_job`, which then takes the output from it."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self._lines: list[str] = []
        self._closed = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(proc.stdout,), name="job-output", daemon=True)
        self._thread.start()

    def _read(self, stream: object) -> None:
        for line in stream:  # type: ignore[attr-defined]
            with self._changed:
                self._lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    @property
    def text(self) -> str:
        """The output so far."""
        with self._changed:
            return "".join(self._lines)

    def wait_for(self, pattern: str, limit: float) -> re.Match | None:
        """The first match of ``pattern`` in the output, waiting up to ``limit`` seconds for it (``None``: not there
        when the job closed its output or the time ran out)."""
        deadline = time.monotonic() + limit
        with self._changed:
            while True:
                found = re.search(pattern, "".join(self._lines))
                left = deadline - time.monotonic()
                if found or self._closed or left <= 0:
                    return found
                self._changed.wait(min(left, 1.0))

    def closed(self, limit: float) -> bool:
        """Wait up to ``limit`` seconds until every process of the job has closed its output."""
        self._thread.join(limit)
        return not self._thread.is_alive()


def wait_job(proc: subprocess.Popen, limit: float = 240, watch: OutputWatch | None = None) -> JobResult:
    """Wait for a job :func:`start_job` started: it has to end on its own within ``limit`` seconds (else
    ``AssertionError``); whatever is left of its process group 3 s later is recorded in ``survivors`` and killed.
    With ``watch``, its output is taken from that :class:`OutputWatch`."""
    try:
        if watch is None:
            output, _ = proc.communicate(timeout=limit)
        else:
            if not watch.closed(limit):
                raise subprocess.TimeoutExpired(proc.args, limit)
            proc.wait(timeout=5)
            output = watch.text
        ended = time.time()
        deadline = time.monotonic() + 3
        while group_members(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        survivors = group_members(proc.pid)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        if watch is None:
            output, _ = proc.communicate()
        else:
            watch.closed(10)
            output = watch.text
        raise AssertionError(f"job still running after {limit}s:\n{output[-4000:]}") from None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return JobResult(proc.returncode, output, ended, survivors)


def run_command(args: list[str], *, limit: float = 240, env: dict | None = None) -> JobResult:
    """``python args...`` in a new session; returns once every process of the job has closed its output (see
    :func:`wait_job`)."""
    return wait_job(start_job(args, job_env(env)), limit)
