"""lightning_het.data.splitting: reading a user's DataLoader and rebuilding it around our samplers (no processes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler, WeightedRandomSampler

from lightning_het import ProportionalDistributedSampler
from lightning_het.data.sampler import EvalBatchSampler
from lightning_het.data.splitting import as_batch_size, rebuild_loader, training_order
from tests.helpers.tiny import make_dataset


@pytest.mark.parametrize(
    ("value", "expected"),
    [(8, 8), (np.int64(8), 8), (np.int32(3), 3), (0, None), (-2, None), (True, None), (8.0, None), ("8", None)],
)
def test_as_batch_size(value, expected):
    assert as_batch_size(value) == expected


class TestTrainingOrder:
    def test_plain_samplers(self):
        data = make_dataset(10)
        assert training_order(DataLoader(data, batch_size=2, shuffle=True)).shuffle is True
        order = training_order(DataLoader(data, batch_size=2, drop_last=True))
        assert order.shuffle is False and order.sampler is None and order.drop_last is True and order.batch_size == 2

    def test_custom_sampler_is_kept(self):
        data = make_dataset(10)
        weighted = WeightedRandomSampler(torch.ones(10), 12)
        assert training_order(DataLoader(data, batch_size=2, sampler=weighted)).sampler is weighted
        with_replacement = RandomSampler(data, replacement=True)
        assert training_order(DataLoader(data, batch_size=2, sampler=with_replacement)).sampler is with_replacement
        fewer = RandomSampler(data, num_samples=6)
        assert training_order(DataLoader(data, batch_size=2, sampler=fewer)).sampler is fewer

    def test_random_sampler_of_one_permutation_is_a_plain_shuffle(self):
        data = make_dataset(10)
        for sampler in (RandomSampler(data), RandomSampler(data, num_samples=10)):
            order = training_order(DataLoader(data, batch_size=2, sampler=sampler))
            assert order.shuffle is True and order.sampler is None

    def test_plain_batch_sampler_is_read_as_sampler_and_batch_size(self):
        data = make_dataset(10)
        inner = SequentialSampler(data)
        loader = DataLoader(data, batch_sampler=BatchSampler(inner, 3, drop_last=True))
        order = training_order(loader)
        assert order.shuffle is False and order.drop_last is True and order.batch_size == 3

    def test_custom_batch_sampler_refused(self):
        data = make_dataset(10)
        custom = type("Buckets", (BatchSampler,), {})(SequentialSampler(data), 3, False)
        with pytest.raises(ValueError, match=r"batch sampler \(Buckets\).*HINT"):
            training_order(DataLoader(data, batch_sampler=custom))


class TestRebuildLoader:
    def test_no_batch_size_gets_default_collate(self):
        data = make_dataset(12)
        loader = DataLoader(data, batch_size=None)
        sampler = ProportionalDistributedSampler(data, [2, 4], 1, shuffle=False)
        batches = list(rebuild_loader(loader, sampler, 4))
        x, y = batches[0]
        assert x.shape == (4, 4) and y.shape == (4, 1)  # stacked, as with batch_size=4
        assert torch.equal(x, data.tensors[0][2:6])

    def test_no_batch_size_keeps_a_per_sample_collate(self):
        data = make_dataset(12)
        loader = DataLoader(data, batch_size=None, collate_fn=lambda sample: sample[0] * 2)
        sampler = ProportionalDistributedSampler(data, [2, 4], 0, shuffle=False)
        first = next(iter(rebuild_loader(loader, sampler, 2)))
        assert torch.equal(first, data.tensors[0][:2] * 2)

    def test_tail_batch_comes_last(self):
        data = make_dataset(14)  # global batch 6: 2 whole batches, then a tail of 2 split [1, 1]... of [2, 4]
        sampler = ProportionalDistributedSampler(data, [2, 4], 1, shuffle=False)
        sizes = [len(b[0]) for b in rebuild_loader(DataLoader(data, batch_size=3), sampler, 4)]
        assert sizes == [4, 4, 1]


class TestRebuildWithBatchSampler:
    def test_batches_of_varying_size_keep_the_collate_function(self):
        data = make_dataset(41)
        loader = DataLoader(data, batch_size=5, collate_fn=lambda samples: len(samples), num_workers=0)
        batches = EvalBatchSampler(data, [3, 1], 0, 5)
        rebuilt = rebuild_loader(loader, batches.sampler, 1, batch_sampler=batches)
        assert type(rebuilt) is DataLoader and rebuilt.batch_size is None
        assert list(rebuilt) == [7, 6, 6, 6, 6] and len(rebuilt) == 5


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"global_batch_size": 0}, "global_batch_size"),
        ({"global_batch_size": True}, "global_batch_size"),
        ({"eval_batch_size": 0}, "eval_batch_size"),
        ({"eval_batch_size": 2.5}, "eval_batch_size"),
        ({"num_workers": -1}, "num_workers"),
    ],
)
def test_datamodule_rejects_bad_sizes(kwargs, name):
    from lightning_het import HeterogeneousDataModule

    with pytest.raises(ValueError, match=f"`{name}`"):
        HeterogeneousDataModule(**kwargs)
    module = HeterogeneousDataModule(global_batch_size=np.int64(12), num_workers=0)
    assert (module.global_batch_size, module.eval_batch_size) == (12, 12) and type(module.global_batch_size) is int
