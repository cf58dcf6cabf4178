"""Job lifecycle: no orphans from any phase, a rendezvous no stranger can reach, failures reported as what they are.

The multi-process tests run the harness's ``lifecycle`` job (2 CPU replicas, ``timeout=5``) with a replica that
hangs or dies in one phase, and check the exit status, the message, the time to end and that no process is left. The
same job on the standalone ``pytorch_lightning`` package (``timeout=10``, ``pytorch_lightning.Trainer``, the strategy
from :mod:`lightning_het.pl`) must end the same way.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from lightning_het.cluster import rendezvous
from lightning_het.cluster.rendezvous import create_store, listen_address, sign, verify
from lightning_het.comm import hierarchical as hooks
from lightning_het.reliability.launch import shield_loader_workers
from lightning_het.reliability.output_dir import OutputDirError, check_output_dir
from lightning_het.reliability.watchdog import (
    INTERRUPTED_EXIT_CODE,
    WATCHDOG_EXIT_CODE,
    Phase,
    ReplicaStatus,
    Verdict,
    Watchdog,
    end_children,
    judge,
)
from tests.helpers import harness
from tests.helpers.jobs import OutputWatch, alive, free_port, job_env, run_in_session, start_job, wait_job
from tests.helpers.side_by_side import Results, SideBySide
from tests.helpers.tiny import FLAVOUR_ENV
from tests.helpers.watchdogs import ExitRecorder, describe_phase, watchdog_pair

TIMEOUT = 5.0
#: seconds each training step of the Ctrl-C jobs sleeps (of the strangers' job: twice that): their six steps (6 s)
#: outlast the test's reaction to `training.json` even on a loaded machine
STEP_SLEEP = 1.0
STARTUP = 30.0  # startup_timeout of the launch-phase cases
#: startup_timeout when replica 1 hangs at launch: the job waits all of it, for a replica that never comes (it runs
#: first, while the other jobs run beside it); it must exceed what replica 1 takes to import (it hangs only then), or
#: the launcher would end the job before the fault fired (imports take ~4 s on an idle 2-core machine, several times
#: that while other jobs import beside it)
HANG_STARTUP = 30.0
#: the strategy `timeout` of the fault jobs on each Lightning package (the standalone one: what its users reported)
FLAVOUR_TIMEOUT = {"lightning": TIMEOUT, "pytorch_lightning": 10.0}


# ---------------------------------------------------------------------------------------------------- signing
class TestSigning:
    def test_round_trip_and_forgeries(self):
        record = sign("secret", "abort", '{"kind": "hung"}')
        assert verify("secret", "abort", record) == '{"kind": "hung"}'
        assert verify("secret", "abort", record.encode()) == '{"kind": "hung"}'
        assert verify("other", "abort", record) is None  # another job's token
        assert verify("secret", "hb/1", record) is None  # moved to another key
        assert verify("secret", "abort", '{"kind": "hung"}') is None  # unsigned
        assert verify("secret", "abort", b"\xff\xfe") is None

    def test_job_token_is_generated_once(self):
        environ: dict[str, str] = {}
        token = rendezvous.ensure_job_token(environ)
        assert len(token) == 64 and environ[rendezvous.TOKEN_ENV] == token
        assert rendezvous.ensure_job_token(environ) == token


# ---------------------------------------------------------------------------------------------------- rendezvous
def _listeners(port: int) -> list[str]:
    """Local addresses listening on ``port`` (from /proc/net/tcp and tcp6)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                address, hex_port = fields[1].rsplit(":", 1)
                if fields[3] == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                    found.append(address)
    return found


_LOOPBACK_HEX = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}


