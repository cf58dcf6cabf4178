"""The balance policy: caps agreed at fixed steps (the same on every replica), batch norm policing, the speeds of a
profiled split."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_het import HeterogeneousStrategy, Profiling, allocate_batch_sizes
from lightning_het.balance.cost import AffineCost, costs_from_speeds
from lightning_het.balance.policy import CAPS_AGREED_EVERY, Allocation, BalancePolicy, FitContext
from lightning_het.balance.rebalance import profiled_split
from lightning_het.config import HeterogeneousConfig


def test_caps_agreed_every_few_steps_and_at_the_epoch_end() -> None:
    policy = BalancePolicy(HeterogeneousStrategy(max_micro_batch_sizes=[8, 64]).config)
    policy.place(0, 2, torch.device("cpu"), 2)
    gathered: list[int] = []
    step = 0

    def all_gather(values: list[float]) -> list[list[float]]:
        gathered.append(step)
        return [values, [64.0, 0.0]]

    policy.gather = all_gather  # type: ignore[method-assign]
    assert policy.micro is not None
    for step in range(40):
        if step == 3:  # an out-of-memory error in step 3 halves rank 0's cap; rank 1 learns it at the next agreement
            policy.micro.lower(8, torch.OutOfMemoryError("emulated"))
        policy.agree_caps(step, 40)
        if step == CAPS_AGREED_EVERY - 2:
            assert policy.allocation.micro_caps is None and policy.micro.pending
    assert gathered == [CAPS_AGREED_EVERY - 1, 2 * CAPS_AGREED_EVERY - 1, 39]  # and the epoch's last step
    assert policy.allocation.micro_caps == [4, 64] and not policy.micro.pending


def _norm_model(synced: bool) -> nn.Module:
    norm = nn.SyncBatchNorm(4) if synced else nn.BatchNorm1d(4)
    return nn.Sequential(nn.Linear(3, 4), norm, nn.Linear(4, 1))


def test_sync_batchnorm_is_refused_with_micro_batching_only() -> None:
    def placed(**keywords) -> BalancePolicy:
        policy = BalancePolicy(HeterogeneousStrategy(**keywords).config)
        policy.place(0, 2, torch.device("cpu"), 1)
        return policy

    micro = placed(max_micro_batch_sizes=[8, 64])
    with pytest.raises(
        ValueError, match=r"SyncBatchNorm layer\(s\) \(1\).*HINT: drop `Trainer\(sync_batchnorm=True\)`"
    ):
        micro.check_normalisation(_norm_model(synced=True))
    with pytest.raises(ValueError, match="emulate_memory_cap"):
        placed(emulate_memory_cap=[8, 64]).check_normalisation(_norm_model(synced=True))
    micro.check_normalisation(_norm_model(synced=False))  # per-replica batch norm: warned about, not refused
    assert micro.batchnorm_layers == ["1"]
    norms = nn.Sequential(
        nn.BatchNorm2d(2), nn.LazyBatchNorm3d(), nn.InstanceNorm1d(2), nn.LayerNorm(2), nn.GroupNorm(1, 2)
    )
    micro.check_normalisation(norms)  # every kind of batch norm torch has; the other normalisations are no concern
    assert micro.batchnorm_layers == ["0", "1"]
    plain = placed()
    plain.check_normalisation(_norm_model(synced=True))  # one forward per step on every replica: fine
    assert plain.batchnorm_layers == []


def test_measured_caps_below_what_batch_norm_needs_end_every_replica() -> None:
    """``"auto"`` with batch norm: a replica that cannot hold a micro-batch of 3 (the least cap that never leaves a
    piece of 1) ends the fit with the same message on every replica (after the caps' all-gather)."""
    from lightning_het.balance.memory import EmulatedMemoryCap

    policy = BalancePolicy(HeterogeneousStrategy(max_micro_batch_sizes="auto").config)
    policy.place(0, 1, torch.device("cpu"), 1)
    policy.allocation = Allocation(batch_sizes=[8])
    module = _norm_model(synced=False)
    policy.check_normalisation(module)
    assert policy.micro is not None and policy.micro.least_cap == 3
    EmulatedMemoryCap(0, 2).install(module)
    x = torch.randn(8, 3)
    with pytest.raises(RuntimeError, match=r"not even a training step of 3 sample\(s\) \(the model's batch norm"):
        policy.measure_caps(lambda piece: module(piece).pow(2).mean(), x, nullcontext, module)


@pytest.mark.parametrize("total", [8, 9, 100])
def test_speeds_of_a_split_kept_equal_within_noise_reproduce_it_when_pinned(total):
    costs = [AffineCost(0.002, 1e-3), AffineCost(0.0021, 1.08e-3)]  # equally fast within the profile's noise
    sizes = profiled_split(total, costs, threshold=1.1)
    speeds = BalancePolicy(HeterogeneousStrategy().config).measured_speeds(costs, sizes)
    assert sizes == allocate_batch_sizes(total, [1.0, 1.0])
    assert speeds[0] == speeds[1] == pytest.approx(sum(b / c(b) for b, c in zip(sizes, costs)) / 2)
    assert allocate_batch_sizes(total, speeds) == sizes  # what a run that pins these speeds splits


def test_speeds_of_a_split_that_fixed_costs_shape_reproduce_it_when_pinned():
    """A large fixed cost on the fast replica: its own samples/s would not give the profiled split back when pinned,
    so the reported speeds share the measured total in the split's proportions."""
    costs = [AffineCost(0.002, 5.8e-4), AffineCost(0.0003, 1.73e-3)]  # split [6, 2]; own speeds would give [5, 3]
    sizes = profiled_split(8, costs)
    own = [b / c(b) for b, c in zip(sizes, costs)]
    assert allocate_batch_sizes(8, own) != sizes  # the case this covers
    speeds = BalancePolicy(HeterogeneousStrategy().config).measured_speeds(costs, sizes)
    assert allocate_batch_sizes(8, speeds) == sizes and sum(speeds) == pytest.approx(sum(own))


def test_speeds_of_an_uneven_split_are_each_replicas_own():
    costs = costs_from_speeds([1, 3])
    sizes = profiled_split(48, costs)
    speeds = BalancePolicy(HeterogeneousStrategy().config).measured_speeds(costs, sizes)
    assert sizes == [12, 36] and speeds == pytest.approx([12 / costs[0](12), 36 / costs[1](36)])
    assert allocate_batch_sizes(48, speeds) == sizes
    # the equal split under bounds is the bounded one
    bounded = BalancePolicy(HeterogeneousStrategy(max_batch_sizes=[3, 64]).config)
    assert bounded.measured_speeds(costs, [3, 5])[0] == bounded.measured_speeds(costs, [3, 5])[1]


def test_the_cached_cap_and_cost_are_separate_records(tmp_path) -> None:
    """A replica's micro-batch cap and its cost live under two keys: storing one keeps the other."""
    policy = BalancePolicy(HeterogeneousConfig(profiling=Profiling(cache=str(tmp_path))))
    policy.place(0, 2, torch.device("cpu"), 1)
    policy._fit = FitContext(lambda: (nn.Linear(3, 1), "32-true"), lambda: None, [])
    policy._cache_loader = DataLoader([torch.zeros(3)])
    (cache, key), (_, memory) = policy.cache_entry(), policy.cache_entry(memory=True)
    assert cache is not None and key is not None and memory is not None and key != memory
    cache.put(memory, cap=12)
    cache.put(key, cost=AffineCost(0.01, 0.002), threshold=1.2)
    assert cache.get(memory)["cap"] == 12 and cache.get(key) == {
        "cost": AffineCost(0.01, 0.002),
        "threshold": 1.2,
        "cap": None,
    }
