"""Hung and dead replicas end the whole job, quickly, naming the replica(s) at fault."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from lightning_het.arguments import as_timeout
from lightning_het.reliability.launch import validate_launch_environment
from lightning_het.reliability.watchdog import (
    WATCHDOG_EXIT_CODE,
    Phase,
    ReplicaStatus,
    Verdict,
    Watchdog,
    is_collective_failure,
    judge,
)
from tests.helpers.harness import run_harness
from tests.helpers.watchdogs import ExitRecorder, watchdog_pair


# ---------------------------------------------------------------------------------------------------- judge (pure)
def _status(rank: int, batch: int, phase: Phase, stalled: float, **kwargs) -> ReplicaStatus:
    return ReplicaStatus(rank, host="h", pid=100 + rank, batch=batch, phase=phase, stalled_for=stalled, **kwargs)


class TestJudge:
    def test_healthy_job_has_no_verdict(self):
        statuses = [_status(r, 3, Phase.BACKWARD, 0.2) for r in range(3)]
        assert judge(statuses, timeout=5) is None

    def test_replica_stuck_in_training_step_is_blamed_not_those_waiting_in_backward(self):
        statuses = [
            _status(0, 4, Phase.BACKWARD, 6.0),
            _status(1, 4, Phase.TRAINING_STEP, 4.7),  # seen one heartbeat late: still a suspect
            _status(2, 4, Phase.BACKWARD, 6.0),
        ]
        verdict = judge(statuses, timeout=5)
        assert verdict is not None and verdict.kind == "hung" and verdict.culprits == (1,)
        assert verdict.message.startswith("replica(s) [1] stopped responding for 4.7 s")
        assert "rank 1 on h (pid 101): in training_step of batch 4" in verdict.message

    def test_replica_stuck_loading_the_next_batch_is_behind(self):
        statuses = [_status(0, 7, Phase.BACKWARD, 9.0), _status(1, 6, Phase.BETWEEN_BATCHES, 9.0)]
        assert judge(statuses, timeout=5).culprits == (1,)

    def test_evaluation_has_no_lock_step_so_every_stuck_evaluator_is_blamed(self):
        statuses = [
            _status(0, 5, Phase.EVAL_DONE, 9.0),
            _status(1, 5, Phase.EVAL_STEP, 9.0),
            _status(2, 5, Phase.EVAL_LOADING, 9.0),
        ]
        assert judge(statuses, timeout=5).culprits == (1, 2)

    def test_a_replica_inside_torch_distributed_is_waiting_never_blamed(self):
        statuses = [_status(0, 2, Phase.TRAINING_STEP, 9.0, waiting=True), _status(1, 2, Phase.TRAINING_STEP, 9.0)]
        assert judge(statuses, timeout=5).culprits == (1,)

    def test_a_slow_replica_that_keeps_the_others_waiting(self):
        statuses = [_status(0, 2, Phase.EVAL_DONE, 9.0), _status(1, 2, Phase.EVAL_STEP, 0.3)]
        verdict = judge(statuses, timeout=5)
        assert verdict.culprits == (1,)
        assert "kept the other replicas waiting for 9.0 s" in verdict.message

    def test_all_stuck_at_the_same_point_are_all_reported(self):
        statuses = [_status(r, 2, Phase.BACKWARD, 9.0) for r in range(2)]
        assert judge(statuses, timeout=5).culprits == (0, 1)

    def test_outside_the_loops_stalls_are_not_judged(self):
        statuses = [_status(r, 0, Phase.BETWEEN_BATCHES, 60.0, armed=False) for r in range(2)]
        assert judge(statuses, timeout=5) is None

    def test_silent_heartbeat_means_dead_or_frozen(self):
        statuses = [_status(0, 1, Phase.BACKWARD, 1.0), _status(1, 1, Phase.BACKWARD, 1.0, silent_for=7.5)]
        verdict = judge(statuses, timeout=5)
        assert verdict.kind == "silent" and verdict.culprits == (1,)
        assert verdict.message.startswith("replica(s) [1] stopped responding for 7.5 s: no heartbeat")

    def test_reported_failure_wins(self):
        failed = _status(1, 1, Phase.TRAINING_STEP, 0.0, state="failed", error="RuntimeError: CUDA out of memory")
        statuses = [_status(0, 1, Phase.BACKWARD, 1.0), failed]
        verdict = judge(statuses, timeout=5)
        assert verdict.kind == "failed" and verdict.culprits == (1,)
        assert "CUDA out of memory" in verdict.message

    def test_finished_replicas_are_ignored(self):
        finished = _status(1, 3, Phase.BETWEEN_BATCHES, 99.0, silent_for=99.0, state="finished")
        statuses = [_status(0, 3, Phase.BETWEEN_BATCHES, 0.1), finished]
        assert judge(statuses, timeout=5) is None

    def test_verdict_round_trips_through_the_store_format(self):
        verdict = Verdict("hung", (1, 2), 5.5, "replica(s) [1, 2] stopped responding for 5.5 s")
        assert Verdict.from_json(verdict.to_json()) == verdict


def test_collective_failures_are_symptoms():
    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms")
    assert is_collective_failure(gloo)
    assert is_collective_failure(RuntimeError("Connection closed by peer [127.0.0.1]:1234"))
    assert not is_collective_failure(RuntimeError("CUDA out of memory"))
    assert not is_collective_failure(ValueError("gloo"))


# ---------------------------------------------------------------------------------------------------- threads
def _pair(timeout: float = 0.6) -> tuple[list[Watchdog], list[ExitRecorder], dist.Store]:
    return watchdog_pair(timeout, prefix="t/")


def test_threads_end_every_replica_and_blame_the_one_stuck_in_its_step(caplog):
    dogs, recorders, store = _pair()
    for dog in dogs:
        dog.start()
        dog.arm("fit")
    dogs[0].step(Phase.TRAINING_STEP, 1)
    dogs[0].mark(Phase.BACKWARD)  # rank 0 waits in the all-reduce
    dogs[1].step(Phase.TRAINING_STEP, 1)  # rank 1 never gets out of training_step (marked as the strategy does)
    start = time.monotonic()
    assert all(r.done.wait(10) for r in recorders)
    assert time.monotonic() - start < 0.6 + 1.5
    assert [r.codes for r in recorders] == [[WATCHDOG_EXIT_CODE]] * 2
    verdict = Verdict.from_json(dist.PrefixStore("t/", store).get("abort"))
    assert verdict.culprits == (1,)
    assert "replica(s) [1] stopped responding for" in caplog.text


class _StoreLostOnPublish:
    """A store whose ``compare_set`` fails: its host went away just when a verdict is published."""

    def __init__(self, store: dist.Store) -> None:
        self.store = store

    def __getattr__(self, name: str):
        return getattr(self.store, name)

    def compare_set(self, *args):
        raise RuntimeError("Connection reset by peer")


def test_a_verdict_whose_publication_fails_still_ends_the_replica():
    store, recorders = dist.HashStore(), [ExitRecorder(), ExitRecorder()]
    stores = [_StoreLostOnPublish(dist.PrefixStore("t/", store)), dist.PrefixStore("t/", store)]
    dogs = [Watchdog(stores[r], r, 2, 0.6, interval=0.05, exit=recorders[r], hosts_store=r == 0) for r in range(2)]
    for dog in dogs:
        dog.start()
        dog.arm("fit")
    dogs[0].step(Phase.TRAINING_STEP, 1)
    dogs[0].mark(Phase.BACKWARD)
    dogs[1].step(Phase.TRAINING_STEP, 1)  # rank 1 never gets out of training_step
    try:
        assert recorders[0].done.wait(10), "the replica whose store failed while publishing never ended"
        assert recorders[0].codes == [WATCHDOG_EXIT_CODE]
    finally:
        for dog in dogs:
            dog.stop()


def test_a_failing_replica_ends_the_others_at_once():
    dogs, recorders, store = _pair(timeout=30.0)
    for dog in dogs:
        dog.start()
        dog.arm("fit")
    dogs[1].on_exception(RuntimeError("CUDA out of memory"))
    assert recorders[0].done.wait(5)
    assert recorders[0].codes == [WATCHDOG_EXIT_CODE]
    assert not recorders[1].codes  # the failing replica ends by its own exception
    verdict = Verdict.from_json(dist.PrefixStore("t/", store).get("abort"))
    assert verdict.kind == "failed" and verdict.culprits == (1,)
    dogs[1].stop()


def test_a_long_error_keeps_its_hint_in_the_verdict():
    """The one-line verdict shortens a long message before its ``HINT:``, not the HINT (what to do) itself."""
    dogs, recorders, store = _pair(timeout=30.0)
    for dog in dogs:
        dog.start()
        dog.arm("fit")
    cause = "You resumed from a checkpoint taken in the middle of epoch 1, " + "and so on " * 40
    dogs[1].on_exception(ValueError(f"{cause}HINT: keep `global_batch_size` unchanged."))
    assert recorders[0].done.wait(5)
    verdict = Verdict.from_json(dist.PrefixStore("t/", store).get("abort"))
    assert "ValueError: You resumed from a checkpoint" in verdict.message
    assert "HINT: keep `global_batch_size` unchanged." in verdict.message
    assert len(verdict.message) < 500
    dogs[1].stop()


def test_launching_process_notices_a_local_replica_that_exited():
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    child.wait()
    recorder, store = ExitRecorder(), dist.HashStore()
    Watchdog(store, 0, 2, 30.0, interval=0.05, exit=recorder, children=lambda: [(1, child)]).start()
    assert recorder.done.wait(10) and recorder.codes == [WATCHDOG_EXIT_CODE]  # long before the timeout
    verdict = Verdict.from_json(store.get("abort"))
    assert verdict.kind == "exited" and verdict.culprits == (1,)
    assert "exit status 3" in verdict.message


def test_a_clean_stop_is_not_a_failure():
    dogs, recorders, _ = _pair(timeout=0.3)
    for dog in dogs:
        dog.start()
        dog.arm("fit")
    for dog in dogs:
        dog.arm("fit", False)
        dog.stop()
    time.sleep(0.6)
    assert not any(r.codes for r in recorders)


# ---------------------------------------------------------------------------------------------------- arguments
class TestArguments:
    @pytest.mark.parametrize("value", ["20", -1, 0, float("nan"), True, timedelta(seconds=-3)])
    def test_bad_timeout(self, value):
        with pytest.raises(ValueError, match="`timeout`"):
            as_timeout("timeout", value)

    def test_timeout_as_number_or_timedelta(self):
        assert as_timeout("timeout", 2.5) == timedelta(seconds=2.5)
        assert as_timeout("timeout", timedelta(minutes=1)) == timedelta(minutes=1)
        assert as_timeout("timeout", None) is None

    def test_multi_node_needs_rendezvous_variables(self):
        from lightning.fabric.plugins.environments import LightningEnvironment

        with pytest.raises(ValueError, match=r"num_nodes=2.*MASTER_ADDR, NODE_RANK.*HINT"):
            validate_launch_environment(2, LightningEnvironment(), {"MASTER_PORT": "1234"})
        complete = {"MASTER_ADDR": "a", "MASTER_PORT": "1", "NODE_RANK": "0"}
        validate_launch_environment(2, LightningEnvironment(), complete)
        validate_launch_environment(1, LightningEnvironment(), {})


# ---------------------------------------------------------------------------------------------------- real jobs
def _run_faulty(tmp_path: Path, cfg: dict) -> tuple[int, str, float, list[int]]:
    """Run the harness's ``faulty`` job; return (status, output, seconds from the fault to the job's end, survivors)."""
    job = run_harness("faulty", tmp_path, cfg)
    fault = json.loads((tmp_path / "fault.json").read_text())
    return job.returncode, job.output, job.ended - fault["time"], job.survivors


@pytest.mark.slow
def test_hung_replica_ends_the_job_within_timeout_naming_it(tmp_path):
    """Issue #7.1: 3 replicas, ``timeout=5``, replica 1 sleeps forever inside ``training_step``."""
    timeout = 5.0
    status, out, after_fault, survivors = _run_faulty(
        tmp_path, {"devices": 3, "timeout": timeout, "fault": {"kind": "hang", "rank": 1, "step": 3}}
    )
    assert status != 0, out[-3000:]
    assert "replica(s) [1] stopped responding for" in out, out[-3000:]
    assert "in training_step of batch 4" in out
    assert after_fault < timeout + 10.0, f"ended {after_fault:.1f}s after the hang\n{out[-3000:]}"
    assert survivors == []


@pytest.mark.slow
def test_dead_replica_ends_the_job_within_seconds_without_orphans(tmp_path):
    """Issue #7.2: replica 1 calls ``os._exit(3)`` in the middle of an epoch."""
    status, out, after_fault, survivors = _run_faulty(
        tmp_path, {"devices": 2, "timeout": 60, "fault": {"kind": "exit", "rank": 1, "step": 3}}
    )
    assert status != 0, out[-3000:]
    # ours, or (rarely, when its 5 s poll comes first) Lightning's child-process observer names the replica
    assert "replica(s) [1] exited" in out or "terminated with code 3" in out, out[-3000:]
    assert after_fault < 10.0, f"ended {after_fault:.1f}s after the exit\n{out[-3000:]}"
    assert survivors == []
