"""Micro-batching end to end: a replica whose share exceeds its memory cap runs it in pieces, with the exact gradient
(alone, with gradient accumulation, with the hierarchical reduction), and an out-of-memory error mid-training lowers
its cap once without changing the training. One job of three replicas runs every fit."""

from __future__ import annotations

import pytest

from tests.helpers.harness import run_fits_job
from tests.helpers.tiny import make_dataset, reference_weights

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
    # a BatchNorm network: rank 0's six pieces on the direct path, then every piece through DDP and Lightning
    "batchnorm": {**_BASE, "batchnorm": True, "strategy": {**_STRATEGY, "max_micro_batch_sizes": [3, 64, 64]}},
    "batchnorm_full": {
        **_BASE,
        "batchnorm": True,
        "full_micro_path": True,
        "strategy": {**_STRATEGY, "max_micro_batch_sizes": [3, 64, 64]},
    },
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
    assert " 3x6\n" in out  # the balance table: micro-batch size x count
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


def test_batchnorm_pieces_on_the_direct_path_train_as_through_ddp(fits):
    """Normalisation uses each piece's own statistics on either path, so the weights agree; the running statistics
    are rank 0's (DDP broadcasts rank 0's buffers before a step's first forward), which the checkpoint saves."""
    direct, _ = fits["batchnorm"]
    full, _ = fits["batchnorm_full"]
    assert direct[0]["seen_batch_sizes"] == full[0]["seen_batch_sizes"] == [16, 16, 8] * 2
    # Lightning's backward: every piece of rank 0's on the full path (6 + 6 + 3 per epoch); on the direct path the
    # last piece of each step only, but for the first two steps (DDP's first forward, then the one that rebuilds its
    # buckets, a collective that the direct path's buffer broadcast would overtake)
    assert full[0]["backward_hooks"] == 30 and direct[0]["backward_hooks"] == 6 + 6 + 1 + 3
    assert _max_diff(direct[0]["state_dict"], full[0]["state_dict"]) < 1e-6  # rank 0: weights and statistics
    params = [k for k in full[0]["state_dict"] if "running" not in k and "num_batches" not in k]
    for d in direct[1:] + full[1:]:
        assert max((d["state_dict"][k] - full[0]["state_dict"][k]).abs().max().item() for k in params) < 1e-6
    pieces = sum(-(-b // 3) for b in direct[0]["seen_batch_sizes"])  # rank 0's forwards: 6 + 6 + 3 per epoch
    assert int(direct[0]["state_dict"]["1.num_batches_tracked"]) == pieces == 30
