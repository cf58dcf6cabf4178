"""Allocation: the batch sizes, speeds, loss scale and cost model a strategy holds, and their plain-data forms."""

from types import SimpleNamespace

import pytest

from lightning_het.balance.cost import AffineCost
from lightning_het.balance.state import Allocation, render_balance_table


def _report(allocation: Allocation, **overrides):
    values = {"node_ids": [0, 0], "profiled": True, "emulate_slowdown": None, "devices": ["cpu", "cpu"]}
    return allocation.report(**{**values, **overrides}, telemetry=None)


def test_adopt_sets_sizes_speeds_global_batch_and_loss_scale():
    allocation = Allocation()
    allocation.adopt([2, 6], [1.0, 3.0], rank=1)
    assert allocation.batch_sizes == [2, 6] and allocation.speeds == [1.0, 3.0]
    assert allocation.global_batch_size == 8
    assert allocation.loss_scale == pytest.approx(2 * 6 / 8)
    allocation.adopt([4, 4], [1.0, 1.0], rank=1, costs=[AffineCost(0.1, 0.01).as_dict()] * 2)
    assert allocation.cost_model == [AffineCost(0.1, 0.01)] * 2 and allocation.loss_scale == 1.0


def test_reset_returns_to_plain_ddp():
    allocation = Allocation()
    allocation.adopt([2, 6], [1.0, 3.0], rank=0)
    allocation.reset()
    assert allocation.batch_sizes is None and allocation.loss_scale == 1.0


def test_export_import_round_trip():
    worker = Allocation()
    worker.adopt([3, 5], [3.0, 5.0], rank=0)
    worker.cost_model = [AffineCost(0.1, 0.02), AffineCost(0.2, 0.01)]
    worker.profile_seconds, worker.profile_cached = 1.5, True
    state = worker.export([0, 1], {"epochs": []})
    parent = Allocation()
    parent.import_(state, rank=1)
    assert parent.batch_sizes == [3, 5] and parent.speeds == [3.0, 5.0] and parent.global_batch_size == 8
    assert parent.loss_scale == pytest.approx(2 * 5 / 8)
    assert parent.cost_model == worker.cost_model and parent.profile_seconds == 1.5 and parent.profile_cached
    assert parent.telemetry_snapshot == {"epochs": []} and state["node_ids"] == [0, 1]


def test_step_batch_sizes_follow_the_tail_only_for_the_allocated_sampler():
    allocation = Allocation()
    allocation.adopt([2, 6], [1.0, 3.0], rank=0)
    tail = SimpleNamespace(
        batch_sizes=[2, 6], tail_batch_sizes=[1, 3], split_schedule=None, step_batch_sizes=lambda step: [1, 3]
    )
    assert allocation.step_batch_sizes(None, lambda: 0) == [2, 6]
    assert allocation.step_batch_sizes(tail, lambda: None) == [2, 6]  # no trainer
    assert allocation.step_batch_sizes(tail, lambda: 5) == [1, 3]
    other = SimpleNamespace(batch_sizes=[4, 4], tail_batch_sizes=[1, 3], split_schedule=None)
    assert allocation.step_batch_sizes(other, lambda: 5) == [2, 6]
    assert allocation.step_loss_scale([2, 6], rank=0) == allocation.loss_scale
    assert allocation.step_loss_scale([1, 3], rank=0) == pytest.approx(2 * 1 / 4)


def test_report_and_table():
    allocation = Allocation()
    assert render_balance_table(_report(allocation)) == "HeterogeneousStrategy: no allocation yet"
    allocation.adopt([2, 6], [10.0, 30.0], rank=0)
    allocation.cost_model = [AffineCost(0.01, 0.001), AffineCost(0.01, 0.0005)]
    report = _report(allocation, emulate_slowdown=[1.0, 2.0])
    assert report["shares"] == [0.25, 0.75] and report["emulate_slowdown"] == [1.0, 2.0]
    assert report["predicted_step_s"] == pytest.approx(0.013)
    table = render_balance_table(report)
    assert table.splitlines()[0] == "HeterogeneousStrategy balance: global batch 8"
    assert "samples/s" in table and "step ms" in table and "predicted step" in table
    assert "(given)" in render_balance_table(_report(allocation, profiled=False))


def test_table_shows_the_micro_batches_that_run():
    allocation = Allocation()
    allocation.adopt([16, 4, 4], [4.0, 1.0, 1.0], rank=0)
    allocation.micro_caps = [3, 64, 64]
    allocation.cost_model = [AffineCost(0.002, 0.001, micro_batch=3), AffineCost(0.0, 0.004), AffineCost(0.0, 0.004)]
    report = _report(allocation, node_ids=[0, 0, 0], devices=["cpu"] * 3)
    assert report["max_micro_batch_sizes"] == [3, 64, 64]
    assert report["predicted_step_s"] == pytest.approx(6 * 0.002 + 0.016)
    lines = render_balance_table(report).splitlines()
    assert "micro" in lines[1] and " 3x4+2x2 " in lines[2] and " 4x1 " in lines[3]  # 16 samples: [3, 3, 3, 3, 2, 2]
    assert lines[2].split()[-1] == "28.00"  # 6 micro-batches x 2 ms + 16 x 1 ms
    even = Allocation()
    even.adopt([9, 3], [3.0, 1.0], rank=0)
    even.micro_caps = [4, 12]
    lines = render_balance_table(_report(even, node_ids=[0, 0], devices=["cpu"] * 2)).splitlines()
    assert lines[2].endswith(" 3x3") and lines[3].endswith(" 3x1")  # 9 samples under a cap of 4 run as [3, 3, 3]
    parent = Allocation()
    parent.import_(allocation.export(None, None), rank=1)
    assert parent.micro_caps == [3, 64, 64]
