"""Sample-share-weighted parameter averaging across all replicas (the global sync of ``comm="node_local"``)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from lightning_het.cluster.topology import node_members
from lightning_het.comm.hooks import HierarchicalState, hierarchical_sum


def share_weights(batch_sizes: Sequence[int]) -> list[float]:
    """Averaging weight of each replica, ``b_r / B``; they sum to one.

    >>> share_weights([1, 3])
    [0.25, 0.75]
    """
    total = sum(batch_sizes)
    if total <= 0 or any(b < 0 for b in batch_sizes):
        raise ValueError(
            f"Expected argument `batch_sizes` to hold non-negative counts with a positive sum, but got {batch_sizes}."
        )
    return [b / total for b in batch_sizes]


def merge_weights(samples: Sequence[int], node_ids: Sequence[int], by: str = "samples") -> list[float]:
    """Weight of each replica in a sync, from the samples each processed since the last one.

    ``by="samples"``: ``s_r / S``, so a node counts as much as the data it trained on; ``by="nodes"``: every node
    ``1 / N`` (what DiLoCo and torch's model averagers do), split inside a node by its replicas' samples.

    >>> merge_weights([2, 2, 4], [0, 0, 1])
    [0.25, 0.25, 0.5]
    >>> merge_weights([6, 6, 4], [0, 0, 1], by="nodes")
    [0.25, 0.25, 0.5]
    """
    shares = share_weights(samples)
    if by == "samples":
        return shares
    members = node_members(node_ids)
    out = [0.0] * len(shares)
    for ranks in members:
        node_total = sum(samples[r] for r in ranks)
        for r in ranks:
            out[r] = samples[r] / (node_total * len(members)) if node_total else 1.0 / (len(ranks) * len(members))
    return out


def unique_floating(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The floating-point tensors of ``tensors``, each once, in order."""
    seen: set[int] = set()
    out: list[torch.Tensor] = []
    for t in tensors:
        if id(t) in seen or not torch.is_floating_point(t):
            continue
        seen.add(id(t))
        out.append(t)
    return out


@torch.no_grad()
def average_parameters(tensors: Iterable[torch.Tensor], weight: float, state: HierarchicalState) -> int:
    """Replace every tensor by the weighted sum over replicas, ``sum_r weight_r * t_r``, in place (``weight``:
    this rank's, normally ``b_rank / B``); returns the payload bytes per rank, for byte accounting."""
    params = unique_floating(tensors)
    buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p in params:
        buckets.setdefault((p.device, p.dtype), []).append(p)
    payload = 0
    pending = []
    for (_, dtype), members in buckets.items():
        acc = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        flat = torch.cat([p.detach().reshape(-1).to(acc) for p in members])
        flat.mul_(weight)
        payload += flat.numel() * flat.element_size()
        pending.append((members, flat, hierarchical_sum(state, flat)))
    for members, flat, fut in pending:
        fut.wait()
        offset = 0
        for p in members:
            n = p.numel()
            p.detach().copy_(flat[offset : offset + n].view_as(p))
            offset += n
    return payload
