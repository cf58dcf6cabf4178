"""User code that runs Lightning's collectives in every hook behaves as under stock DDP (progress bar on)."""

from __future__ import annotations

import json

import pytest

from tests.helpers.harness import run_harness

pytestmark = pytest.mark.slow

CONFIGS = {
    "profiled": {},  # default: profiled speeds, telemetry on
    "uneven": {"speeds": [3, 1], "rebalance_threshold": 1.05},  # uneven shares, a rebalancing check every epoch
    "ddp": "ddp",
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("collectives")
    cfgs = [{"strategy": spec} for spec in CONFIGS.values()]
    job = run_harness("collectives", out, cfgs, limit=240)
    assert job.returncode == 0, job.output[-6000:]
    assert not job.survivors
    return {name: json.loads((out / str(i) / "result.json").read_text()) for i, name in enumerate(CONFIGS)}


@pytest.mark.parametrize("name", ["profiled", "uneven"])
def test_sync_dist_and_all_gather_in_every_hook_finish_as_under_ddp(results, name):
    """Epoch-level ``sync_dist`` with the progress bar used to deadlock against the telemetry's epoch-end gather:
    rank 0's bar reduces the epoch metric alone while the other rank was already in the gather."""
    ours, ddp = results[name], results["ddp"]
    assert ours["gathered"] == ddp["gathered"]  # the same hooks, in the same order, gathering the same values
    assert ours["gathered"][0][0] == ["on_train_epoch_start", 1.0, 2.0]
    assert sorted(ours["metrics"]) == sorted(ddp["metrics"])
    assert ours["gathered"][0][-1] == ["on_train_end", 1.0, 2.0]
