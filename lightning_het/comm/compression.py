"""Compressed inter-node sums of ``comm="node_local"``'s syncs: float32, bfloat16 or int8 (one float32 scale per
block of :data:`INT8_BLOCK` values), with error feedback (docs/communication.md)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from lightning_het.arguments import SYNC_DTYPES
from lightning_het.comm.hooks import HierarchicalState, hierarchical_sum

#: values per int8 scale
INT8_BLOCK = 2048


class Codec:
    """Encoding of one float32 vector as ``dtype`` for the wire, with error feedback (``residual``, this leader's)."""

    def __init__(self, dtype: str = "float32") -> None:
        if dtype not in SYNC_DTYPES:
            raise ValueError(f"Expected argument `sync_dtype` to be one of {list(SYNC_DTYPES)}, but got {dtype!r}.")
        self.dtype = dtype
        self.residual: torch.Tensor | None = None

    def wire_bytes(self, numel: int) -> int:
        """Bytes one leader sends per copy of a vector of ``numel`` values."""
        if self.dtype == "int8":
            return numel + 4 * math.ceil(numel / INT8_BLOCK)
        return numel * (2 if self.dtype == "bfloat16" else 4)

    def encode(self, vector: torch.Tensor) -> torch.Tensor:
        """``vector`` (float32, 1-D) plus the residual, as bytes (``uint8``); keeps what the encoding lost."""
        target = vector if self.residual is None else vector + self.residual.to(vector.device)  # resumed: on the CPU
        payload = _int8_encode(target) if self.dtype == "int8" else target.to(torch.bfloat16).view(torch.uint8)
        self.residual = target - self.decode(payload, target.numel())
        return payload

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        """The float32 vector of ``numel`` values that ``payload`` stands for."""
        if self.dtype == "int8":
            return _int8_decode(payload, numel)
        return payload.view(torch.bfloat16).float()


def _int8_encode(vector: torch.Tensor) -> torch.Tensor:
    n = vector.numel()
    blocks = math.ceil(n / INT8_BLOCK)
    padded = torch.nn.functional.pad(vector, (0, blocks * INT8_BLOCK - n)).view(blocks, INT8_BLOCK)
    scale = (padded.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(padded / scale[:, None]).clamp_(-127, 127).to(torch.int8).reshape(-1)[:n]
    return torch.cat([scale.view(torch.uint8), q.view(torch.uint8)])  # the scales first: aligned for their view


def _int8_decode(payload: torch.Tensor, numel: int) -> torch.Tensor:
    blocks = math.ceil(numel / INT8_BLOCK)
    scale = payload[: 4 * blocks].view(torch.float32)
    q = payload[4 * blocks :].view(torch.int8).float()
    padded = torch.nn.functional.pad(q, (0, blocks * INT8_BLOCK - numel)).view(blocks, INT8_BLOCK)
    return (padded * scale[:, None]).reshape(-1)[:numel]


def compressed_sum(state: HierarchicalState, vector: torch.Tensor, codec: Codec) -> None:
    """Sum a float32 ``vector`` over all replicas, in place: a float32 reduce onto each node leader, the leaders'
    encoded sums all-gathered and decoded in node order (the same result on every node), a broadcast inside each
    node. Float32 runs the exact pipelined :func:`~lightning_het.comm.hooks.hierarchical_sum` instead."""
    if codec.dtype == "float32":
        hierarchical_sum(state, vector).wait()
        return
    groups = state.groups
    if groups.node_size > 1:
        dist.reduce(vector, dst=groups.leader, group=groups.intra_group)
    if groups.is_leader:
        payload = codec.encode(vector)
        gathered = [torch.empty_like(payload) for _ in range(groups.num_nodes)]
        dist.all_gather(gathered, payload, group=groups.leader_group)
        vector.zero_()
        for part in gathered:
            vector.add_(codec.decode(part, vector.numel()))
    if groups.node_size > 1:
        dist.broadcast(vector, src=groups.leader, group=groups.intra_bcast_group)
