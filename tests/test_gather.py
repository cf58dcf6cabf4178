"""``all_gather`` with uneven first dimensions (lightning_het.comm.gather, HeterogeneousStrategy.all_gather), and the
dtype of integer means (HeterogeneousStrategy.reduce), on forked gloo processes."""

from __future__ import annotations

import pytest
import torch

from lightning_het import HeterogeneousStrategy
from tests.helpers.gloo import run_gloo


def _rows(rank: int, n: int, width: int = 3) -> torch.Tensor:
    """``n`` rows whose values name the rank and the row: ``100 * rank + row``."""
    return (100 * rank + torch.arange(n, dtype=torch.float32)).unsqueeze(1).repeat(1, width)


def _gather_worker(rank: int, world: int) -> dict:
    strategy = HeterogeneousStrategy()
    out: dict = {}
    # equal shapes: DDP's stacked [W, *shape]
    out["even"] = strategy.all_gather(_rows(rank, 2))
    out["scalar"] = strategy.all_gather(torch.tensor(float(rank)))
    # uneven first dimension (shares 3 and 1): concatenated in rank order
    out["uneven"] = strategy.all_gather(_rows(rank, [3, 1][rank]))
    out["uneven_1d"] = strategy.all_gather(torch.arange([3, 1][rank]) + 10 * rank)
    out["empty_share"] = strategy.all_gather(torch.arange([2, 0][rank]))
    # nested collections: each tensor gathered by its own rule
    out["nested"] = strategy.all_gather({"x": _rows(rank, [3, 1][rank]), "n": [torch.tensor(rank), "label"]})
    # more than the dimensions exchanged in the first round
    out["many_dims"] = strategy.all_gather(torch.full([[3, 1][rank]] + [1] * 9, float(rank)))
    # mismatches: a clear ValueError on every rank, and the group still works afterwards
    for name, tensor in {
        "trailing": torch.zeros(2, 3 + rank),
        "ndim": torch.zeros([2] * (1 + rank)),
        "dtype": torch.zeros(2, dtype=[torch.float32, torch.int64][rank]),
        "scalar_vs_vector": torch.zeros([(), (1,)][rank]),
        "structure": {"values": [torch.tensor(i) for i in range([3, 1][rank])]},  # a per-sample list
    }.items():
        try:
            strategy.all_gather(tensor)
            out[f"error_{name}"] = None
        except ValueError as err:
            out[f"error_{name}"] = str(err)
    out["after_errors"] = strategy.all_gather(torch.tensor([rank]))
    # sync_grads: the gradient of a loss on the gathered tensor reaches each rank's own rows
    x = _rows(rank, [3, 1][rank], width=2).requires_grad_(True)
    gathered = strategy.all_gather(x, sync_grads=True)
    (gathered * torch.arange(1.0, 1.0 + gathered.numel()).view_as(gathered)).sum().backward()
    out["grad"] = x.grad
    return out


@pytest.fixture(scope="module")
def gathered(tmp_path_factory) -> list[dict]:
    return run_gloo(_gather_worker, 2, tmp_path_factory.mktemp("gather"), timeout_s=60)


def test_equal_shapes_are_stacked_as_in_ddp(gathered):
    for out in gathered:
        assert torch.equal(out["even"], torch.stack([_rows(0, 2), _rows(1, 2)]))
        assert torch.equal(out["scalar"], torch.tensor([0.0, 1.0]))


def test_uneven_first_dimension_is_concatenated_in_rank_order(gathered):
    for out in gathered:
        assert torch.equal(out["uneven"], torch.cat([_rows(0, 3), _rows(1, 1)]))
        assert torch.equal(out["uneven_1d"], torch.tensor([0, 1, 2, 10]))
        assert torch.equal(out["empty_share"], torch.tensor([0, 1]))
        assert torch.equal(out["many_dims"].flatten(), torch.tensor([0.0, 0.0, 0.0, 1.0]))
        assert out["many_dims"].shape == (4,) + (1,) * 9


def test_nested_collection(gathered):
    for out in gathered:
        assert torch.equal(out["nested"]["x"], torch.cat([_rows(0, 3), _rows(1, 1)]))
        assert torch.equal(out["nested"]["n"][0], torch.tensor([0, 1]))
        assert out["nested"]["n"][1] == "label"


def test_mismatch_raises_on_every_rank_naming_the_shapes(gathered):
    for out in gathered:
        assert "rank 0: [2, 3] torch.float32, rank 1: [2, 4] torch.float32" in out["error_trailing"]
        assert "rank 0: [2] torch.float32, rank 1: [2, 2] torch.float32" in out["error_ndim"]
        assert "rank 0: [2] torch.float32, rank 1: [2] torch.int64" in out["error_dtype"]
        assert "rank 0: [] torch.float32, rank 1: [1] torch.float32" in out["error_scalar_vs_vector"]
        assert "different structure (tensors per replica: rank 0: 3, rank 1: 1)" in out["error_structure"]
        assert torch.equal(out["after_errors"], torch.tensor([[0], [1]]))


def test_sync_grads_reach_each_ranks_rows(gathered):
    # the loss weights the gathered [4, 2] tensor by 1..8, summed over both ranks' identical losses
    weights = torch.arange(1.0, 9.0).view(4, 2)
    assert torch.equal(gathered[0]["grad"], 2 * weights[:3])
    assert torch.equal(gathered[1]["grad"], 2 * weights[3:])


def test_not_distributed_returns_the_input():
    from lightning_het.comm.gather import all_gather_uneven

    x = torch.arange(3)
    assert all_gather_uneven(x) is x


def _reduce_worker(rank: int, world: int) -> dict:
    strategy = HeterogeneousStrategy()
    count = strategy.reduce(torch.tensor([10, 31][rank]), reduce_op="mean")
    value = strategy.reduce(torch.tensor([1.5, 2.5][rank]), reduce_op="mean")
    total = strategy.reduce(torch.tensor([10, 31][rank]), reduce_op="sum")
    torch.set_default_dtype(torch.float64)
    count64 = strategy.reduce(torch.tensor([10, 31][rank]), reduce_op="mean")
    return {"count": count, "ratio": value / count, "total": total, "count64": count64}


def test_integer_mean_is_exact_and_keeps_the_logged_dtype(tmp_path):
    for out in run_gloo(_reduce_worker, 2, tmp_path, timeout_s=60):
        assert out["count"].dtype == torch.float32 and out["count"].item() == 20.5  # DDP truncates to 20
        assert out["ratio"].dtype == torch.float32  # the logged value / count: float32, as in DDP
        assert out["total"].dtype == torch.int64 and out["total"].item() == 41
        assert out["count64"].dtype == torch.float64 and out["count64"].item() == 20.5
