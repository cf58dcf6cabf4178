"""Micro-batching end to end: a replica whose share exceeds its memory cap runs it in pieces, with the exact gradient
(alone, with gradient accumulation, with the hierarchical reduction), and an out-of-memory error mid-training lowers
its cap once without changing the training. One job of three replicas runs the emulated fits; one job of two replicas
those where the network itself runs out of memory, and the epoch metric logged without ``batch_size``."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_het import ProportionalDistributedSampler
from tests.helpers.harness import run_fits_job
from tests.helpers.tiny import make_dataset, make_net, reference_weights

pytestmark = pytest.mark.slow

_BASE = {"devices": 3, "n": 60, "epochs": 2, "batch_size": 8}  # B = 24: two full global batches and a tail of 12
_STRATEGY = {"speeds": [4, 1, 1], "global_batch_size": 24}
FITS = {
    # the loss logged with sync_dist=True on every step: a collective in every micro-batch of rank 0's six
    "caps": {**_BASE, "log_on_step": True, "strategy": {**_STRATEGY, "max_micro_batch_sizes": [3, 64, 64]}},
    "accumulate": {**_BASE, "accumulate": 2, "strategy": {**_STRATEGY, "max_micro_batch_sizes": [3, 64, 64]}},
    "hierarchical": {
        **_BASE,
        "strategy": {**_STRATEGY, "max_micro_batch_sizes": [3, 64, 64], "comm": "hierarchical", "node_ids": [0, 0, 1]},
    },
    "oom": {  # rank 0 holds 8 samples until epoch 1, then only 5: the first piece of 8 fails, its cap becomes 4
        **_BASE,
        "strategy": {**_STRATEGY, "max_micro_batch_sizes": [8, 64, 64], "emulate_memory_cap": [8, 64, 64]},
        "memory_cap_from_epoch": [1, [5, 64, 64]],
    },
    "lower_from_start": {**_BASE, "strategy": {**_STRATEGY, "max_micro_batch_sizes": [4, 64, 64]}},
    # a BatchNorm network: every piece through DDP (under no_sync) and Lightning's backward
    "batchnorm": {**_BASE, "batchnorm": True, "strategy": {**_STRATEGY, "max_micro_batch_sizes": [3, 64, 64]}},
}


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in b)


def _auto(cache: str) -> dict:
    """Caps measured on the first step (the replicas hold 8, 64 and 64 samples), stored in the profile cache."""
    strategy = {**_STRATEGY, "max_micro_batch_sizes": "auto", "emulate_memory_cap": [8, 64, 64], "profile_cache": cache}
    return {**_BASE, "strategy": strategy}


@pytest.fixture(scope="module")
def fits(tmp_path_factory) -> dict[str, tuple[list[dict], str]]:
    out = tmp_path_factory.mktemp("micro")
    cache = str(out / "cache")
    configs = {**FITS, "auto": _auto(cache), "auto_again": _auto(cache)}
    results = run_fits_job(out, list(configs.values()), limit=400)
    return dict(zip(configs, results))


@pytest.mark.parametrize("name", ["caps", "hierarchical"])
def test_micro_batched_share_trains_exactly(fits, name):
    dumps, out = fits[name]
    reference = reference_weights(make_dataset(60), 24, epochs=2, seed=0)
    assert dumps[0]["batch_sizes"] == [16, 4, 4] and dumps[0]["seen_batch_sizes"] == [16, 16, 8] * 2
    assert dumps[0]["report"]["max_micro_batch_sizes"] == [3, 64, 64]
    assert " 3x4+2x2\n" in out  # the balance table: the pieces that run (16 samples, cap 3: [3, 3, 3, 3, 2, 2])
    assert all(_max_diff(d["state_dict"], reference) < 1e-5 for d in dumps)
    if name == "hierarchical":
        assert dumps[0]["comm_mode"] == "hierarchical"
    else:  # the step's last micro-batch synchronised the logged loss: one value on every replica
        assert dumps[0]["step_loss"] > 0 and len({d["step_loss"] for d in dumps}) == 1


def test_micro_batches_compose_with_gradient_accumulation(fits):
    dumps, _ = fits["accumulate"]
    reference = reference_weights(make_dataset(60), 24, epochs=2, seed=0, accumulate=2)
    assert all(_max_diff(d["state_dict"], reference) < 1e-5 for d in dumps)


def test_out_of_memory_mid_training_lowers_the_cap_once(fits):
    dumps, out = fits["oom"]
    lower, _ = fits["lower_from_start"]
    assert [d["micro_cap"] for d in dumps] == [4, 64, 64]
    assert "rank(s) [0] ran out of memory; micro-batch caps now [4, 64, 64]" in out
    assert all(_max_diff(d["state_dict"], lower[0]["state_dict"]) < 1e-5 for d in dumps)
    reference = reference_weights(make_dataset(60), 24, epochs=2, seed=0)
    assert all(_max_diff(d["state_dict"], reference) < 1e-5 for d in dumps)


def test_auto_caps_measured_within_one_search_step_below_then_cached(fits):
    dumps, out = fits["auto"]
    # rank 0: 16 fails, 8 fits, 12, 10 and 9 fail; ranks 1 and 2: 4, 8, 16 and 24 (the global batch) fit
    assert [d["micro_cap"] for d in dumps] == [8, 24, 24]
    assert [d["micro_search_steps"] for d in dumps] == [5, 4, 4]
    assert "micro-batch caps [8, 24, 24] (measured in [5, 4, 4] trial steps)" in out
    reference = reference_weights(make_dataset(60), 24, epochs=2, seed=0)  # the trial steps leave no trace
    assert all(_max_diff(d["state_dict"], reference) < 1e-5 for d in dumps)
    again, out = fits["auto_again"]
    assert "micro-batch caps [8, 24, 24] (from the profile cache)" in out
    assert [d["micro_search_steps"] for d in again] == [0, 0, 0]


def test_batchnorm_pieces_train_with_rank_0s_buffers_broadcast_once_per_step(fits):
    """Normalisation uses each piece's own statistics; the running statistics are broadcast from rank 0 before each
    step's first forward, as DDP does (the checkpoint saves rank 0's)."""
    dumps, _ = fits["batchnorm"]
    assert dumps[0]["seen_batch_sizes"] == [16, 16, 8] * 2
    assert dumps[0]["backward_hooks"] == 30  # Lightning's backward for every piece of rank 0's (6 + 6 + 3 per epoch)
    params = [k for k in dumps[0]["state_dict"] if "running" not in k and "num_batches" not in k]
    for d in dumps[1:]:
        assert max((d["state_dict"][k] - dumps[0]["state_dict"][k]).abs().max().item() for k in params) < 1e-6
    # rank 0's forwards: 6 + 6 + 3 per epoch; the others got rank 0's 27 before the last step, then ran one piece
    assert [int(d["state_dict"]["1.num_batches_tracked"]) for d in dumps] == [30, 28, 28]


_BASE_TWO = {"devices": 2, "n": 36, "epochs": 2, "batch_size": 6}  # B = 12: three global batches per epoch
_STRATEGY_TWO = {"speeds": [3, 1], "global_batch_size": 12}  # shares [9, 3]
FITS_TWO = {
    # rank 0 runs its 9 samples as [3, 3, 3]; the loss logged per epoch without `batch_size`
    "epoch_log": {**_BASE_TWO, "log_epoch_loss": True, "strategy": {**_STRATEGY_TWO, "max_micro_batch_sizes": [4, 12]}},
    # a cap the share fits (one piece), and the network raises torch.OutOfMemoryError above 5 samples on rank 0
    "real_oom": {**_BASE_TWO, "oom_above": [5, 0], "strategy": {**_STRATEGY_TWO, "max_micro_batch_sizes": [12, 12]}},
    "real_oom_auto": {**_BASE_TWO, "oom_above": [5, 0], "strategy": {**_STRATEGY_TWO, "max_micro_batch_sizes": "auto"}},
    # BatchNorm, and rank 0's only piece runs out of memory inside DDP's forward (after its buffer broadcast)
    "bn_oom": {
        **_BASE_TWO,
        "batchnorm": True,
        "oom_above": [5, 0],
        "strategy": {**_STRATEGY_TWO, "max_micro_batch_sizes": [12, 12]},
    },
    "bn_lower": {**_BASE_TWO, "batchnorm": True, "strategy": {**_STRATEGY_TWO, "max_micro_batch_sizes": [4, 12]}},
}


@pytest.fixture(scope="module")
def fits_two(tmp_path_factory) -> dict[str, tuple[list[dict], str]]:
    out = tmp_path_factory.mktemp("micro_two")
    results = run_fits_job(out, list(FITS_TWO.values()), limit=300)
    return dict(zip(FITS_TWO, results))


def _reference_epoch_loss(n: int, global_batch: int, epochs: int) -> float:
    """One process on the global batches: the last epoch's mean loss over its samples (what Lightning logs per
    epoch), each batch's loss taken before its step."""
    dataset = make_dataset(n)
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    sampler = ProportionalDistributedSampler(dataset, [global_batch], 0, shuffle=True, seed=0)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        total, samples = 0.0, 0
        for x, y in DataLoader(dataset, batch_size=global_batch, sampler=sampler):
            loss = nn.functional.mse_loss(net(x), y)
            total, samples = total + loss.item() * len(x), samples + len(x)
            loss.backward()
            opt.step()
            opt.zero_grad()
    return total / samples


