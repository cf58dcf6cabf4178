"""ProportionalDistributedSampler and UnpaddedDistributedSampler."""

from __future__ import annotations

import pytest
from torch.utils.data import DataLoader

from lightning_het import ProportionalDistributedSampler, UnpaddedDistributedSampler


def _batches(dataset, sizes, rank, epoch=0, **kw):
    sampler = ProportionalDistributedSampler(dataset, sizes, rank, **kw)
    sampler.set_epoch(epoch)
    return [b.tolist() for b in DataLoader(dataset, batch_size=sizes[rank], sampler=sampler)]


class TestProportionalDistributedSampler:
    @pytest.mark.parametrize("sizes", [[2, 4, 6], [1, 1], [5], [3, 1, 7, 2]])
    @pytest.mark.parametrize("shuffle", [True, False])
    @pytest.mark.parametrize("epoch", [0, 3])
    def test_union_equals_single_process(self, sizes, shuffle, epoch):
        dataset = list(range(103))
        single = _batches(dataset, [sum(sizes)], 0, epoch, shuffle=shuffle, seed=5)
        per_rank = [_batches(dataset, sizes, r, epoch, shuffle=shuffle, seed=5) for r in range(len(sizes))]
        assert len(single) == 103 // sum(sizes)
        for step, global_batch in enumerate(single):
            union = [i for r in range(len(sizes)) for i in per_rank[r][step]]
            assert union == global_batch
            assert [len(per_rank[r][step]) for r in range(len(sizes))] == sizes

    def test_equal_batch_counts_and_len(self):
        dataset = list(range(50))
        samplers = [ProportionalDistributedSampler(dataset, [2, 4, 6], r) for r in range(3)]
        assert [len(s) for s in samplers] == [8, 16, 24]
        assert {len(s) // b for s, b in zip(samplers, [2, 4, 6])} == {4}
        assert all(len(list(s)) == len(s) for s in samplers)

    def test_tail_dropped_and_no_duplicates(self):
        dataset = list(range(50))
        seen = [i for r in range(3) for i in ProportionalDistributedSampler(dataset, [2, 4, 6], r, seed=1)]
        assert len(seen) == len(set(seen)) == 48

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


class TestUnpaddedDistributedSampler:
    @pytest.mark.parametrize(("n", "weights"), [(10, [1, 2, 3]), (7, [1, 1]), (2, [1, 1, 1]), (100, [5, 1])])
    def test_each_sample_exactly_once(self, n, weights):
        dataset = list(range(n))
        parts = [list(UnpaddedDistributedSampler(dataset, weights, r)) for r in range(len(weights))]
        assert sorted(i for p in parts for i in p) == dataset
        assert [len(p) for p in parts] == [
            len(UnpaddedDistributedSampler(dataset, weights, r)) for r in range(len(weights))
        ]

    def test_shares_follow_weights(self):
        parts = [len(UnpaddedDistributedSampler(list(range(60)), [1, 2, 3], r)) for r in range(3)]
        assert parts == [10, 20, 30]
