"""The sync of ``comm="node_local"`` in one process: codecs, merge weights, the outer step and its state."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_het import NodeLocal
from lightning_het.cluster.topology import NodeGroups, node_members
from lightning_het.comm import node_local as node_local_module
from lightning_het.comm.hierarchical import HierarchicalState
from lightning_het.comm.node_local import INT8_BLOCK, compressed_sum, decode, encode, merge_weights, wire_bytes


@pytest.mark.parametrize("dtype, bound", [("int8", 0.5 / 127), ("bfloat16", 2.0**-8)])
def test_codec_round_trip_and_error_feedback(monkeypatch: pytest.MonkeyPatch, dtype: str, bound: float) -> None:
    torch.manual_seed(0)
    x = torch.randn(3 * INT8_BLOCK + 5) * torch.linspace(0.01, 10, 3 * INT8_BLOCK + 5)
    payload = encode(x, dtype)
    assert payload.dtype == torch.uint8 and payload.numel() == wire_bytes(x.numel(), dtype)
    y = decode(payload, x.numel(), dtype)
    assert ((y - x).abs() <= bound * x.abs().max() + 1e-12).all()
    # the exchange keeps what the encoding lost: the next one carries it, so the sum over syncs stays close
    _single(monkeypatch)
    state = HierarchicalState(_fake_groups([0, 1], 0), 0)
    first = x.clone()
    residual = compressed_sum(state, first, dtype, None)
    assert torch.equal(first, y) and torch.equal(residual, x - y)  # type: ignore[arg-type]
    second = x.clone()
    residual = compressed_sum(state, second, dtype, residual)
    assert torch.allclose(2 * x - (first + second), residual, atol=1e-5)  # type: ignore[arg-type]
    assert residual.abs().max() <= 1.01 * bound * x.abs().max()  # type: ignore[union-attr]  # one rounding, not two


def test_int8_zero_block_and_sizes() -> None:
    x = torch.zeros(INT8_BLOCK + 1)
    assert torch.equal(decode(encode(x, "int8"), x.numel(), "int8"), x)
    assert wire_bytes(10, "int8") == 10 + 4 and wire_bytes(10, "bfloat16") == 20 and wire_bytes(10, "float32") == 40
    with pytest.raises(ValueError, match="`sync_dtype` to be one of"):
        NodeLocal(sync_dtype="fp8")  # type: ignore[arg-type]


def test_merge_weights() -> None:
    # node 0: 2 samples, node 1: 8 -> by samples 0.2 / 0.8, by nodes 0.5 / 0.5
    assert merge_weights([1, 1, 3, 5], [0, 0, 1, 1]) == [0.1, 0.1, 0.3, 0.5]
    assert merge_weights([1, 1, 3, 5], [0, 0, 1, 1], by="nodes") == [0.25, 0.25, 0.1875, 0.3125]
    # today's weights b_r / B, bit for bit, after any number of equal steps
    for k in (1, 7, 16):
        assert merge_weights([k * 3, k * 5, k * 7], [0, 0, 1]) == [3 / 15, 5 / 15, 7 / 15]


def _fake_groups(node_ids: list[int], rank: int) -> NodeGroups:
    members = tuple(tuple(m) for m in node_members(node_ids))
    return NodeGroups(tuple(node_ids), rank, members, None, None, None)  # type: ignore[arg-type]


class _FakeDDP:
    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params

    def parameters(self) -> list[torch.Tensor]:
        return self.params

    def register_comm_hook(self, state: Any, hook: Any) -> None:
        pass


def _single(monkeypatch: pytest.MonkeyPatch) -> None:
    """This replica is the only one sending: the other node's leader sends zeros, a float32 sum is the vector."""

    def done(state: Any, vector: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        future.set_result(vector)
        return future

    def all_gather(out: list[torch.Tensor], payload: torch.Tensor, group: Any = None) -> None:
        out[0].copy_(payload)
        for other in out[1:]:
            other.zero_()  # zero bytes decode to zeros (int8: scales of 0; bfloat16: 0.0)

    monkeypatch.setattr(node_local_module, "hierarchical_sum", done)
    monkeypatch.setattr(node_local_module.dist, "all_gather", all_gather)


def _local(algorithm: NodeLocal, p: torch.Tensor) -> NodeLocal:
    """``algorithm`` installed on one parameter ``p`` as rank 0 of two nodes (fake groups)."""
    algorithm.install(_FakeDDP([p]), [], [0, 1], 0, [1, 1], groups=_fake_groups([0, 1], 0))
    return algorithm


def _sync(algorithm: NodeLocal) -> dict[str, float]:
    """A sync after local steps (the replicas no longer agree); the stats after it."""
    algorithm.load_state_dict({"in_consensus": False, "samples": [1, 0]})  # this replica's weight: 1 (one replica)
    assert algorithm.sync()
    return algorithm.stats


def test_nesterov_outer_step(monkeypatch: pytest.MonkeyPatch) -> None:
    _single(monkeypatch)
    p = torch.zeros(3)
    merge = _local(NodeLocal(outer="nesterov"), p)
    expected = torch.zeros(3)
    momentum = torch.zeros(3)
    for round_ in range(3):
        p -= 1.0 + round_  # the local steps moved the replica
        delta = expected - p
        momentum = 0.9 * momentum + delta if round_ else delta.clone()
        expected = expected - 0.7 * (delta + 0.9 * momentum)
        stats = _sync(merge)
        assert torch.allclose(p, expected) and torch.allclose(merge.state_dict()["merge"]["anchor"][0], expected)
    assert stats["global_syncs"] == 3


def test_plain_outer_sgd_is_the_average_and_state_resumes(monkeypatch: pytest.MonkeyPatch) -> None:
    _single(monkeypatch)
    p = torch.zeros(5)
    assert _local(NodeLocal(), p).state_dict()["merge"] == {}  # the plain float32 average: no outer state
    plain = _local(NodeLocal(sync_dtype="int8"), p)
    p += 2.0
    stats = _sync(plain)
    assert torch.allclose(p, torch.full((5,), 2.0)) and stats["job_bytes_inter_total"] == 2 * (5 + 4)  # two leaders
    # a new outer step takes the saved state when its optimizer is built (after a resume)
    first = _local(NodeLocal(outer="nesterov"), p)
    p += 1.0
    _sync(first)
    q = p.clone()
    second = _local(NodeLocal(outer="nesterov"), q)
    second.load_state_dict(first.state_dict())
    for merge, param in ((first, p), (second, q)):
        param += 1.0
        _sync(merge)
    assert torch.equal(first.state_dict()["merge"]["anchor"][0], second.state_dict()["merge"]["anchor"][0])
    assert torch.equal(p, q)
    with pytest.raises(ValueError, match="`outer` to be None"):
        NodeLocal(outer="adam")  # type: ignore[arg-type]


def test_the_merge_weighs_the_samples_since_the_last_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    weights: list[float] = []

    def fake_average(params: Any, weight: float, state: Any) -> int:
        weights.append(weight)
        return 100

    monkeypatch.setattr(node_local_module, "average_parameters", fake_average)
    p = torch.zeros(5, requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.1)
    algorithm = NodeLocal(sync_every=2)
    algorithm.install(_FakeDDP([p]), [opt], [0, 0, 1], 2, [2, 3, 5], groups=_fake_groups([0, 0, 1], 2))
    opt.step()
    algorithm.set_batch_sizes([4, 4, 2])  # e.g. the profiled split after the first step, or the epoch's tail
    opt.step()
    assert weights == [(5 + 2) / (10 + 10)]  # not 2 / 10, the last step's share
    assert algorithm.state_dict() == {"samples": [0, 0, 0], "in_consensus": True, "merge": {}}
