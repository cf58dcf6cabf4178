"""Step telemetry (compute vs gradient-sync wait), the emulation factor and the balance report (#6)."""

from __future__ import annotations

import csv
import json
import math
import time
from pathlib import Path

import pytest
import torch

from lightning_het.balance import clock as clock_module
from lightning_het.balance import history as history_module
from lightning_het.balance import report as report_module
from lightning_het.balance.clock import EpochTimings, StepClock, emulate_slower_device
from lightning_het.balance.history import TelemetryHistory, epoch_summary, gather_timings
from lightning_het.balance.report import format_balance_table, log_epoch_metrics, write_balance_report
from tests.helpers.run_balance import run_balance_job
from tests.helpers.tiny import burn


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward takes ``seconds``: slept, or computed (CPU time) with ``busy``."""

    @staticmethod
    def forward(ctx, x, seconds, busy):
        ctx.seconds, ctx.busy = seconds, busy
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        (burn if ctx.busy else time.sleep)(ctx.seconds)
        return grad, None, None


@pytest.fixture
def sleeping_counts_as_computing(monkeypatch):
    """The process CPU clock reads the wall clock: a step that sleeps is timed as one that computes throughout, so
    the emulation tests below are exact whatever the machine's load (a real computation would be stretched by it)."""
    monkeypatch.setattr(time, "process_time", time.perf_counter)


def _loss(backward_s: float, sync_s: float, busy: bool = False) -> torch.Tensor:
    """A loss whose backward computes for ``backward_s`` and then, like DDP, blocks ``sync_s`` in a final callback.

    DDP queues its end-of-backward callback (the one waiting for the all-reduce) when the last gradient is ready; the
    leaf hook below does the same, so it runs after the clock's callback, as in a real job.
    """
    w = torch.ones(3, requires_grad=True)

    def last_gradient_ready(grad):
        torch.autograd.Variable._execution_engine.queue_callback(lambda: time.sleep(sync_s))

    w.register_hook(last_gradient_ready)
    return _SlowBackward.apply(w, backward_s, busy).sum()


def _automatic_step(clock: StepClock, forward_s: float, backward_s: float, sync_s: float) -> None:
    clock.step_start(4)
    time.sleep(forward_s)
    loss = _loss(backward_s, sync_s)
    clock.forward_end()
    clock.before_backward(loss)
    loss.backward()
    clock.after_backward()


class TestStepClock:
    @pytest.mark.parametrize("factor", [1.0, 3.0])
    @pytest.mark.usefixtures("sleeping_counts_as_computing")
    def test_compute_wait_and_emulation_factor(self, factor):
        clock = StepClock(slowdown=factor)
        for _ in range(3):
            _automatic_step(clock, forward_s=0.03, backward_s=0.02, sync_s=0.03)
        t = clock.flush()
        assert len(t) == 3 and t.batch_sizes == [4, 4, 4]
        compute, wait = sorted(t.compute_s)[1], sorted(t.wait_s)[1]
        assert factor * 0.05 <= compute <= factor * 0.05 + 0.04  # the slowdown stretches forward and backward ...
        assert 0.03 <= wait <= 0.07  # ... but happens before the gradient synchronisation
        assert all(s >= c + w for s, c, w in zip(t.step_s, t.compute_s, t.wait_s))

    @pytest.mark.usefixtures("sleeping_counts_as_computing")
    def test_manual_optimisation_order(self):
        """``manual_backward`` inside ``training_step``: the forward sleep excludes the time spent in backward."""
        clock = StepClock(slowdown=2.0)
        clock.step_start(8)
        time.sleep(0.03)
        loss = _loss(0.02, 0.03)
        clock.before_backward(loss)
        loss.backward()
        clock.after_backward()
        clock.forward_end()  # training_step returns after its own backward
        t = clock.flush()
        assert 0.10 <= t.compute_s[0] <= 0.14
        assert 0.03 <= t.wait_s[0] <= 0.07

    @pytest.mark.usefixtures("sleeping_counts_as_computing")
    def test_flush_closes_step_and_record_false_still_emulates(self):
        clock = StepClock(slowdown=2.0, record=False)
        start = time.perf_counter()
        _automatic_step(clock, forward_s=0.02, backward_s=0.01, sync_s=0.0)
        assert time.perf_counter() - start >= 0.06
        assert len(clock.flush()) == 0
        recording = StepClock()
        _automatic_step(recording, 0.0, 0.0, 0.0)
        assert len(recording.flush()) == 1 and len(recording.flush()) == 0

    def test_retained_graph_does_not_fire_twice(self):
        clock = StepClock(slowdown=3.0)
        w = torch.ones(2, requires_grad=True)
        clock.step_start(2)
        loss = (w * 2).sum()
        clock.forward_end()
        clock.before_backward(loss)
        loss.backward(retain_graph=True)
        clock.after_backward()
        start = time.perf_counter()
        loss.backward()  # not through the strategy: no hook may fire
        assert time.perf_counter() - start < 0.05

    def test_time_off_the_cpu_is_not_stretched(self):
        """A replica descheduled on shared cores (here: sleeping inside its step) is not slowed down ``f``-fold for
        it: only the CPU work is stretched, so scheduling noise is not amplified into imbalance."""
        clock = StepClock(slowdown=4.0)
        for _ in range(3):
            clock.step_start(4)
            time.sleep(0.04)  # off the CPU
            burn(0.01)
            loss = _loss(0.01, 0.0, busy=True)
            clock.forward_end()
            clock.before_backward(loss)
            loss.backward()
            clock.after_backward()
        compute = sorted(clock.flush().compute_s)[1]
        assert 0.04 + 4 * 0.02 <= compute <= 0.04 + 4 * 0.02 + 0.07  # the wall-time rule would give >= 0.24

    def test_invalid_slowdown(self):
        with pytest.raises(ValueError, match="`slowdown`"):
            StepClock(slowdown=0.5)