def test_epoch_metric_without_batch_size_counts_each_micro_batch_as_what_it_is(fits_two):
    """``self.log(..., on_epoch=True, sync_dist=True)`` without ``batch_size``: Lightning weighs each micro-batch's
    value by the micro-batch's own size, so the epoch value is the unsplit run's (one process)."""
    dumps, out = fits_two["epoch_log"]
    assert dumps[0]["seen_batch_sizes"] == [9, 9, 9] * 2
    expected = _reference_epoch_loss(36, 12, epochs=2)
    assert [d["epoch_loss"] for d in dumps] == [pytest.approx(expected, rel=1e-6)] * 2
    reference = reference_weights(make_dataset(36), 12, epochs=2, seed=0)
    assert all(_max_diff(d["state_dict"], reference) < 1e-6 for d in dumps)
    assert " 3x3\n" in out  # the balance table shows the pieces that run: 9 samples, cap 4: [3, 3, 3]


@pytest.mark.parametrize("name", ["real_oom", "real_oom_auto"])
def test_real_out_of_memory_from_the_model_falls_back_exactly(fits_two, name):
    """No emulation: the network raises ``torch.OutOfMemoryError`` itself (on a share the cap lets run in one piece,
    and in the trial steps of ``"auto"``); the replica lowers its cap and training goes on exactly."""
    dumps, out = fits_two[name]
    reference = reference_weights(make_dataset(36), 12, epochs=2, seed=0)
    assert all(_max_diff(d["state_dict"], reference) < 1e-6 for d in dumps)
    if name == "real_oom":  # 9 samples failed: cap 4, then [3, 3, 3]
        assert [d["micro_cap"] for d in dumps] == [4, 12]
        assert "rank(s) [0] ran out of memory; micro-batch caps now [4, 12]" in out
    else:  # the search: 9 fails, 4 fits, 6 fails, 5 fits
        assert [d["micro_cap"] for d in dumps] == [5, 12]


def test_batchnorm_out_of_memory_in_the_only_micro_batch_finishes_exactly(fits_two):
    """With buffers, a replica whose only piece runs out of memory inside DDP's forward retries without broadcasting
    the buffers a second time (the other replica broadcasts once): the fit ends as one capped from the start."""
    dumps, _ = fits_two["bn_oom"]
    lower, _ = fits_two["bn_lower"]
    assert [d["micro_cap"] for d in dumps] == [4, 12] and dumps[0]["global_step"] == 6
    for d, e in zip(dumps, lower):
        assert _max_diff(d["state_dict"], e["state_dict"]) < 1e-6
