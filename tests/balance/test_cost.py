"""Affine cost model: fitting, the greedy allocation (against brute force) and useless replicas."""

from __future__ import annotations

import doctest
import itertools
import random
from dataclasses import replace

import pytest

from lightning_het import allocate_batch_sizes
from lightning_het.balance import cost as cost_module
from lightning_het.balance.cost import (
    AffineCost,
    allocate_affine,
    costs_from_speeds,
    fit_affine,
    step_time,
    useless_replica_message,
)


def test_doctests() -> None:
    assert doctest.testmod(cost_module).failed == 0


def _brute_force(total: int, costs: list[AffineCost], lo: int, hi: list[int]) -> float:
    best = float("inf")
    for sizes in itertools.product(*(range(lo, h + 1) for h in hi)):
        if sum(sizes) == total:
            best = min(best, step_time(list(sizes), costs))
    return best


def _random_cost(rng: random.Random) -> AffineCost:
    fixed = rng.choice([0.0, 0.0, rng.uniform(0, 0.05), rng.uniform(0, 0.5)])
    per_sample = rng.choice([rng.uniform(0.001, 0.02), rng.uniform(0.0001, 0.1), 0.0 if fixed > 0 else 0.01])
    return AffineCost(round(fixed, 4), round(per_sample, 5))


class TestAllocateAffine:
    @pytest.mark.parametrize("micro", [False, True], ids=["affine", "micro-batched"])
    @pytest.mark.parametrize("seed", range(300))
    def test_optimal_against_brute_force(self, seed: int, micro: bool) -> None:
        """Also for ``t_r(b) = ceil(b / m_r) a_r + c_r b`` (micro-batches): the exact integer optimum."""
        rng = random.Random(5000 + seed if micro else seed)
        world = rng.randint(1, 4)
        costs = [_random_cost(rng) for _ in range(world)]
        if micro:
            costs = [replace(c, micro_batch=rng.choice([None, 1, 2, 3, 5])) for c in costs]
        lo = rng.choice([0, 1, 1, 2])
        total = rng.randint(max(world * lo, 1), 14)
        hi = [rng.randint(max(lo, 1), total) for _ in range(world)] if rng.random() < 0.4 else [total] * world
        if sum(hi) < total:
            hi[-1] += total - sum(hi)
        sizes = allocate_affine(total, costs, min_batch_size=lo, max_batch_sizes=hi)
        assert sum(sizes) == total
        assert all(lo <= b <= h for b, h in zip(sizes, hi))
        assert step_time(sizes, costs) == pytest.approx(_brute_force(total, costs, lo, hi), abs=1e-12)

    def test_micro_batched_cost(self) -> None:
        cost = AffineCost(0.01, 0.001, micro_batch=3)
        assert [round((cost(b) - 0.001 * b) / 0.01, 9) for b in (1, 3, 4, 7)] == [1, 1, 2, 3]  # micro-batches run
        assert cost(7) == pytest.approx(3 * 0.01 + 0.007)
        assert all(cost(b) <= cost(b + 1) for b in range(1, 40))  # non-decreasing: the greedy allocation is exact
        assert AffineCost.from_dict(cost.as_dict()) == cost and "micro_batch" not in AffineCost(0.1, 0.2).as_dict()
        with pytest.raises(ValueError, match="micro_batch"):
            AffineCost(0.1, 0.2, micro_batch=0)

    def test_fast_replica_with_little_memory_keeps_its_share(self) -> None:
        """Rank 0 four times faster but holding 8 samples: micro-batched, it still takes most of the batch."""
        fast, slow = AffineCost(0.002, 0.001, micro_batch=8), AffineCost(0.002, 0.004, micro_batch=64)
        capped = allocate_affine(48, [replace(fast, micro_batch=None), slow], max_batch_sizes=[8, 64])
        micro = allocate_affine(48, [fast, slow])
        assert capped == [8, 40] and micro[0] > 30
        assert step_time(micro, [fast, slow]) < 0.5 * step_time(capped, [fast, slow])

    @pytest.mark.parametrize("seed", range(50))
    def test_proportional_when_no_fixed_cost(self, seed: int) -> None:
        rng = random.Random(1000 + seed)
        speeds = [rng.uniform(0.5, 8.0) for _ in range(rng.randint(2, 6))]
        total = rng.randint(len(speeds), 500)
        sizes = allocate_affine(total, costs_from_speeds(speeds))
        shares = [total * s / sum(speeds) for s in speeds]
        assert sum(sizes) == total
        # within the optimal step of the proportional model: never worse than the largest-remainder split, and each
        # replica's size within one sample of its share plus the rounding slack of the step
        proportional = allocate_batch_sizes(total, speeds)
        costs = costs_from_speeds(speeds)
        assert step_time(sizes, costs) <= step_time(proportional, costs) + 1e-12
        assert all(b <= share + 1 + 1e-9 + 1 / min(speeds) * max(speeds) for b, share in zip(sizes, shares))

    def test_exactly_proportional(self) -> None:
        assert allocate_affine(70, costs_from_speeds([1, 2, 4])) == [10, 20, 40]
        assert allocate_affine(48, costs_from_speeds([1, 1, 1])) == [16, 16, 16]

    def test_issue_platform(self) -> None:
        costs = [AffineCost(0.040, 0.0005), AffineCost(0.002, 0.006)]
        sizes = allocate_affine(48, costs)
        assert sizes == [39, 9]
        assert step_time(sizes, costs) == pytest.approx(0.0595)

    def test_zero_slope_replica_takes_what_its_bound_allows(self) -> None:
        costs = [AffineCost(0.01, 0.0), AffineCost(0.0, 0.001)]
        sizes = allocate_affine(100, costs)  # rank 1 fills up to rank 0's flat 10 ms, rank 0 takes the rest
        assert sizes[1] in (9, 10) and step_time(sizes, costs) == pytest.approx(0.01)
        assert allocate_affine(100, costs, max_batch_sizes=[30, 100]) == [30, 70]

    def test_bounds_and_minimum(self) -> None:
        costs = [AffineCost(0.0, 0.001), AffineCost(1.0, 0.1)]
        assert allocate_affine(10, costs, min_batch_size=2) == [8, 2]
        assert allocate_affine(10, costs, min_batch_size=0) == [10, 0]

    @pytest.mark.parametrize(
        ("kwargs", "match"),
        [
            ({"global_batch_size": 0}, "global_batch_size"),
            ({"min_batch_size": 5}, "global_batch_size"),
            ({"max_batch_sizes": [1, 1]}, "max_batch_sizes"),
            ({"max_batch_sizes": [4]}, "max_batch_sizes"),
        ],
    )
    def test_invalid_input_names_argument(self, kwargs: dict, match: str) -> None:
        args = {"global_batch_size": 8, "costs": costs_from_speeds([1, 1])} | kwargs
        total, costs = args.pop("global_batch_size"), args.pop("costs")
        with pytest.raises(ValueError, match=match):
            allocate_affine(total, costs, **args)