class TestRendezvous:
    def test_listen_address(self):
        assert listen_address(1, "node07.example") == "127.0.0.1"  # single node: loopback whatever MASTER_ADDR says
        assert listen_address(2, "127.0.0.1") == "127.0.0.1"
        assert listen_address(2, "localhost") in ("127.0.0.1", "::1")
        with pytest.raises(ValueError, match=r"MASTER_ADDR='no-such-host\.invalid'"):
            listen_address(2, "no-such-host.invalid")

    def test_single_node_store_listens_on_loopback_only(self):
        port = free_port()
        store = create_store(
            master_addr="127.0.0.1", port=port, rank=0, world_size=2, num_nodes=1, timeout=timedelta(seconds=10)
        )
        client = create_store(
            master_addr="ignored-on-one-node", port=port, rank=1, world_size=2, num_nodes=1,
            timeout=timedelta(seconds=10),
        )  # fmt: skip
        client.set("k", "v")
        assert store.get("k") == b"v"
        listeners = _listeners(port)
        assert listeners and set(listeners) <= _LOOPBACK_HEX, listeners

    def test_sockets_stay_on_loopback_for_one_node(self):
        environ: dict[str, str] = {"NCCL_SOCKET_IFNAME": "eth9"}
        rendezvous.keep_sockets_local(1, environ)
        assert environ["GLOO_SOCKET_IFNAME"] == "lo"
        assert environ["NCCL_SOCKET_IFNAME"] == "eth9"  # the user's choice stands
        several: dict[str, str] = {}
        rendezvous.keep_sockets_local(2, several)
        assert several == {}


# ---------------------------------------------------------------------------------------------------- watchdog
def _pair(timeout: float = 30.0, token: str = "t0k3n") -> tuple[list[Watchdog], list[ExitRecorder], dist.Store]:
    return watchdog_pair(timeout, prefix="w/", start=True, token=token)


class TestWatchdog:
    def test_unsigned_verdicts_and_heartbeats_are_ignored(self, caplog):
        dogs, recorders, store = _pair()
        foreign = dist.PrefixStore("w/", store)
        forged = Verdict("hung", (1,), 9.0, "a stranger says so").to_json()
        foreign.set("abort", forged)
        foreign.set("hb/1", json.dumps({"state": "failed"}))
        time.sleep(0.5)
        assert not any(r.codes for r in recorders)
        assert "without a valid signature" in caplog.text
        # a genuine verdict still gets through, replacing the forged record
        dogs[1].on_exception(RuntimeError("CUDA out of memory"))
        assert recorders[0].done.wait(5) and recorders[0].codes == [WATCHDOG_EXIT_CODE]
        assert Verdict.from_json(verify("t0k3n", "abort", foreign.get("abort"))).culprits == (1,)
        for dog in dogs:
            dog.stop()

    def test_a_bug_in_the_thread_is_reported_not_fatal(self, monkeypatch, caplog):
        def broken(*args, **kwargs):
            raise KeyError("bug")

        monkeypatch.setattr("lightning_het.reliability.watchdog.judge", broken)
        with caplog.at_level(logging.ERROR):
            dogs, recorders, _ = _pair(timeout=0.2)
            time.sleep(0.8)  # several heartbeats, well past `timeout`
        assert all(dog._thread.is_alive() for dog in dogs)
        assert not any(r.codes for r in recorders)
        assert caplog.text.count("internal error in the heartbeat thread") == 2  # once per replica
        for dog in dogs:
            dog.stop()

    def test_ctrl_c_is_an_interruption_not_a_failure(self):
        dogs, recorders, _ = _pair()
        verdict = dogs[1].on_exception(KeyboardInterrupt())
        assert verdict is not None and verdict.kind == "interrupted" and verdict.exit_code == 130
        assert recorders[0].done.wait(5) and recorders[0].codes == [INTERRUPTED_EXIT_CODE]
        for dog in dogs:
            dog.stop()

    def test_no_exit_handler_ends_a_caller_that_caught_the_exception(self, monkeypatch):
        registered = []
        monkeypatch.setattr("atexit.register", lambda *a, **k: registered.append(a))
        dogs, _, _ = _pair(timeout=0.5)
        dogs[0].on_exception(RuntimeError("[gloo] Connection closed by peer"))
        assert registered == []
        for dog in dogs:
            dog.stop()

    def test_finish_waits_for_every_replica(self):
        dogs, recorders, _ = _pair()
        waiter = threading.Thread(target=dogs[0].finish)
        waiter.start()
        time.sleep(0.4)
        assert waiter.is_alive()  # replica 1 is still running
        dogs[1].finish()
        waiter.join(5)
        assert not waiter.is_alive() and not any(r.codes for r in recorders)


