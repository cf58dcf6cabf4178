"""The sync of ``comm="node_local"`` in one process: codecs, merge weights, the outer step and its state."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_het.cluster.topology import NodeGroups, node_members
from lightning_het.comm import outer as outer_module
from lightning_het.comm.averaging import merge_weights
from lightning_het.comm.compression import INT8_BLOCK, Codec
from lightning_het.comm.controller import CommController
from lightning_het.comm.outer import OuterStep, ParameterAverage, build_merge


@pytest.mark.parametrize("dtype, bound", [("int8", 0.5 / 127), ("bfloat16", 2.0**-8)])
def test_codec_round_trip_and_error_feedback(dtype: str, bound: float) -> None:
    torch.manual_seed(0)
    codec = Codec(dtype)
    x = torch.randn(3 * INT8_BLOCK + 5) * torch.linspace(0.01, 10, 3 * INT8_BLOCK + 5)
    payload = codec.encode(x)
    assert payload.dtype == torch.uint8 and payload.numel() == codec.wire_bytes(x.numel())
    y = codec.decode(payload, x.numel())
    assert ((y - x).abs() <= bound * x.abs().max() + 1e-12).all()
    assert torch.equal(codec.residual, x - y)
    # error feedback: what one encoding loses, the next carries, so the sum over syncs stays close
    sent = y + codec.decode(codec.encode(x), x.numel())
    assert torch.allclose(2 * x - sent, codec.residual, atol=1e-5)
    assert codec.residual.abs().max() <= 1.01 * bound * x.abs().max()  # one rounding, not two


def test_int8_zero_block_and_sizes() -> None:
    codec = Codec("int8")
    x = torch.zeros(INT8_BLOCK + 1)
    assert torch.equal(codec.decode(codec.encode(x), x.numel()), x)
    assert codec.wire_bytes(10) == 10 + 4 and Codec("bfloat16").wire_bytes(10) == 20 and Codec().wire_bytes(10) == 40
    with pytest.raises(ValueError, match="`sync_dtype` to be one of"):
        Codec("fp8")


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


def _single(monkeypatch: pytest.MonkeyPatch) -> None:
    """One replica: the sum over replicas is the vector itself."""
    monkeypatch.setattr(outer_module, "compressed_sum", lambda state, vector, codec: None)


def test_nesterov_outer_step(monkeypatch: pytest.MonkeyPatch) -> None:
    _single(monkeypatch)
    merge = build_merge("nesterov", 0.7, 0.9, "float32")
    assert isinstance(merge, OuterStep)
    p = torch.zeros(3)
    merge.begin([p])
    expected = torch.zeros(3)
    momentum = torch.zeros(3)
    for round_ in range(3):
        p -= 1.0 + round_  # the local steps moved the replica
        delta = expected - p
        momentum = 0.9 * momentum + delta if round_ else delta.clone()
        expected = expected - 0.7 * (delta + 0.9 * momentum)
        assert merge.merge([p], 1.0, None)[1] is None  # type: ignore[arg-type]
        assert torch.allclose(p, expected) and torch.allclose(merge.anchor[0], expected)


def test_plain_outer_sgd_is_the_average_and_state_resumes(monkeypatch: pytest.MonkeyPatch) -> None:
    _single(monkeypatch)
    assert isinstance(build_merge(None, 0.7, 0.9, "float32"), ParameterAverage)
    plain = build_merge(None, 0.7, 0.9, "int8")
    p = torch.zeros(5)
    plain.begin([p])
    p += 2.0
    payload, wire = plain.merge([p], 1.0, None)  # type: ignore[arg-type]
    assert torch.allclose(p, torch.full((5,), 2.0)) and (payload, wire) == (20, 5 + 4)
    # a new outer step takes the saved state when its optimizer is built (after a resume)
    first = build_merge("nesterov", 0.7, 0.9, "float32")
    first.begin([p])
    p += 1.0
    first.merge([p], 1.0, None)  # type: ignore[arg-type]
    second = build_merge("nesterov", 0.7, 0.9, "float32")
    second.load_state_dict(first.state_dict())
    second.begin([p.clone()])
    for merge in (first, second):
        q = merge.anchor[0] + 1.0
        merge.merge([q], 1.0, None)  # type: ignore[arg-type]
    assert torch.equal(first.anchor[0], second.anchor[0])
    with pytest.raises(ValueError, match="`outer_optimizer` to be None"):
        build_merge("adam", 0.7, 0.9, "float32")  # type: ignore[arg-type]


def test_controller_weighs_the_samples_since_the_last_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    weights: list[float] = []

    def fake_average(params: Any, weight: float, state: Any) -> int:
        weights.append(weight)
        return 100

    monkeypatch.setattr(outer_module, "average_parameters", fake_average)
    ctl = CommController("node_local", [0, 0, 1], [2, 3, 5], 2, global_sync_every=2, groups=_fake_groups([0, 0, 1], 2))
    params = [torch.zeros(5, requires_grad=True)]
    ctl.after_optimizer_step(params, 1)
    ctl.set_batch_sizes([4, 4, 2])  # e.g. the profiled split after the first step, or the epoch's tail
    ctl.after_optimizer_step(params, 2)
    assert weights == [(5 + 2) / (10 + 10)]  # not 2 / 10, the last step's share
    assert ctl.state_dict() == {"samples": [0, 0, 0], "in_consensus": True, "merge": {}}
