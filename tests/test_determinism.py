"""Same seed and speeds give bitwise-identical weights; profiled speeds are the only run-to-run variation (#7.4)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.tiny import make_dataset, reference_weights

CFG = {"devices": 2, "epochs": 2, "n": 40, "batch_size": 4, "seed": 0}


def _identical(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_pinning_the_profiled_speeds_reproduces_the_run_bit_for_bit(tiny_job):
    """Run 1 profiles its speeds; run 2 pins them: both end with exactly the same weights.

    Same seed, same speeds, identical weights, bit for bit; and since run 1 profiled while run 2 did not, profiling
    changes nothing but the speeds it measures (hence the allocation): pinning ``speeds`` removes the only source of
    run-to-run variation.
    """
    profiled, _ = tiny_job({**CFG, "strategy": {}})
    speeds = profiled[0]["speeds"]
    assert profiled[1]["speeds"] == speeds and len(speeds) == 2
    pinned, _ = tiny_job({**CFG, "strategy": {"speeds": speeds}})
    for rank in range(2):
        assert pinned[rank]["batch_sizes"] == profiled[rank]["batch_sizes"]
        assert _identical(pinned[rank]["state_dict"], profiled[rank]["state_dict"])
    assert _identical(profiled[1]["state_dict"], profiled[0]["state_dict"])  # the replicas agree, bit for bit
    # and the trajectory is the one of a single process on the same global batches
    reference = reference_weights(make_dataset(40), 8, epochs=2, seed=0)
    assert all(torch.allclose(profiled[0]["state_dict"][k], reference[k], atol=1e-6) for k in reference)
