"""What users do that Lightning supports and DDP runs: several training loaders (a dict or a list that Lightning
combines), and a ``training_step`` mistake that Lightning explains; both with profiling on the first steps."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.harness import load_dumps, run_harness, split_output
from tests.helpers.jobs import JobResult

SEVERAL = {
    # loader a: 48 samples, batch 4 (global 8); loader b: 24 samples, batch 2 (global 4): 6 steps per epoch each
    "dict_profiled": {"strategy": "heterogeneous", "train_loaders": "dict", "n": 48, "n2": 24, "epochs": 2},
    "list_speeds": {"strategy": {"speeds": [1.0, 3.0]}, "train_loaders": "list", "n": 48, "n2": 24, "epochs": 2},
}


#: the last fit of the job: ``training_step`` returns a dict without "loss" (a user mistake); the job ends with it
WITHOUT_LOSS = {"strategy": "heterogeneous", "module": {"without_loss": True}, "epochs": 1}


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> tuple[Path, JobResult]:
    """:data:`SEVERAL` and then :data:`WITHOUT_LOSS`, one after another in one job: its directory and its end."""
    out = tmp_path_factory.mktemp("several_loaders")
    return out, run_harness("tiny", out, [*SEVERAL.values(), WITHOUT_LOSS], limit=240)


@pytest.fixture(scope="module")
def several(job):
    out, result = job
    assert all((out / str(i) / "rank1.pt").exists() for i in range(len(SEVERAL))), result.output[-6000:]
    return {name: load_dumps(out / str(i), 2) for i, name in enumerate(SEVERAL)}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SEVERAL))
def test_every_training_loader_is_split_into_its_own_global_batch_every_step(several, name):
    dumps = several[name]
    assert [d["global_step"] for d in dumps] == [12, 12]
    steps = [d["seen_batch_sizes"] for d in dumps]
    assert all(len(s) == 12 for s in steps)
    for per_rank in zip(*steps):  # one step: [size of a, size of b] on each rank
        assert [sum(sizes) for sizes in zip(*per_rank)] == [8, 4]
        assert all(min(sizes) >= 1 for sizes in per_rank)


@pytest.mark.slow
def test_given_speeds_split_every_loader_in_their_proportion(several):
    dumps = several["list_speeds"]
    assert [d["batch_sizes"] for d in dumps] == [[2, 6], [2, 6]]
    assert [d["seen_batch_sizes"] for d in dumps] == [[[2, 1]] * 12, [[6, 3]] * 12]


@pytest.mark.slow
def test_a_dict_without_loss_gets_lightnings_message(job):
    _, result = job
    output = split_output(result.output, len(SEVERAL) + 1)[-1]
    assert result.returncode == 1, result.output[-3000:]  # the launching replica raised its own error
    assert "when `training_step` returns a dict, the 'loss' key needs to be present" in output
    assert "KeyError" not in result.output and not result.survivors
