"""Property-style tests of the pure allocation maths."""

from __future__ import annotations

import math
import random

import pytest

from lightning_het import allocate_batch_sizes
from lightning_het.allocation import loss_scale, proportional_shares


def _random_cases(n: int, seed: int = 0):
    rng = random.Random(seed)
    for _ in range(n):
        world = rng.randint(1, 9)
        speeds = [rng.uniform(0.05, 20.0) for _ in range(world)]
        total = rng.randint(world, 600)
        yield total, speeds


class TestAllocateBatchSizes:
    @pytest.mark.parametrize(("total", "speeds"), list(_random_cases(300)))
    def test_sum_and_within_one_sample_of_share(self, total, speeds):
        sizes = allocate_batch_sizes(total, speeds, min_batch_size=0)
        assert sum(sizes) == total
        for size, speed in zip(sizes, speeds):
            assert abs(size - total * speed / sum(speeds)) < 1.0

    @pytest.mark.parametrize(("total", "speeds"), list(_random_cases(200, seed=1)))
    def test_bounds_respected(self, total, speeds):
        world = len(speeds)
        rng = random.Random(total)
        upper = [rng.randint(2, total) for _ in range(world)]
        if sum(upper) < total:
            upper[0] += total - sum(upper)
        sizes = allocate_batch_sizes(total, speeds, min_batch_size=1, max_batch_sizes=upper)
        assert sum(sizes) == total
        assert all(1 <= s <= u for s, u in zip(sizes, upper))
        # the unbounded replicas stay within one sample of their water-filled share
        shares = proportional_shares(total, speeds, [1] * world, upper)
        assert all(abs(s - x) < 1.0 for s, x in zip(sizes, shares))

    def test_contract_examples(self):
        assert allocate_batch_sizes(12, [1, 2, 3]) == [2, 4, 6]
        assert allocate_batch_sizes(48, [1, 2, 4]) == [7, 14, 27]
        assert allocate_batch_sizes(10, [1, 1, 1]) == [4, 3, 3]

    def test_min_batch_size_lifts_slow_replica(self):
        sizes = allocate_batch_sizes(20, [1, 100], min_batch_size=3)
        assert sizes == [3, 17]

    def test_max_batch_size_spills_to_others(self):
        assert allocate_batch_sizes(30, [10, 1, 1], max_batch_sizes=[10, 30, 30]) == [10, 10, 10]

    def test_deterministic_and_scale_invariant(self):
        assert allocate_batch_sizes(97, [3, 5, 7]) == allocate_batch_sizes(97, [30, 50, 70])

    @pytest.mark.parametrize(
        ("kwargs", "match"),
        [
            ({"global_batch_size": 12, "speeds": [1, 0, 2]}, r"`speeds\[1\]` is 0"),
            ({"global_batch_size": 12, "speeds": [1, -2]}, r"`speeds\[1\]` is -2"),
            ({"global_batch_size": 12, "speeds": [1, math.nan]}, r"`speeds\[1\]` is nan"),
            ({"global_batch_size": 12, "speeds": [math.inf]}, r"`speeds\[0\]` is inf"),
            ({"global_batch_size": 12, "speeds": []}, r"`speeds`.*empty"),
            ({"global_batch_size": 12, "speeds": "ab"}, r"`speeds`"),
            ({"global_batch_size": 0, "speeds": [1]}, r"`global_batch_size`"),
            ({"global_batch_size": 2.5, "speeds": [1]}, r"`global_batch_size`"),
            ({"global_batch_size": 5, "speeds": [1, 1, 1], "min_batch_size": 2}, r"`global_batch_size`=5.*3 replicas"),
            ({"global_batch_size": 12, "speeds": [1, 1], "max_batch_sizes": [4, 4]}, r"`max_batch_sizes`=\[4, 4\]"),
            ({"global_batch_size": 12, "speeds": [1, 1], "max_batch_sizes": [12]}, r"`max_batch_sizes`.*one entry"),
            ({"global_batch_size": 12, "speeds": [1, 1], "max_batch_sizes": [12, 0]}, r"`max_batch_sizes\[1\]`"),
            ({"global_batch_size": 12, "speeds": [1], "min_batch_size": -1}, r"`min_batch_size`"),
            (
                {"global_batch_size": 12, "speeds": [1, 1], "min_batch_size": 3, "max_batch_sizes": [2, 10]},
                r"`max_batch_sizes\[0\]`=2",
            ),
            ({"global_batch_size": 12, "speeds": None}, r"`speeds`"),
        ],
    )
    def test_invalid_input_names_argument(self, kwargs, match):
        with pytest.raises(ValueError, match=match):
            allocate_batch_sizes(**kwargs)


def test_loss_scale_is_world_times_the_sample_share():
    sizes = [2, 4, 6]
    scales = [loss_scale(sizes, r) for r in range(3)]
    assert [s / 3 for s in scales] == pytest.approx([1 / 6, 1 / 3, 1 / 2])
    assert scales == pytest.approx([0.5, 1.0, 1.5])
    # DDP's mean of the scaled gradients equals the share-weighted sum
    assert sum(scales) / 3 == pytest.approx(1.0)
    assert loss_scale([5, 5], 0) == 1.0