class TestFit:
    def test_exact_line(self) -> None:
        fit = fit_affine([4, 4, 8, 8], [0.05, 0.05, 0.07, 0.07])
        assert fit.fixed_s == pytest.approx(0.03)
        assert fit.per_sample_s == pytest.approx(0.005)

    def test_negative_intercept_goes_through_origin(self) -> None:
        fit = fit_affine([2, 4], [0.01, 0.03])
        assert fit.fixed_s == 0.0
        assert fit.per_sample_s == pytest.approx((0.02 + 0.12) / 20)

    def test_flat_curve_keeps_a_minimum_slope(self) -> None:
        fit = fit_affine([4, 8], [0.05, 0.049])
        assert fit.per_sample_s > 0
        assert fit(6) == pytest.approx(0.0495, rel=1e-6)

    def test_one_batch_size_is_the_throughput_model(self) -> None:
        assert fit_affine([8, 8], [0.1, 0.1]) == AffineCost(0.0, 0.1 / 8)

    def test_cost_validation(self) -> None:
        with pytest.raises(ValueError, match="fixed_s"):
            AffineCost(-1.0, 0.1)
        with pytest.raises(ValueError, match="both are 0"):
            AffineCost(0.0, 0.0)
        assert AffineCost.from_dict(AffineCost(0.1, 0.2).as_dict()) == AffineCost(0.1, 0.2)


class TestUselessReplicas:
    """A replica whose fixed cost alone is at least the others' best step without it is named, with both steps."""

    @staticmethod
    def _named(costs: list[AffineCost], **bounds) -> list[str]:
        message = useless_replica_message(48, costs, allocate_affine(48, costs, **bounds), [], **bounds) or ""
        return [f"rank {r}" for r in range(len(costs)) if f"rank {r} (rank {r})" in message]

    def test_fixed_cost_above_the_others_best(self) -> None:
        costs = [AffineCost(0.0, 0.001), AffineCost(0.0, 0.001), AffineCost(0.5, 0.0001)]
        assert self._named(costs) == ["rank 2"]
        assert step_time(allocate_affine(48, costs), costs) > 0.5
        assert "24.0 ms without" in (useless_replica_message(48, costs, allocate_affine(48, costs), []) or "")

    def test_useful_replicas_are_not_flagged(self) -> None:
        assert self._named([AffineCost(0.040, 0.0005), AffineCost(0.002, 0.006)]) == []
        assert self._named(costs_from_speeds([1, 2, 4])) == []
        assert self._named(costs_from_speeds([1])) == []

    def test_bounds_that_need_the_replica(self) -> None:
        costs = [AffineCost(0.0, 0.001), AffineCost(0.5, 0.0001)]
        assert self._named(costs) == ["rank 1"]
        assert self._named(costs, max_batch_sizes=[24, 48]) == []  # the others cannot hold the global batch


def test_useless_replica_message(monkeypatch) -> None:
    costs = [AffineCost(0.0, 0.001), AffineCost(0.0, 0.001), AffineCost(0.5, 0.0001)]
    sizes = allocate_affine(48, costs)
    message = useless_replica_message(48, costs, sizes, ["cpu", "cpu", "cuda:0"])
    assert message is not None
    assert "rank 2 (cuda:0)" in message and "500.1 ms with it, 24.0 ms without" in message
    assert "HINT" in message and "device_map=['cpu', 'cpu']" in message
    assert useless_replica_message(48, costs_from_speeds([1, 2]), [16, 32], ["cpu", "cpu"]) is None
    # a gain within timing noise (< 10 %) is not reported
    close = [AffineCost(0.0, 0.001), AffineCost(0.050, 0.001)]
    assert useless_replica_message(48, close, allocate_affine(48, close), ["cpu", "cpu"]) is None
    monkeypatch.setattr(cost_module, "USELESS_MARGIN", 1.0)  # rank 1 is useless, by less than the margin
    assert "rank 1 (cpu)" in (useless_replica_message(48, close, allocate_affine(48, close), ["cpu", "cpu"]) or "")