class TestReports:
    def test_evaluation_batch_index(self):
        assert describe_phase(Phase.EVAL_STEP, 6, "validate", 1) == (
            "in validation_step of evaluation batch 1 (after training batch 6)"
        )
        assert describe_phase(Phase.EVAL_LOADING, 0, "test", 2) == "loading evaluation batch 3 for test_step"
        assert describe_phase(Phase.TRAINING_STEP, 4) == "in training_step of batch 4"
        assert "profiling" in describe_phase(Phase.PROFILING, 0)

    def test_stuck_in_profiling_is_named(self):
        statuses = [
            ReplicaStatus(0, phase=Phase.PROFILING, waiting=True, stalled_for=9.0),
            ReplicaStatus(1, phase=Phase.PROFILING, stalled_for=9.0),
        ]
        verdict = judge(statuses, TIMEOUT)
        assert verdict.culprits == (1,) and "rank 1 on ? (pid 0): profiling the training step" in verdict.message

    def test_stuck_in_teardown_while_the_others_finished(self):
        statuses = [
            ReplicaStatus(0, phase=Phase.TEARDOWN, state="finished", stalled_for=9.0),
            ReplicaStatus(1, phase=Phase.TEARDOWN, stalled_for=9.0),
        ]
        verdict = judge(statuses, TIMEOUT)
        assert verdict.culprits == (1,) and "in teardown" in verdict.message


# ---------------------------------------------------------------------------------------------------- comm hook
class _Done:
    def wait(self):
        return True


def test_hierarchical_sum_that_fails_hands_on_its_turn(monkeypatch):
    """A sum whose intra-node reduce fails must reach its future, and not leave later sums waiting for their turn."""
    calls = {"reduce": 0}

    def reduce(*args, **kwargs):
        calls["reduce"] += 1
        if calls["reduce"] == 1:
            raise RuntimeError("reduce failed")
        return _Done()

    monkeypatch.setattr(dist, "reduce", reduce)
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: _Done())
    monkeypatch.setattr(dist, "broadcast", lambda *a, **k: _Done())
    groups = SimpleNamespace(is_leader=True, num_nodes=2, node_size=2, leader=0, intra_group=None,
                             intra_bcast_group=None, leader_group=None, world_size=4)  # fmt: skip
    state = hooks.HierarchicalState(groups)
    first = hooks.hierarchical_sum(state, torch.ones(2))
    second = hooks.hierarchical_sum(state, torch.ones(2))
    with pytest.raises(RuntimeError, match="reduce failed"):
        first.wait()
    assert torch.equal(second.wait(), torch.ones(2)) and calls["reduce"] == 2
    state.stop()


