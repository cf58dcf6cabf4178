"""The planner's functions of values: the split of a global batch and the speeds reported with it."""

from __future__ import annotations

import pytest

from lightning_het import allocate_batch_sizes
from lightning_het.balance.cost import AffineCost, costs_from_speeds
from lightning_het.balance.planner import batch_bounds, measured_speeds, split_global_batch


@pytest.mark.parametrize("total", [8, 9, 100])
def test_speeds_of_a_split_kept_equal_within_noise_reproduce_it_when_pinned(total):
    costs = [AffineCost(0.002, 1e-3), AffineCost(0.0021, 1.08e-3)]  # equally fast within the profile's noise
    bounds = batch_bounds(1, None)
    sizes, speeds = split_global_batch(total, [1.0, 1.0], costs, bounds, threshold=1.1)
    assert sizes == allocate_batch_sizes(total, [1.0, 1.0])
    assert speeds[0] == speeds[1] == pytest.approx(sum(b / c(b) for b, c in zip(sizes, costs)) / 2)
    assert allocate_batch_sizes(total, speeds) == sizes  # what a run that pins these speeds splits


def test_speeds_of_an_uneven_split_are_each_replicas_own():
    costs = costs_from_speeds([1, 3])
    sizes, speeds = split_global_batch(48, [1.0, 1.0], costs, batch_bounds(1, None))
    assert sizes == [12, 36] and speeds == pytest.approx([12 / costs[0](12), 36 / costs[1](36)])
    assert allocate_batch_sizes(48, speeds) == sizes
    # the equal split under bounds is the bounded one
    bounded = batch_bounds(1, [3, 64])
    assert measured_speeds([3, 5], costs, bounded)[0] == measured_speeds([3, 5], costs, bounded)[1]
