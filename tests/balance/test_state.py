"""Allocation: the immutable value (batch sizes, speeds, loss scale, cost model), its plain data, its report."""

from dataclasses import FrozenInstanceError, asdict
from types import SimpleNamespace

import pytest

from lightning_het import HeterogeneousStrategy
from lightning_het.allocation import loss_scale
from lightning_het.balance.cost import AffineCost
from lightning_het.balance.policy import Allocation, BalancePolicy
from lightning_het.balance.report import balance_report, render_balance_table


def _report(allocation: Allocation, node_ids=(0, 0), profiled=True, emulate_slowdown=None, devices=("cpu", "cpu")):
    config = SimpleNamespace(speeds=None if profiled else [1.0], emulate_slowdown=emulate_slowdown)
    return balance_report(allocation, config, list(node_ids), list(devices))


def test_adopt_sets_sizes_speeds_global_batch_and_loss_scale():
    allocation = Allocation().adopt([2, 6], [1.0, 3.0])
    assert allocation.batch_sizes == [2, 6] and allocation.speeds == [1.0, 3.0]
    assert allocation.global_batch_size == 8
    assert loss_scale(allocation.batch_sizes, 1) == pytest.approx(2 * 6 / 8)
    allocation = allocation.adopt([4, 4], [1.0, 1.0], costs=[AffineCost(0.1, 0.01).as_dict()] * 2)
    assert allocation.cost_model == [AffineCost(0.1, 0.01)] * 2 and loss_scale(allocation.batch_sizes, 1) == 1.0
    with pytest.raises(FrozenInstanceError):
        allocation.batch_sizes = [1, 7]  # type: ignore[misc]


def test_no_allocation_is_plain_ddp():
    allocation, strategy = Allocation(), HeterogeneousStrategy()
    assert allocation.batch_sizes is None and allocation.global_batch_size is None
    assert strategy.batch_sizes is None and strategy.loss_scale == 1.0 and strategy.local_batch_size is None


def test_plain_data_round_trip():
    worker = Allocation(cost_model=[AffineCost(0.1, 0.02), AffineCost(0.2, 0.01)], profile_seconds=1.5)
    worker = Allocation(**{**worker.__dict__, "profile_cached": True}).adopt([3, 5], [3.0, 5.0])
    parent = Allocation.from_dict(asdict(worker))
    assert parent == worker and parent.global_batch_size == 8 and loss_scale(parent.batch_sizes, 1) == 2 * 5 / 8
    assert Allocation.from_dict({}) == Allocation()


def test_step_split_follows_the_tail_only_for_the_allocated_sampler():
    policy = BalancePolicy(HeterogeneousStrategy().config)
    policy.adopt([2, 6], [1.0, 3.0])
    tail = SimpleNamespace(
        batch_sizes=[2, 6], tail_batch_sizes=[1, 3], split_schedule=None, step_batch_sizes=lambda step: [1, 3]
    )
    assert policy.step_split(None, 0).sizes == [2, 6]
    assert policy.step_split(tail, None).sizes == [2, 6]  # no trainer
    assert policy.step_split(tail, 5) == ([1, 3], pytest.approx(2 * 1 / 4))
    other = SimpleNamespace(batch_sizes=[4, 4], tail_batch_sizes=[1, 3], split_schedule=None)
    assert policy.step_split(other, 5) == ([2, 6], loss_scale([2, 6], 0))


def test_report_and_table():
    allocation = Allocation()
    assert render_balance_table(_report(allocation)) == "HeterogeneousStrategy: no allocation yet"
    allocation = Allocation(cost_model=[AffineCost(0.01, 0.001), AffineCost(0.01, 0.0005)]).adopt([2, 6], [10.0, 30.0])
    report = _report(allocation, emulate_slowdown=[1.0, 2.0])
    assert report["shares"] == [0.25, 0.75] and report["emulate_slowdown"] == [1.0, 2.0]
    assert report["predicted_step_s"] == pytest.approx(0.013)
    table = render_balance_table(report)
    assert table.splitlines()[0] == "HeterogeneousStrategy balance: global batch 8"
    assert "samples/s" in table and "step ms" in table and "predicted step" in table
    assert "(given)" in render_balance_table(_report(allocation, profiled=False))


def test_table_shows_the_micro_batches_that_run():
    costs = [AffineCost(0.002, 0.001), AffineCost(0.0, 0.004), AffineCost(0.0, 0.004)]
    allocation = Allocation(cost_model=costs).adopt([16, 4, 4], [4.0, 1.0, 1.0]).with_caps([3, 64, 64])
    assert allocation.cost_model[0] == AffineCost(0.002, 0.001, micro_batch=3)  # the costs follow the caps
    report = _report(allocation, node_ids=[0, 0, 0], devices=["cpu"] * 3)
    assert report["max_micro_batch_sizes"] == [3, 64, 64]
    assert report["predicted_step_s"] == pytest.approx(6 * 0.002 + 0.016)
    lines = render_balance_table(report).splitlines()
    assert "micro" in lines[1] and " 3x4+2x2 " in lines[2] and " 4x1 " in lines[3]  # 16 samples: [3, 3, 3, 3, 2, 2]
    assert lines[2].split()[-1] == "28.00"  # 6 micro-batches x 2 ms + 16 x 1 ms
    even = Allocation().adopt([9, 3], [3.0, 1.0]).with_caps([4, 12])
    lines = render_balance_table(_report(even, node_ids=[0, 0], devices=["cpu"] * 2)).splitlines()
    assert lines[2].endswith(" 3x3") and lines[3].endswith(" 3x1")  # 9 samples under a cap of 4 run as [3, 3, 3]
    assert Allocation.from_dict(asdict(allocation)).micro_caps == [3, 64, 64]


def test_a_spawned_workers_allocation_and_telemetry_reach_the_parent():
    from lightning_het import HeterogeneousStrategy

    worker, parent = HeterogeneousStrategy(), HeterogeneousStrategy()
    worker.adopt_allocation([3, 5], [3.0, 5.0])
    worker._node_ids, worker._telemetry_snapshot = [0, 1], {"epochs": [], "series": {}}
    state = worker.export_allocation()
    assert state["node_ids"] == [0, 1] and state["batch_sizes"] == [3, 5]
    parent.import_allocation(state)
    assert parent.batch_sizes == [3, 5] and parent.speeds == [3.0, 5.0] and parent.node_ids == [0, 1]
    assert parent.balance_report(include_series=True)["telemetry"] == {"epochs": [], "series": {}}
