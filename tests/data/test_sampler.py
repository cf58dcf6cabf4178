"""ProportionalDistributedSampler, UnpaddedDistributedSampler and EvalBatchSampler."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler, Sampler, WeightedRandomSampler

from lightning_het import ProportionalDistributedSampler, UnpaddedDistributedSampler
from lightning_het.data.sampler import EvalBatchSampler, draw_sampler_order, eval_batch_plan, tail_batch_sizes


def _batches(dataset, sizes, rank, epoch=0, **kw):
    sampler = ProportionalDistributedSampler(dataset, sizes, rank, **kw)
    sampler.set_epoch(epoch)
    return [b.tolist() for b in DataLoader(dataset, batch_size=sizes[rank], sampler=sampler)]


class TestProportionalDistributedSampler:
    @pytest.mark.parametrize("sizes", [[2, 4, 6], [1, 1], [5], [3, 1, 7, 2]])
    @pytest.mark.parametrize("shuffle", [True, False])
    @pytest.mark.parametrize("epoch", [0, 3])
    @pytest.mark.parametrize("drop_last", [False, True])
    def test_union_equals_single_process(self, sizes, shuffle, epoch, drop_last):
        dataset = list(range(103))
        kw = {"shuffle": shuffle, "seed": 5, "drop_last": drop_last}
        single = _batches(dataset, [sum(sizes)], 0, epoch, **kw)
        per_rank = [_batches(dataset, sizes, r, epoch, **kw) for r in range(len(sizes))]
        tail = 103 % sum(sizes)
        trained_tail = not drop_last and tail >= len(sizes)
        assert len(single) == 103 // sum(sizes) + (not drop_last and tail > 0)
        assert {len(p) for p in per_rank} == {103 // sum(sizes) + trained_tail}  # the same number of steps everywhere
        for step, global_batch in enumerate(single[: len(per_rank[0])]):
            union = [i for r in range(len(sizes)) for i in per_rank[r][step]]
            assert union == global_batch
            if step < 103 // sum(sizes):
                assert [len(per_rank[r][step]) for r in range(len(sizes))] == sizes
        if trained_tail:  # the tail: its own split, every sample of the epoch trained once
            assert [len(per_rank[r][-1]) for r in range(len(sizes))] == tail_batch_sizes(tail, sizes)
            assert sorted(i for b in single for i in b) == dataset

    def test_equal_batch_counts_and_len(self):
        dataset = list(range(50))
        samplers = [ProportionalDistributedSampler(dataset, [2, 4, 6], r) for r in range(3)]
        assert [len(s) for s in samplers] == [8, 16, 24]
        assert {len(s) // b for s, b in zip(samplers, [2, 4, 6])} == {4}
        assert all(len(list(s)) == len(s) for s in samplers)

    def test_tail_dropped_and_no_duplicates(self):
        dataset = list(range(50))
        kw = {"seed": 1, "drop_last": True}
        seen = [i for r in range(3) for i in ProportionalDistributedSampler(dataset, [2, 4, 6], r, **kw)]
        assert len(seen) == len(set(seen)) == 48

    def test_tail_trained_by_default(self):
        dataset = list(range(51))  # 4 whole global batches of 12, then a tail of 3
        samplers = [ProportionalDistributedSampler(dataset, [2, 4, 6], r, seed=1) for r in range(3)]
        assert samplers[0].num_steps == 5 and samplers[0].tail_batch_sizes == [1, 1, 1]
        assert [len(s) for s in samplers] == [9, 17, 25]
        assert sorted(i for s in samplers for i in s) == dataset  # every sample once

    def test_tail_too_small_for_every_replica_is_dropped(self):
        sampler = ProportionalDistributedSampler(list(range(50)), [2, 4, 6], 0, seed=1)  # tail of 2 < 3 replicas
        assert sampler.tail_batch_sizes is None and sampler.dropped_per_epoch == 2 and sampler.num_steps == 4

    @pytest.mark.parametrize(
        ("tail", "sizes", "minimum", "expected"),
        [
            (4, [2, 6], 1, [1, 3]),
            (1, [2, 6], 1, None),
            (6, [2, 4, 6], 1, [1, 2, 3]),
            (5, [2, 4, 6], 2, None),
            (6, [2, 4, 6], 2, [2, 2, 2]),
            (0, [3, 3], 1, None),
            (5, [1, 9], 1, [1, 4]),
        ],
    )
    def test_tail_split(self, tail, sizes, minimum, expected):
        got = tail_batch_sizes(tail, sizes, minimum)
        assert got == expected
        if got is not None:  # never larger than a whole batch: a loader with batch_size=b_r cuts it in one
            assert sum(got) == tail and all(minimum <= t <= b for t, b in zip(got, sizes))

    def test_resume_mid_epoch_includes_tail(self):
        dataset = list(range(27))
        whole = ProportionalDistributedSampler(dataset, [2, 6], 1, seed=3)
        whole.set_epoch(2)
        resumed = ProportionalDistributedSampler(dataset, [2, 6], 1, seed=3)
        resumed.resume(2, 2)
        assert whole.num_steps == 4 and whole.tail_batch_sizes == [1, 2]
        assert list(resumed) == [i for b in whole.iter_batches(2) for i in b] == list(whole)[12:]

    def test_deterministic_across_epochs_and_seeds(self):
        dataset = list(range(40))

        def order(seed, epoch):
            s = ProportionalDistributedSampler(dataset, [3, 5], 1, seed=seed)
            s.set_epoch(epoch)
            return list(s)

        assert order(0, 0) == order(0, 0)
        assert order(0, 0) != order(0, 1)
        assert order(0, 0) != order(1, 0)
        assert order(3, 2) == order(3, 2)

    def test_no_shuffle_keeps_dataset_order(self):
        assert list(ProportionalDistributedSampler(list(range(10)), [1, 2], 1, shuffle=False)) == [1, 2, 4, 5, 7, 8]

    @pytest.mark.parametrize(
        ("args", "match"),
        [
            ((list(range(10)), [4, 8], 0), r"10 samples, fewer than one global batch of 12"),
            ((list(range(10)), [0, 2], 0), r"`batch_sizes`"),
            ((list(range(10)), [1, 2], 2), r"`rank`"),
        ],
    )
    def test_errors(self, args, match):
        with pytest.raises(ValueError, match=match):
            ProportionalDistributedSampler(*args)


class _Reversed(Sampler):
    """A custom sampler using the global torch generator."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(torch.randperm(self.n).flip(0).tolist())

    def __len__(self):
        return self.n