class TestEmulateSlowerDevice:
    @pytest.mark.parametrize(
        ("wall", "cpu", "expected"),
        [
            (0.010, None, 0.030),  # an accelerator: the synchronised wall time is the work
            (0.010, 0.004, 0.012),  # descheduled for 6 ms on shared cores: only the 4 ms of CPU work are stretched
            (0.010, 0.035, 0.030),  # intra-op threads: CPU time above wall time, the wall time counts
            (0.0, 0.0, 0.0),
        ],
    )
    def test_delay_is_f_minus_one_times_the_work(self, monkeypatch, wall, cpu, expected):
        slept: list[float] = []
        monkeypatch.setattr(clock_module.time, "sleep", slept.append)
        assert emulate_slower_device(4.0, wall, cpu) == pytest.approx(expected)
        assert slept == ([pytest.approx(expected)] if expected else [])

    def test_factor_one_never_sleeps(self, monkeypatch):
        monkeypatch.setattr(clock_module.time, "sleep", lambda s: pytest.fail(f"slept {s}"))
        assert emulate_slower_device(1.0, 0.5, 0.5) == 0.0


def _timings(compute, wait, batch):
    return EpochTimings(compute, wait, [c + w + 0.001 for c, w in zip(compute, wait)], [batch] * len(compute))


class TestSummaryAndHistory:
    def test_epoch_summary(self):
        s = epoch_summary([_timings([0.1, 0.1, 0.5], [0.2, 0.2, 0.2], 8), _timings([0.3, 0.3, 0.3], [0.0] * 3, 8)])
        assert s["compute_s"] == pytest.approx([0.1, 0.3])
        assert s["wait_s"] == pytest.approx([0.2, 0.0])
        assert s["imbalance"] == pytest.approx(3.0)
        assert s["wait_fraction"][0] == pytest.approx(0.6 / 1.3)
        assert s["samples_per_s"][1] == pytest.approx(24 / 0.903)
        assert math.isnan(epoch_summary([_timings([0.1], [0.0], 4), EpochTimings()])["imbalance"])

    def test_epoch_summary_describes_the_allocation_not_the_tail(self):
        """The tail (a smaller last global batch) neither sets the epoch's batch size nor enters the medians: the
        rebalancer pairs the two, and the tail's size with the full steps' time gave nonsense per-sample costs."""
        full = EpochTimings([0.02, 0.021, 0.019, 0.006], [0.001] * 4, [0.03] * 4, [64, 64, 64, 21])
        s = epoch_summary([full, _timings([0.02, 0.02, 0.02, 0.02], [0.0] * 4, 4)])
        assert s["batch_sizes"] == [64, 4]
        assert s["compute_s"][0] == pytest.approx(0.02)  # median of the three full steps (0.0195 with the tail)
        assert s["steps"] == [4, 4] and s["compute_total_s"][0] == pytest.approx(0.066)
        tie = epoch_summary([EpochTimings([0.1, 0.2], [0.0, 0.0], [0.1, 0.2], [3, 5])])
        assert tie["batch_sizes"] == [5] and tie["compute_s"] == [pytest.approx(0.2)]

    def test_gather_single_process_and_tensor_round_trip(self):
        t = _timings([0.1, 0.2], [0.0, 0.1], 5)
        assert gather_timings(t, 1, torch.device("cpu")) == [t]
        assert EpochTimings.from_tensor(t.as_tensor()) == t

    def test_history_thins_long_series(self, monkeypatch):
        monkeypatch.setattr(history_module, "_MAX_SERIES_POINTS", 10)
        history = TelemetryHistory()
        for epoch in range(3):
            history.add([_timings([0.1] * 8, [0.0] * 8, 4)] * 2, epoch=epoch, global_step=8 * (epoch + 1))
        batches = history.series["batch"][0]
        assert len(batches) <= 10 and batches[0] == 1.0 and batches == sorted(batches)
        history.record_check({"adopt": True, "batch_sizes": [5, 3]}, epoch=2, global_step=24, old=[4, 4])
        history.record_check({"adopt": False, "batch_sizes": [5, 3]}, epoch=3, global_step=32, old=[5, 3])
        assert len(history.checks) == 2 and history.rebalances[0]["batch"] == 24

    def test_loggers_receive_per_replica_keys(self):
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
    history = TelemetryHistory()
    for epoch in range(2):
        history.add([_timings([0.1 * (r + 1)] * 5, [0.05] * 5, 4) for r in range(world)], epoch=epoch, global_step=5)
    history.record_check(
        {"adopt": True, "batch_sizes": [4] * world, "reason": "test"}, epoch=0, global_step=5, old=[4] * world
    )
    report = {
        "global_batch_size": 4 * world,
        "batch_sizes": [4] * world,
        "speeds": [1.0] * world,
        "telemetry": report_module._plain(history.as_dict()),
    }
    report["telemetry"]["epochs"][0]["imbalance"] = float("nan")  # must not leak into the JSON
    paths = write_balance_report(report, tmp_path / "out")
    assert paths["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    loaded = json.loads(paths["json"].read_text())  # strict JSON: no NaN
    assert loaded["telemetry"]["epochs"][0]["imbalance"] is None
    table = paths["table"].read_text()
    assert "| 0 | 4 |" in table and "end of epoch 0" in table
    assert format_balance_table({"batch_sizes": []}).startswith("HeterogeneousStrategy: no allocation")


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
