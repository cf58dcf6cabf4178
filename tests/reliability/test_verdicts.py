"""Who is blamed: a replica waiting in a barrier (Lightning's, whose innermost frame is not in ``torch.distributed``)
or done with evaluation is waiting; one stuck in an evaluation epoch-end hook is the culprit."""

from __future__ import annotations

import sys

from lightning_het.reliability.watchdog import Phase, ReplicaStatus, inside_torch_distributed, judge
from tests.helpers.watchdogs import describe_phase


def _frame_of(filename: str, source: str, call: str):
    namespace: dict = {"sys": sys}
    exec(compile(source, filename, "exec"), namespace)
    return eval(call, namespace)


def test_lightning_barriers_count_as_waiting():
    infinite = "class _InfiniteBarrier:\n    def __exit__(self, *a):\n        return sys._getframe()\n"
    path = "/site-packages/lightning/fabric/utilities/distributed.py"
    assert inside_torch_distributed(_frame_of(path, infinite, "_InfiniteBarrier().__exit__()"))
    barrier = "class DDPStrategy:\n    def barrier(self, *a):\n        return sys._getframe()\n"
    path = "/site-packages/lightning/pytorch/strategies/ddp.py"
    assert inside_torch_distributed(_frame_of(path, barrier, "DDPStrategy().barrier()"))
    sync = "def _sync_dir(d):\n    return sys._getframe()\n"
    assert inside_torch_distributed(_frame_of("/site-packages/lightning/pytorch/x.py", sync, "_sync_dir(1)"))


def test_user_code_and_other_lightning_functions_are_not_waiting():
    user = "def prepare_data():\n    return sys._getframe()\n"
    assert not inside_torch_distributed(_frame_of("/home/me/train.py", user, "prepare_data()"))
    hook = "def _call_lightning_module_hook():\n    return sys._getframe()\n"
    assert not inside_torch_distributed(
        _frame_of("/sp/lightning/pytorch/trainer/call.py", hook, "_call_lightning_module_hook()")
    )
    assert not inside_torch_distributed(
        _frame_of("/home/me/barrier.py", "def barrier():\n    return sys._getframe()\n", "barrier()")
    )


def _status(rank: int, phase: Phase, stalled: float, **kwargs) -> ReplicaStatus:
    return ReplicaStatus(rank, host="h", pid=100 + rank, batch=6, phase=phase, stalled_for=stalled, **kwargs)


def test_the_replica_in_an_evaluation_epoch_end_hook_is_blamed_not_the_one_done():
    statuses = [_status(0, Phase.EVAL_DONE, 9.0), _status(1, Phase.EVAL_EPOCH_END, 9.0, eval_stage="validate")]
    verdict = judge(statuses, timeout=5)
    assert verdict is not None and verdict.culprits == (1,)
    assert "in on_validation_epoch_end (after training batch 6)" in verdict.message


def test_the_replica_stuck_in_setup_is_blamed_not_the_one_waiting_in_the_barrier():
    statuses = [_status(0, Phase.SETUP, 9.0), _status(1, Phase.SETUP, 9.0, waiting=True)]
    verdict = judge(statuses, timeout=5)
    assert verdict is not None and verdict.culprits == (0,)


def test_describe_epoch_end():
    assert describe_phase(Phase.EVAL_EPOCH_END, 0, "test", 3) == "in on_test_epoch_end"
    assert describe_phase(Phase.EVAL_EPOCH_END, 2) == "in the evaluation epoch-end hooks of batch 2"