class TestAnySampler:
    @pytest.mark.parametrize(
        "make",
        [
            lambda: WeightedRandomSampler(torch.linspace(0.1, 1.0, 40), 53, replacement=True),
            lambda: WeightedRandomSampler(torch.ones(40), 30, replacement=False),
            lambda: RandomSampler(range(40), replacement=True, num_samples=45),
            lambda: _Reversed(40),
        ],
    )
    @pytest.mark.parametrize("sizes", [[2, 6], [3, 1, 5]])
    def test_union_equals_single_process_order(self, make, sizes):
        dataset = list(range(40))
        epoch, seed = 2, 11
        expected = draw_sampler_order(make(), seed, epoch)  # what one process draws this epoch
        parts = []
        for r in range(len(sizes)):
            s = ProportionalDistributedSampler(dataset, sizes, r, seed=seed, order_sampler=make())
            s.set_epoch(epoch)
            parts.append(list(s.iter_batches()))
        assert {len(p) for p in parts} == {parts[0].__len__()}
        union = [i for step in zip(*parts) for batch in step for i in batch]
        trained = len(expected) - (len(expected) % sum(sizes) if len(expected) % sum(sizes) < len(sizes) else 0)
        assert union == expected[:trained]

    def test_order_same_on_every_replica_and_leaves_rng_alone(self):
        torch.manual_seed(0)
        before = torch.get_rng_state()
        a = draw_sampler_order(WeightedRandomSampler(torch.ones(10), 10), 1, 0)
        torch.manual_seed(99)  # another replica's global state differs
        b = draw_sampler_order(WeightedRandomSampler(torch.ones(10), 10), 1, 0)
        assert a == b and a != draw_sampler_order(WeightedRandomSampler(torch.ones(10), 10), 1, 1)
        torch.manual_seed(0)
        assert torch.equal(before, torch.get_rng_state())


