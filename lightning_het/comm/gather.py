"""``all_gather`` for tensors whose first dimension differs between replicas (speed-proportional batch shares)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor


def all_gather_uneven(tensor: Tensor, group: Any = None, sync_grads: bool = False) -> Tensor:
    """Gather ``tensor`` from every replica of ``group``: equal shapes stacked to ``[W, *shape]`` (as DDP), shapes
    differing in dimension 0 concatenated in rank order, others a ``ValueError``; ``tensor`` when not distributed."""
    return all_gather_collection(tensor, group, sync_grads)


def _structure(data: Any) -> str:
    """A description of where the tensors sit in a nested collection (keys, lengths, types), without their values."""
    if isinstance(data, Tensor):
        return "<T>"
    if isinstance(data, Mapping):
        return "{" + ",".join(f"{k!r}:{_structure(v)}" for k, v in data.items()) + "}"
    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        return type(data).__name__ + _structure({f.name: getattr(data, f.name) for f in dataclasses.fields(data)})
    if isinstance(data, (list, tuple)):
        return f"{type(data).__name__}[" + ",".join(_structure(v) for v in data) + "]"
    return type(data).__name__


def all_gather_collection(data: Any, group: Any = None, sync_grads: bool = False) -> Any:
    """:func:`all_gather_uneven` applied to every tensor of ``data``; other leaves are returned unchanged."""
    if not (dist.is_available() and dist.is_initialized()):
        return data
    group, tensors = group if group is not None else dist.group.WORLD, []
    apply_to_collection(data, Tensor, tensors.append)
    rows: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(rows, (_structure(data), [(tuple(t.shape), str(t.dtype)) for t in tensors]), group=group)
    if len({structure for structure, _ in rows}) > 1:
        counts = ", ".join(f"rank {r}: {structure.count('<T>')}" for r, (structure, _) in enumerate(rows))
        raise ValueError(
            "all_gather: the replicas passed collections of different structure (tensors per replica:"
            f" {counts}), so their gathers cannot pair up. HINT: with uneven batch shares a list of per-sample"
            " values has a different length on each replica: gather one tensor of them"
            " (`torch.tensor(values)`) instead, its first dimension may differ."
        )
    with nullcontext() if sync_grads else torch.no_grad():
        gathered = iter([_gather(t, [r[1][i] for r in rows], group) for i, t in enumerate(tensors)])
    return apply_to_collection(data, Tensor, lambda _: next(gathered))


def _gather(tensor: Tensor, rows: list[tuple[tuple[int, ...], str]], group: Any) -> Tensor:
    """``tensor`` gathered, each replica's shape and dtype in ``rows``."""
    shapes = [shape for shape, _ in rows]
    even = len(set(shapes)) == 1
    ragged = any(len(s) == 0 or s[1:] != shapes[0][1:] for s in shapes)
    if len({dtype for _, dtype in rows}) > 1 or (not even and ragged):
        described = ", ".join(f"rank {r}: {list(s)} {d}" for r, (s, d) in enumerate(rows))
        raise ValueError(
            "all_gather: the replicas' tensors differ in more than their first dimension, so they can be neither"
            f" stacked nor concatenated ({described}). HINT: gather tensors of one dtype whose shapes differ at most"
            " in dimension 0 (the samples of each replica's batch)."
        )
    from torch.distributed.nn.functional import all_gather as differentiable_all_gather

    if even:  # DDP's behaviour: stacked to [W, *shape]
        return torch.stack(differentiable_all_gather(tensor.contiguous(), group))
    padding = tensor.new_zeros((max(s[0] for s in shapes) - tensor.shape[0], *tensor.shape[1:]))
    parts = differentiable_all_gather(torch.cat([tensor, padding]), group)
    return torch.cat([part[: s[0]] for part, s in zip(parts, shapes)])


def reduce_counts(reduce: Any, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
    """``reduce(tensor, ...)`` (a strategy's all-reduce), but an integer mean (Lightning's logged batch-size count,
    which DDP's division would truncate) summed in ``float64`` and returned in the default float dtype."""
    if isinstance(tensor, torch.Tensor) and not (tensor.is_floating_point() or tensor.is_complex()):
        op = reduce_op.lower() if isinstance(reduce_op, str) else reduce_op
        if op in ("mean", "avg", dist.ReduceOp.AVG):
            reduced = reduce(tensor.to(torch.float64), group=group, reduce_op=reduce_op)
            default = torch.get_default_dtype()
            return reduced.to(default if default in (torch.float32, torch.float64) else torch.float32)
    return reduce(tensor, group=group, reduce_op=reduce_op)
