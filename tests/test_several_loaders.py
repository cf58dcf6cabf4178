"""What users do that Lightning supports and DDP runs: several training loaders (a dict or a list that Lightning
combines), and a ``training_step`` mistake that Lightning explains; both with profiling on the first steps."""

from __future__ import annotations

import pytest

from tests.helpers.harness import run_fits_job, run_harness

SEVERAL = {
    # loader a: 48 samples, batch 4 (global 8); loader b: 24 samples, batch 2 (global 4): 6 steps per epoch each
    "dict_profiled": {"strategy": "heterogeneous", "train_loaders": "dict", "n": 48, "n2": 24, "epochs": 2},
    "list_speeds": {"strategy": {"speeds": [1.0, 3.0]}, "train_loaders": "list", "n": 48, "n2": 24, "epochs": 2},
}


@pytest.fixture(scope="module")
def several(tmp_path_factory):
    results = run_fits_job(tmp_path_factory.mktemp("several_loaders"), list(SEVERAL.values()))
    return {name: dumps for name, (dumps, _) in zip(SEVERAL, results)}


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
def test_a_dict_without_loss_gets_lightnings_message(tmp_path):
    cfg = {"strategy": "heterogeneous", "module": {"without_loss": True}, "epochs": 1}
    job = run_harness("tiny", tmp_path, cfg, limit=120)
    assert job.returncode == 1, job.output[-3000:]  # the launching replica raised its own error
    assert "when `training_step` returns a dict, the 'loss' key needs to be present" in job.output
    assert "KeyError" not in job.output and not job.survivors
