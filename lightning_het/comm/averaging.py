"""Sample-share-weighted parameter averaging across all replicas (the global sync of ``comm="node_local"``)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from lightning_het.comm.hooks import HierarchicalState, hierarchical_sum

__all__ = ["average_parameters", "share_weights"]


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


def _unique_floating(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
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
    """Replace every tensor by the weighted sum over replicas, ``sum_r weight_r * t_r``, in place.

    Args:
        tensors: parameters (and optionally floating buffers) to average.
        weight: this rank's weight, normally ``b_rank / B`` (:func:`share_weights`).
        state: hierarchical reduction state holding the node groups.

    Returns:
        Payload bytes per rank (size of the packed buffers), for byte accounting.
    """
    params = _unique_floating(tensors)
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
