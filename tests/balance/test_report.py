"""The balance report: logger metrics, the table, the plot and the files."""

from __future__ import annotations

import json

import pytest

from lightning_het.balance import report as report_module
from lightning_het.balance.clock import EpochTimings
from lightning_het.balance.monitor import epoch_summary
from lightning_het.balance.report import log_epoch_metrics, render_balance_table, write_balance_report
from tests.balance.test_history import _monitor


def _timings(compute, wait, batch):
    return EpochTimings(compute, wait, [c + w + 0.001 for c, w in zip(compute, wait)], [batch] * len(compute))


def test_loggers_receive_per_replica_keys():
    class Logger:
        def __init__(self):
            self.calls = []

        def log_metrics(self, metrics, step):
            self.calls.append((metrics, step))

    logger = Logger()
    summary = epoch_summary([_timings([0.1], [0.2], 8), _timings([0.3], [0.0], 8)])
    log_epoch_metrics([logger], summary, step=7)
    metrics, step = logger.calls[0]
    assert step == 7 and metrics["het/imbalance"] == pytest.approx(3.0)
    assert metrics["het/wait_s/rank0"] == pytest.approx(0.2) and metrics["het/batch_size/rank1"] == 8.0


@pytest.mark.parametrize("world", [2, 10])
def test_report_files(tmp_path, world):
    monitor = _monitor([4] * world)
    for epoch in range(2):
        monitor.add([_timings([0.1 * (r + 1)] * 5, [0.05] * 5, 4) for r in range(world)], epoch=epoch, global_step=5)
    check = {"epoch": 0, "global_step": 5, "batch": 10, "from": [4] * world, "batch_sizes": [4] * world}
    monitor.history["rebalances"].append({**check, "reason": "test"})
    report = {
        "global_batch_size": 4 * world,
        "batch_sizes": [4] * world,
        "speeds": [1.0] * world,
        "telemetry": report_module._plain(monitor.history),
    }
    report["telemetry"]["epochs"][0]["imbalance"] = float("nan")  # must not leak into the JSON
    report["telemetry"]["epochs"][1]["wait_s"][1] = None  # as read back from JSON: no figure
    paths = write_balance_report(report, tmp_path / "out")
    assert paths["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    loaded = json.loads(paths["json"].read_text())  # strict JSON: no NaN
    assert loaded["telemetry"]["epochs"][0]["imbalance"] is None
    table = paths["table"].read_text().splitlines()
    assert f"last epoch 1: imbalance (max/min compute) {world:.3f}" in table[1] and "wait share" in table[2]
    assert table[3].split() == ["0", "?", "?", "1.00", "4", f"{1 / world:.1%}", "100.0", "50.0", "33.3%", "26.5"]
    assert table[4].split()[7] == "-"
    assert "end of epoch 0 (step 5): [4, 4" in table[-2] and table[-1] == "```"
    assert render_balance_table({"batch_sizes": []}).startswith("HeterogeneousStrategy: no allocation")
