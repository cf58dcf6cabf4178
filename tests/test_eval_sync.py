"""Per-step collectives with uneven shares (speeds [3, 1], 2 CPU replicas, progress bar on): every replica runs the
same number of evaluation batches, sized in proportion to its share, so ``self.log(on_step=True, sync_dist=True)``
and ``self.all_gather`` in evaluation steps pair up (plain DDP finishes these too); ``self.all_gather`` of per-sample
tensors in training steps concatenates the uneven shares; epoch means keep the logged dtype."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers.harness import run_harness
from tests.helpers.tiny import make_dataset, make_net

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("eval_sync")
    result = run_harness("eval_sync", out, {"devices": 2, "speeds": [3.0, 1.0]}, limit=240)
    assert result.returncode == 0, result.output[-6000:]
    assert not result.survivors
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


def _full_mse(n: int) -> float:
    data = make_dataset(n, seed=99)
    with torch.no_grad():
        return nn.functional.mse_loss(make_net()(data.tensors[0]), data.tensors[1]).item()


# 41 samples, loader batch 5, shares 31 / 10: ceil(41 / (5 * 2)) = 5 batches on each replica
PLAN = [[7, 6, 6, 6, 6], [2, 2, 2, 2, 2]]


@pytest.mark.parametrize("stage", ["validate", "test"])
def test_same_number_of_evaluation_batches_each_sample_once(dumps, stage):
    targets = make_dataset(41, seed=99).tensors[1].squeeze(1)
    for rank, d in enumerate(dumps):
        r = d[stage]
        assert r["batches"] == PLAN[rank]
        # the targets gathered step by step are the whole set, each sample once
        assert torch.equal(torch.sort(r["gathered"]).values, torch.sort(targets).values)
        assert r["loss"] == pytest.approx(_full_mse(41), rel=1e-6)
        assert r["loss_dtype"] == torch.float32


def test_fit_sanity_check_validation_and_training_gather(dumps):
    for rank, d in enumerate(dumps):
        r = d["fit"]
        assert r["batch_sizes"] == [6, 2]
        assert r["eval_batches"] == PLAN[rank][:2] + PLAN[rank] * 2  # sanity check, then two epochs
        assert r["train_shapes"] == [(8, 4)] * 10  # [6 + 2 samples, 4 features] at each of 5 steps x 2 epochs
        assert r["train_gathered_ok"]
        assert r["val_loss_dtype"] == torch.float32 and r["train_loss_dtype"] == torch.float32


def test_predict_keeps_lightnings_split_every_sample_once_order_reconstructable(dumps):
    targets = make_dataset(41, seed=99).tensors[1].squeeze(1)
    indices = [i for d in dumps for i in d["predict"]["indices"]]
    assert sorted(indices) == list(range(41))
    for d in dumps:  # each prediction is put back in place by the batch indices Lightning records
        assert torch.equal(d["predict"]["predictions"], targets[d["predict"]["indices"]])