class TestUnpaddedDistributedSampler:
    @pytest.mark.parametrize(("n", "weights"), [(10, [1, 2, 3]), (7, [1, 1]), (3, [1, 1, 1]), (100, [5, 1])])
    def test_each_sample_exactly_once(self, n, weights):
        dataset = list(range(n))
        parts = [list(UnpaddedDistributedSampler(dataset, weights, r)) for r in range(len(weights))]
        assert sorted(i for p in parts for i in p) == dataset
        assert [len(p) for p in parts] == [
            len(UnpaddedDistributedSampler(dataset, weights, r)) for r in range(len(weights))
        ]

    @pytest.mark.parametrize("n", [1, 2, 5])
    def test_tiny_sets_give_every_replica_a_sample(self, n):
        weights = [1, 1, 10]
        parts = [list(UnpaddedDistributedSampler(list(range(n)), weights, r)) for r in range(3)]
        assert all(len(p) >= 1 for p in parts)
        repeats = UnpaddedDistributedSampler(list(range(n)), weights, 0).repeats
        assert repeats == (1 if n >= 3 else -(-3 // n))
        seen = sorted(i for p in parts for i in p)
        assert seen == sorted(list(range(n)) * repeats)  # each sample equally often: means stay exact

    def test_shares_follow_weights(self):
        parts = [len(UnpaddedDistributedSampler(list(range(60)), [1, 2, 3], r)) for r in range(3)]
        assert parts == [10, 20, 30]


class TestEvalBatchSampler:
    CASES = [
        (41, [1, 3], 5),
        (41, [3, 1], 5),
        (100, [5, 1], 8),
        (60, [1, 2, 3], 4),
        (7, [1, 1], 100),
        (101, [100, 1], 4),
    ]

    @pytest.mark.parametrize(("n", "weights", "batch_size"), CASES)
    def test_same_number_of_batches_each_sample_once(self, n, weights, batch_size):
        samplers = [EvalBatchSampler(list(range(n)), weights, r, batch_size) for r in range(len(weights))]
        batches = [list(s) for s in samplers]
        counts = {len(b) for b in batches}
        assert len(counts) == 1 and counts == {len(s) for s in samplers}  # the same number of batches everywhere
        steps = counts.pop()
        world = len(weights)
        assert steps == min(-(-n // (batch_size * world)), min(samplers[0].plan()[0]))
        assert sorted(i for b in batches for batch in b for i in batch) == list(range(n))  # once, no padding
        for s, b in zip(samplers, batches):
            sizes = s.plan()[1][s.rank]
            assert [len(batch) for batch in b] == sizes
            assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1  # even cut of a share

    def test_batches_follow_the_shares_and_batch_size_is_the_mean(self):
        samplers = [EvalBatchSampler(list(range(41)), [3, 1], r, 5) for r in range(2)]
        assert samplers[0].plan()[0] == [31, 10]
        assert [s.plan()[1][s.rank] for s in samplers] == [[7, 6, 6, 6, 6], [2, 2, 2, 2, 2]]
        assert [next(iter(DataLoader(range(41), batch_sampler=s))).tolist() for s in samplers] == [
            list(range(7)),
            [31, 32],
        ]

    def test_a_tiny_share_is_lifted_to_one_sample_per_batch(self):
        # proportional shares would be [100, 1]: one batch of 100 on the fast replica; instead 13 batches of ~7 and 1
        shares, plan = eval_batch_plan(101, [100, 1], 4)
        assert shares == [88, 13] and len(plan[0]) == len(plan[1]) == 13
        assert max(plan[0]) == 7 and plan[1] == [1] * 13

    @pytest.mark.parametrize("n", [1, 2, 5])
    def test_tiny_sets_repeat_and_give_every_replica_one_batch(self, n):
        samplers = [EvalBatchSampler(list(range(n)), [1, 1, 10], r, 4) for r in range(3)]
        repeats = samplers[0].repeats
        assert repeats == (1 if n >= 3 else -(-3 // n))
        assert all(len(s) == 1 for s in samplers)
        seen = sorted(i for s in samplers for batch in s for i in batch)
        assert seen == sorted(list(range(n)) * repeats)

    def test_empty_set(self):
        assert len(EvalBatchSampler([], [1, 1], 0, 4)) == 0
