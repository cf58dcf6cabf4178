"""Same seed and speeds give bitwise-identical weights; a profiled run differs from a pinned one by rounding only."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.harness import run_fits_job
from tests.helpers.tiny import make_dataset, reference_weights

CFG = {"devices": 2, "epochs": 2, "n": 40, "batch_size": 4, "seed": 0}


def _identical(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_pinning_the_profiled_speeds_reproduces_the_run(tmp_path):
    """Run 1 profiles its speeds (on its first training steps, under trial splits); run 2 pins them.

    Both train on the same global batches with exact gradients, so they end on the same weights up to float rounding
    (the trial splits sum each gradient in another order); the pinned run, whose splits depend on nothing measured,
    is the one that reproduces bit for bit (the replicas agree bit for bit in both runs). Both run in one job, the
    second pinning the speeds the first measured.
    """
    (profiled, _), (pinned, _) = run_fits_job(tmp_path, [{**CFG, "strategy": {}}, {**CFG, "pin_previous_speeds": True}])
    speeds = profiled[0]["speeds"]
    assert profiled[1]["speeds"] == speeds and len(speeds) == 2
    assert [d["speeds"] for d in pinned] == [speeds, speeds]
    for rank in range(2):
        assert pinned[rank]["batch_sizes"] == profiled[rank]["batch_sizes"]
        state = profiled[rank]["state_dict"]
        assert all(torch.allclose(pinned[rank]["state_dict"][k], state[k], atol=1e-6) for k in state)
    for run in (profiled, pinned):
        assert _identical(run[1]["state_dict"], run[0]["state_dict"])  # the replicas agree, bit for bit
    # and the trajectory is the one of a single process on the same global batches
    reference = reference_weights(make_dataset(40), 8, epochs=2, seed=0)
    assert all(torch.allclose(profiled[0]["state_dict"][k], reference[k], atol=1e-6) for k in reference)
