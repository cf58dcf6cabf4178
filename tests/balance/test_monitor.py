"""The balance monitor end to end: telemetry of a 2-replica fit, the report files and the logged metrics."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from tests.helpers.harness import run_balance_job


def test_fast_replica_waits_when_balancing_is_off(tmp_path):
    """Two replicas, equal batches, rank 1 emulated 3x slower: its compute triples and rank 0 waits for it."""
    cfg = {
        "devices": 2,
        "strategy": {"speeds": [1, 1], "emulate_slowdown": [1, 3]},
        "epochs": 1,
        "n": 160,
        "batch_size": 8,
        "module": {"cost_per_sample_s": 0.005},
        "sleep_counts_as_cpu": True,  # the emulation stretches the sleeps as computation, exactly under any load
    }
    dumps = run_balance_job(tmp_path, cfg)
    report = dumps[0]["report"]
    epoch = report["telemetry"]["epochs"][0]
    compute, wait = epoch["compute_s"], epoch["wait_s"]
    assert epoch["steps"] == [10, 10]
    assert 2.4 <= compute[1] / compute[0] <= 3.6, epoch  # the emulation factor
    assert wait[0] >= 0.6 * (compute[1] - compute[0]), epoch  # the fast replica waits for the slow one ...
    assert wait[1] <= 0.25 * wait[0], epoch  # ... which hardly waits
    assert epoch["imbalance"] >= 2.0
    assert epoch["samples_per_s"][0] == pytest.approx(epoch["samples_per_s"][1], rel=0.15)  # same step time
    assert report["telemetry"]["checks"] == []  # no rebalancing configured
    assert len(report["telemetry"]["series"]["compute_s"][1]) == 10
    # the report files, written by rank 0 into the logger's directory, and the logged metrics
    paths = dumps[0]["report_paths"]
    assert set(paths) == {"json", "table", "plot"} and not dumps[1]["report_paths"]
    assert json.loads(Path(paths["json"]).read_text())["telemetry"]["epochs"][0]["steps"] == [10, 10]
    with open(tmp_path / "logs" / "version_0" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("het/imbalance")]
    assert len(rows) == 1 and float(rows[0]["het/wait_s/rank0"]) == pytest.approx(wait[0])