# ---------------------------------------------------------------------------------------------------- process trees
_GRANDCHILD = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(child.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_killing_a_replica_kills_its_descendants():
    """A replica's children (DataLoader or compiler workers) must not outlive it, reparented to init."""
    replica = subprocess.Popen([sys.executable, "-c", _GRANDCHILD], stdout=subprocess.PIPE, text=True)
    grandchild = int(replica.stdout.readline())
    try:
        assert end_children([(1, replica)]) == [1]
        replica.wait(timeout=10)
        deadline = time.monotonic() + 10
        while alive([grandchild]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert alive([grandchild]) == []
    finally:
        for pid in (replica.pid, grandchild):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        replica.stdout.close()
        replica.wait()


def _replica_with_a_loader_worker(record: Path) -> None:
    """A replica whose DataLoader worker (a fork of it) runs the shielded ``worker_init_fn``, as the worker does first,
    then sleeps; once the worker has run it, the replica writes the worker's pid to ``record`` and ends."""
    loader = shield_loader_workers(DataLoader(range(4), num_workers=1), rank=0)
    ready, told = os.pipe()
    worker = os.fork()
    if worker == 0:
        try:
            loader.worker_init_fn(0)
            os.write(told, b"x")
            time.sleep(600)
        finally:
            os._exit(0)
    os.close(told)  # a worker that ended without telling: the read below finds the pipe closed
    assert os.read(ready, 1) == b"x"
    record.write_text(str(worker))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG")
def test_a_loader_worker_dies_with_its_replica(tmp_path):
    """The replica is a fork of this process (it has imported all it needs): it ends, and its worker must end with
    it."""
    replica = os.fork()
    if replica == 0:
        status = 1
        try:
            _replica_with_a_loader_worker(tmp_path / "worker")
            status = 0
        finally:
            os._exit(status)
    _, status = os.waitpid(replica, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    worker = int((tmp_path / "worker").read_text())
    try:
        deadline = time.monotonic() + 10
        while alive([worker]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert alive([worker]) == []
    finally:
        with contextlib.suppress(OSError):
            os.kill(worker, signal.SIGKILL)


# ---------------------------------------------------------------------------------------------------- output dir
class TestOutputDir:
    def test_created_and_writable(self, tmp_path):
        assert check_output_dir(tmp_path / "a" / "b") == (tmp_path / "a" / "b").absolute()
        assert list((tmp_path / "a" / "b").iterdir()) == []  # the probe is gone

    def test_missing_and_not_creatable(self, tmp_path):
        (tmp_path / "file").write_text("x")
        with pytest.raises(OutputDirError, match=r"'.*/file/out' does not exist and cannot be created"):
            check_output_dir(tmp_path / "file" / "out")

    def test_not_writable(self):
        with pytest.raises(OutputDirError, match=r"'/proc/self' is not writable"):
            check_output_dir("/proc/self")

    def test_disk_full(self, tmp_path, monkeypatch):
        monkeypatch.setattr("shutil.disk_usage", lambda path: SimpleNamespace(free=2**20, total=2**30, used=0))
        with pytest.raises(OutputDirError, match=r"only 1.0 MiB free"):
            check_output_dir(tmp_path)


# ---------------------------------------------------------------------------------------------------- real jobs
def _start(out: Path, cfg: dict, flavour: str = "lightning") -> tuple[subprocess.Popen, dict[str, str]]:
    """Start the job on the Lightning package ``flavour`` (Ctrl-C does in it what it does in a terminal's foreground
    job, even where this process inherited SIGINT ignored: the job resets it)."""
    env = job_env({FLAVOUR_ENV: flavour})
    return start_job(harness.command("lifecycle", out, cfg), env), env


def _finish(
    proc: subprocess.Popen, limit: float = 240, watch: OutputWatch | None = None
) -> tuple[int, str, float, list[int]]:
    """Wait for the job; return (status, output, end time, processes of the job still alive 3 s later)."""
    job = wait_job(proc, limit, watch)
    return job.returncode, job.output, job.ended, job.survivors


def _wait_for(path: Path, proc: subprocess.Popen, limit: float = 180) -> None:
    deadline = time.monotonic() + limit
    while not path.exists():
        assert proc.poll() is None, f"the job ended before {path.name} appeared"
        assert time.monotonic() < deadline, f"{path.name} did not appear within {limit}s"
        time.sleep(0.1)


@dataclass
class Ended:
    """A job that ended: its directory, exit status, output, end time (``time.time()``), the processes of its group
    still alive 3 s later, and what the job's test recorded besides."""

    out: Path
    status: int
    output: str
    ended: float
    survivors: list[int]
    extra: dict = field(default_factory=dict)

    def json(self, name: str) -> dict:
        return json.loads((self.out / name).read_text())


def _run_to_end(out: Path, cfg: dict, flavour: str = "lightning", limit: float = 240) -> Ended:
    proc, _ = _start(out, cfg, flavour)
    return Ended(out, *_finish(proc, limit))


#: the real jobs of this module, each named after the test that checks it: independent, and mostly waiting (for a
#: hung replica's ``timeout``, a rendezvous, a sleeping step), so they run side by side, longest first
JOBS = SideBySide(width=3)


@pytest.fixture(scope="module")
def ended(request, tmp_path_factory) -> Results:
    """The :class:`Ended` of every job a selected test of this module checks."""
    return JOBS.run(request, tmp_path_factory)


PHASE_CASES = [
    # (where, kind, rank, what the message must name)
    ("launch", "exit", 1, "replica(s) [1] exited"),
    ("launch", "hang", 1, f"joined the rendezvous within {HANG_STARTUP:g} s"),  # replica 1 never joins
    ("setup", "hang", 1, "rank 1 on"),
    ("setup", "exit", 1, "replica(s) [1] exited"),
    ("profiling", "hang", 1, "in training_step of batch 2"),  # batch_idx 1: the first steps profile, in the loop
    ("train", "exit", 0, None),  # the launching process dies: its replica must die with it
    ("eval", "hang", 1, "in validation_step of evaluation batch 1"),
    ("teardown", "hang", 1, "in teardown"),
    ("teardown", "exit", 1, "replica(s) [1] exited"),
]
#: the standalone pytorch_lightning package: a replica that hangs, or dies, while the others train
PL_PHASE_CASES = [
    ("train", "hang", 1, "in training_step of batch"),
    ("train", "exit", 1, "replica(s) [1] exited"),
]
FAULT_CASES = [
    *(pytest.param("lightning", *case, id=f"{case[0]}-{case[1]}") for case in PHASE_CASES),
    *(pytest.param("pytorch_lightning", *case, id=f"pytorch_lightning-{case[0]}-{case[1]}") for case in PL_PHASE_CASES),
]


def _fault_cfg(flavour: str, where: str, kind: str, rank: int) -> tuple[dict, float]:
    """The job's config and the seconds it may take from the fault to its end."""
    timeout = FLAVOUR_TIMEOUT[flavour]
    cfg = {"timeout": timeout, "fault": {"kind": kind, "rank": rank, "where": where}}
    limit = timeout + 30  # from the fault to the end of the job
    if where == "launch":
        cfg["startup_timeout"] = HANG_STARTUP if kind == "hang" else STARTUP
        limit = cfg["startup_timeout"] + 30  # a replica that never joins is noticed when the rendezvous times out
    return cfg, limit


def _register_fault_cases() -> None:
    # the hang at launch waits out its whole start-up timeout: it goes first
    cases = sorted(FAULT_CASES, key=lambda case: case.values[1:3] != ("launch", "hang"))
    for case in cases:
        flavour, where, kind, rank, _ = case.values
        if flavour != "lightning" and importlib.util.find_spec(flavour) is None:
            continue  # the test skips
        name = f"test_fault_in_any_phase_ends_the_job_without_orphans[{case.id}]"
        JOBS.add(name, functools.partial(_run_to_end, cfg=_fault_cfg(flavour, where, kind, rank)[0], flavour=flavour))


_register_fault_cases()


@pytest.mark.slow
@pytest.mark.parametrize(("flavour", "where", "kind", "rank", "named"), FAULT_CASES)
def test_fault_in_any_phase_ends_the_job_without_orphans(ended, request, flavour, where, kind, rank, named):
    if flavour != "lightning":
        pytest.importorskip(flavour)
    limit = _fault_cfg(flavour, where, kind, rank)[1]
    run = ended[request.node.name]
    status, out = run.status, run.output
    assert (run.out / "fault.json").exists(), f"the fault did not fire (status {status})\n{out[-3000:]}"
    fault = run.json("fault.json")
    print(f"{flavour} {where}-{kind}: status {status}, job ended {run.ended - fault['time']:.1f} s after the fault")
    assert run.survivors == [], out[-3000:]
    if (run.out / "training.json").exists():  # every replica's pid, whatever process group it may have moved to
        pids = run.json("training.json")["pids"]
        assert len(pids) == 2 and alive(pids) == [], out[-3000:]
    assert run.ended - fault["time"] < limit, f"ended {run.ended - fault['time']:.1f}s after the fault\n{out[-3000:]}"
    if rank == 0:
        assert status == 3  # the launching process's own exit status
        return
    assert status == WATCHDOG_EXIT_CODE, out[-3000:]
    assert named in out, out[-3000:]
    if where != "launch" or kind != "hang":  # a replica that never joined cannot be told apart from a slow one
        assert f"replica(s) [{rank}]" in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]


BLAME_CASES = {"prepare_data-rank0": ("prepare_data", 0), "validation_epoch_end-rank1": ("epoch_end", 1)}
for _id, (_where, _rank) in BLAME_CASES.items():
    JOBS.add(
        f"test_only_the_stuck_replica_is_blamed_not_the_one_waiting_in_a_barrier[{_id}]",
        functools.partial(
            _run_to_end, cfg={"timeout": TIMEOUT, "fault": {"kind": "hang", "rank": _rank, "where": _where}}
        ),
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("where", "rank", "named"),
    [("prepare_data", 0, "in setup"), ("epoch_end", 1, "in on_validation_epoch_end")],
    ids=list(BLAME_CASES),
)
def test_only_the_stuck_replica_is_blamed_not_the_one_waiting_in_a_barrier(ended, request, where, rank, named):
    """A hang in ``prepare_data`` on rank 0 (rank 1 waits in Lightning's barrier around it) or in
    ``on_validation_epoch_end`` on rank 1: the job ends with 124 naming only the stuck replica."""
    run = ended[request.node.name]
    status, out = run.status, run.output
    assert (run.out / "fault.json").exists(), f"the fault did not fire (status {status})\n{out[-3000:]}"
    assert status == WATCHDOG_EXIT_CODE, out[-3000:]
    assert f"replica(s) [{rank}] stopped responding" in out, out[-3000:]
    assert f"rank {rank} on" in out and named in out, out[-3000:]
    assert "replica(s) [0, 1]" not in out, out[-3000:]
    assert run.ended - run.json("fault.json")["time"] < TIMEOUT + 30, out[-3000:]
    assert run.survivors == []


LOADER_TIMEOUT = 10.0


@JOBS.job("test_a_hung_loader_worker_does_not_outlive_the_job")
def _hung_loader_worker(out: Path) -> Ended:
    proc, _ = _start(out, {"timeout": LOADER_TIMEOUT, "fault": {"kind": "hang", "rank": 1, "where": "loader"}})
    try:
        run = Ended(out, *_finish(proc, limit=LOADER_TIMEOUT + 90))
    finally:  # on failure too: no worker of this job may outlive it
        workers = [int(p.name) for p in (out / "workers").glob("*")] if (out / "workers").exists() else []
        for pid in alive(workers):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    run.extra["workers"] = workers
    return run


@pytest.mark.slow
def test_a_hung_loader_worker_does_not_outlive_the_job(ended, request):
    """Replica 1's ``Dataset.__getitem__`` blocks forever in its DataLoader workers (``num_workers=2``): the job ends
    with 124 within ``timeout`` + 30 s of the fault and no worker process of either replica survives it (workers
    reparented to init would keep the job's output open)."""
    run = ended[request.node.name]
    status, out, workers = run.status, run.output, run.extra["workers"]
    fault = run.json("fault.json")
    print(
        f"loader-hang: status {status}, job ended {run.ended - fault['time']:.1f} s after the fault, "
        f"{len(workers)} workers"
    )
    assert len(workers) >= 4, out[-3000:]  # two per replica
    assert run.survivors == [] and alive(workers) == [], out[-3000:]
    pids = run.json("training.json")["pids"]
    assert alive(pids) == [], out[-3000:]
    limit = LOADER_TIMEOUT + 30
    assert run.ended - fault["time"] < limit, f"ended {run.ended - fault['time']:.1f}s after the fault\n{out[-3000:]}"
    assert status == WATCHDOG_EXIT_CODE, out[-3000:]
    assert "replica(s) [1]" in out, out[-3000:]


@pytest.mark.slow
def test_a_stranger_on_the_port_cannot_end_the_job_and_nothing_listens_beyond_loopback(ended):
    """A forged verdict and forged heartbeats on the job's store (see :func:`_strangers`): the job finishes, and the
    store and Gloo listen on loopback only."""
    run = ended["strangers"]
    listening, ours = run.extra["listening"], run.extra["ours"]
    assert ours, listening  # the store and Gloo listen somewhere
    for line in ours:
        address = line.split()[3].rsplit(":", 1)[0]
        assert address in ("127.0.0.1", "[::1]", "[::ffff:127.0.0.1]"), line
    assert run.status == 0, run.output[-3000:]
    assert "a stranger says so" not in run.output
    assert (run.out / "done.json").exists()
    assert run.survivors == []


def _tamper_with_heartbeats(
    store: dist.TCPStore, proc: subprocess.Popen, seconds: float, noticed: Callable[[], object], limit: float = 180
) -> int:
    """A stranger on the store: for ``seconds`` and then until ``noticed()`` (at most ``limit`` seconds, or until the
    job ends), overwrite, delete and replay every heartbeat key it can list; returns how many rounds tampered with at
    least one key."""
    captured: dict[str, bytes] = {}
    rounds = 0
    start = time.monotonic()
    while proc.poll() is None and time.monotonic() - start < limit:
        if time.monotonic() - start >= seconds and noticed():
            break
        with contextlib.suppress(Exception):
            keys = [k for k in store.list_keys() if "/hb/" in k]
            for key in keys:
                if key not in captured:
                    captured[key] = store.get(key)  # a genuine record, replayed later
                action = rounds % 3
                if action == 0:
                    store.set(key, json.dumps({"state": "failed", "error": "a stranger says so"}))
                elif action == 1:
                    store.delete_key(key)
                else:
                    store.set(key, captured[key])
            rounds += bool(keys)
        time.sleep(0.02)
    return rounds


STRANGER_TEST = "test_a_stranger_on_the_port_cannot_end_the_job_and_nothing_listens_beyond_loopback"
TAMPERING_TEST = "test_a_stranger_tampering_with_heartbeats_neither_ends_nor_stalls_the_job"


#: the watchdog's warning about tampering with a heartbeat key: a tampered record read, or the heartbeat hidden by
#: tampering while the replica's process is alive (which one depends on what the watchdog happens to read)
TAMPERING_WARNING = r"tampering with the job's store detected under 'hb/|under 'hb/\d+' is hidden by tampering"


@JOBS.job("strangers", STRANGER_TEST, TAMPERING_TEST)
def _strangers(out: Path) -> Ended:
    """One job that two strangers on its store try to end: once training runs, the first lists what the job listens
    on, writes a forged verdict under every ``abort`` key and a failed heartbeat under every heartbeat key; the second
    then tampers with the heartbeat keys for ``2 * TIMEOUT`` and on until the job's output shows the watchdog's
    warning. The job trains until the strangers are done (``hold``), however long the warning takes to come."""
    proc, env = _start(out, {"timeout": TIMEOUT, "step_sleep": 2 * STEP_SLEEP, "hold": "release"})
    watch = OutputWatch(proc)
    try:
        _wait_for(out / "training.json", proc)
        pids = json.loads((out / "training.json").read_text())["pids"]
        listening = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout.splitlines()
        ours = [line for line in listening if any(f"pid={pid}," in line for pid in pids)]
        stranger = dist.TCPStore("127.0.0.1", int(env["MASTER_PORT"]), None, False, timedelta(seconds=10))
        forged = Verdict("hung", (1,), 9.0, "a stranger says so").to_json()
        stranger.set("abort", forged)
        for key in [k for k in stranger.list_keys() if "/hb/" in k]:  # the watchdog's keys, found by listing
            stranger.set(key.split("hb/")[0] + "abort", forged)
            stranger.set(key, json.dumps({"state": "failed", "error": "a stranger says so"}))
        noticed = functools.partial(watch.wait_for, TAMPERING_WARNING, 0)
        rounds = _tamper_with_heartbeats(stranger, proc, seconds=2 * TIMEOUT, noticed=noticed)
        (out / "release").write_text("")
        run = Ended(out, *_finish(proc, watch=watch))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    run.extra.update(listening=listening, ours=ours, rounds=rounds)
    return run


@pytest.mark.slow
def test_a_stranger_tampering_with_heartbeats_neither_ends_nor_stalls_the_job(ended):
    """Overwriting, deleting and replaying the replicas' heartbeat keys for longer than ``timeout`` while they train:
    the job finishes (exit 0), warns about tampering naming the key, and blames nobody. Which warning depends on what
    the watchdog happens to read: a forged, deleted or replayed record, or (when every read it made of a replica's
    key found the stranger's doing) the heartbeat hidden by tampering while the replica's process is alive."""
    run = ended["strangers"]
    out = run.output
    assert run.extra["rounds"] > 10
    assert run.status == 0, out[-3000:]
    assert re.search(TAMPERING_WARNING, out), out[-3000:]
    assert "stopped responding" not in out and "replica(s) [" not in out, out[-3000:]
    assert "a stranger says so" not in out
    assert (run.out / "done.json").exists()
    assert run.survivors == []


def _ctrl_c(out: Path, flavour: str) -> Ended:
    proc, _ = _start(out, {"timeout": 30, "step_sleep": STEP_SLEEP}, flavour)
    try:
        _wait_for(out / "training.json", proc)
        pids = json.loads((out / "training.json").read_text())["pids"]
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal does on Ctrl-C: the whole foreground group
        run = Ended(out, *_finish(proc, limit=120))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    run.extra["alive"] = alive(pids)
    return run


for _flavour in ("lightning", "pytorch_lightning"):
    if importlib.util.find_spec(_flavour) is not None:
        JOBS.add(f"test_ctrl_c_ends_every_replica_with_130[{_flavour}]", functools.partial(_ctrl_c, flavour=_flavour))


@pytest.mark.slow
@pytest.mark.parametrize("flavour", ["lightning", "pytorch_lightning"])
def test_ctrl_c_ends_every_replica_with_130(ended, request, flavour):
    if flavour != "lightning":
        pytest.importorskip(flavour)
    run = ended[request.node.name]
    assert run.status == INTERRUPTED_EXIT_CODE, run.output[-3000:]
    assert "] failed (" not in run.output and "] exited" not in run.output, run.output[-3000:]
    assert run.survivors == [] and run.extra["alive"] == []


JOBS.add(
    "test_unwritable_output_directory_fails_before_any_replica_starts",
    functools.partial(_run_to_end, cfg={"timeout": TIMEOUT, "root": "/proc/self/lightning"}, limit=120),
)


@pytest.mark.slow
def test_unwritable_output_directory_fails_before_any_replica_starts(ended, request):
    run = ended[request.node.name]
    status, out = run.status, run.output
    assert status != 0 and "OutputDirError: The output directory '/proc/self/lightning'" in out, out[-3000:]
    assert "[rank: 1]" not in out  # no replica was started
    assert run.survivors == []


@JOBS.job("test_app_output_directory_problem_is_one_line_and_exit_2")
def _app_output_directory(out: Path) -> Ended:
    (out / "file").write_text("x")
    bad = out / "file" / "out"
    result = run_in_session(
        [sys.executable, "-m", "lightning_het.app", f"output_dir={bad}", f"hydra.run.dir={out / 'run'}"],
        cwd=out,
        env=job_env(),
        timeout=120,
        merge_stderr=False,
    )
    return Ended(out, result.returncode, result.stderr, time.time(), [], {"bad": bad})


@pytest.mark.slow
def test_app_output_directory_problem_is_one_line_and_exit_2(ended, request):
    """The Hydra app: an output directory that cannot be created ends with one ``error:`` line and status 2."""
    run = ended[request.node.name]
    stderr = run.output
    assert run.status == 2, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"'{run.extra['bad']}' does not exist and cannot be created" in errors[0], stderr[
        -3000:
    ]
    assert "Traceback" not in stderr


def test_replicas_share_the_cpus_unless_omp_num_threads_is_set(monkeypatch) -> None:
    """The launched replicas of a node split its CPUs (at least one thread each); ``OMP_NUM_THREADS`` wins."""
    from lightning_het.reliability.launch import share_cpu_threads

    threads: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    share_cpu_threads(3)
    assert threads == [2] and os.environ["OMP_NUM_THREADS"] == "2"
    share_cpu_threads(1)  # set now: kept
    monkeypatch.delenv("OMP_NUM_THREADS")
    share_cpu_threads(16)
    assert threads == [2, 1] and os.environ["OMP_NUM_THREADS"] == "1"


@pytest.mark.parametrize("module", [None, "pkg.train"])
@pytest.mark.parametrize("hydra", [False, True])
def test_a_replica_starts_with_the_command_lightnings_launcher_uses(monkeypatch, module, hydra) -> None:
    """This script again (a file or ``-m`` module) with its arguments; under Hydra from the original directory, in
    this run's output directory: the command and directory of Lightning's own script launcher."""
    from lightning.fabric.strategies.launchers import subprocess_script as lightnings

    import __main__
    from lightning_het.reliability import launch

    hydra_utils = pytest.importorskip("hydra.utils")  # (Hydra comes with the app's extra)
    from hydra.core.hydra_config import HydraConfig

    monkeypatch.setattr(__main__, "__spec__", SimpleNamespace(name=module) if module else None)
    monkeypatch.setattr(sys, "argv", ["train.py", "trainer.max_epochs=2"])
    monkeypatch.setattr(HydraConfig, "initialized", staticmethod(lambda: hydra))
    monkeypatch.setattr(HydraConfig, "get", staticmethod(lambda: SimpleNamespace(run=SimpleNamespace(dir="out/run"))))
    monkeypatch.setattr(hydra_utils, "get_original_cwd", lambda: "/jobs/first")
    monkeypatch.setattr(hydra_utils, "to_absolute_path", lambda path: f"/jobs/first/{path}")
    expected = lightnings._hydra_subprocess_cmd(2) if hydra else (lightnings._basic_subprocess_cmd(), None)
    assert launch.child_command(2) == expected


@pytest.mark.parametrize("start_method", ["spawn", "fork"])
def test_the_spawn_launcher_shows_the_wrapped_launchers_attributes(start_method: str) -> None:
    # Lightning's own callers and tests read the launcher's start method and interactivity through the wrapper
    import lightning.pytorch as pl

    from lightning_het import HeterogeneousStrategy

    strategy = HeterogeneousStrategy(start_method=start_method)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False, enable_checkpointing=False)
    launcher = trainer.strategy.launcher
    assert launcher._start_method == start_method
    assert launcher.is_interactive_compatible is (start_method == "fork")
    with pytest.raises(AttributeError):
        launcher.no_such_attribute  # noqa: B018
