"""`scripts/bench_balance.py` end to end in its CI-sized mode: the plumbing, not the figures (noise here)."""

from __future__ import annotations

import json

from tests.conftest import REPO, run_job


def test_bench_balance_tiny_runs_end_to_end(tmp_path):
    result = run_job([str(REPO / "scripts" / "bench_balance.py"), "--tiny", "--out", str(tmp_path)], timeout=900)
    assert result.returncode == 0, result.stdout[-6000:]
    summary = json.loads((tmp_path / "results.json").read_text())
    rows = {r["platform"]: r for r in summary["platforms"]}
    assert set(rows) == {"1:1:1", "1:2:4", "1:1:8"}
    for name, row in rows.items():
        assert sum(row["batch_sizes"]) == 48
        assert row["ddp_fit_s"] > 0 and row["het_fit_s"] > 0
        # profiling takes the first 7 steps: the 8-step heterogeneous fits finish it, the 4-step 1:1:1 fit does not
        assert row["profile_s"] > 0 if name != "1:1:1" else row["profile_s"] >= 0
    assert rows["1:2:4"]["ideal_speedup"] == 7 / 3
    assert rows["1:2:4"]["batch_sizes"][2] > rows["1:2:4"]["batch_sizes"][0]  # the fast replica gets more
    assert rows["1:1:8"]["batch_sizes"][2] > rows["1:1:8"]["batch_sizes"][0]
    assert sum(summary["emulation"]["batch_sizes"]) == 48
    slowdown = summary["slowdown"]
    assert len(slowdown["static"]["samples_per_s"]) == len(slowdown["rebalanced"]["samples_per_s"]) == 5
    assert len(summary["overhead"]["ddp_step_ms"]) == len(summary["overhead"]["het_step_ms"]) == 1
    memory = {r["run"]: r for r in summary["memory"]["rows"]}
    assert memory["memory het capped"]["batch_sizes"] == [8, 40]
    assert sum(memory["memory het micro"]["batch_sizes"]) == 48 and summary["memory"]["best_sizes"] == [37, 11]
    for name in ("bench_balance_platforms.png", "bench_balance_slowdown.png", "bench_balance_report.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    table = (tmp_path / "results.md").read_text()
    assert "| 1:2:4 |" in table and "Homogeneous overhead" in table and "**Memory platform**" in table
    assert "**Sharded (FSDP2), 1:2:4:** `ModelParallelStrategy` fit" in table  # the sharded row
