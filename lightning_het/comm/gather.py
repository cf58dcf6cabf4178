"""``all_gather`` for tensors whose first dimension differs between replicas (speed-proportional batch shares)."""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Mapping
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

_INLINE_DIMS = 8  # dimensions exchanged in the first round; larger ranks take a second round


def _dtype_code(dtype: torch.dtype) -> int:
    return zlib.crc32(str(dtype).encode())


def gather_shapes(tensor: Tensor, group: Any = None) -> tuple[list[tuple[int, ...]], list[int]]:
    """Every replica's ``(shape, dtype code)`` of ``tensor``, in rank order of ``group`` (one or two all-gathers)."""
    world = dist.get_world_size(group)
    meta = torch.zeros(2 + _INLINE_DIMS, dtype=torch.int64, device=tensor.device)
    meta[0], meta[1] = tensor.dim(), _dtype_code(tensor.dtype)
    inline = list(tensor.shape[:_INLINE_DIMS])
    meta[2 : 2 + len(inline)] = torch.tensor(inline, dtype=torch.int64)
    rows = [torch.empty_like(meta) for _ in range(world)]
    dist.all_gather(rows, meta, group=group)
    ranks = [int(r[0]) for r in rows]
    codes = [int(r[1]) for r in rows]
    if max(ranks) <= _INLINE_DIMS:
        return [tuple(int(d) for d in r[2 : 2 + n]) for r, n in zip(rows, ranks)], codes
    full = torch.zeros(max(ranks), dtype=torch.int64, device=tensor.device)
    full[: tensor.dim()] = torch.tensor(list(tensor.shape), dtype=torch.int64)
    rows = [torch.empty_like(full) for _ in range(world)]
    dist.all_gather(rows, full, group=group)
    return [tuple(int(d) for d in r[:n]) for r, n in zip(rows, ranks)], codes


def all_gather_uneven(tensor: Tensor, group: Any = None, sync_grads: bool = False) -> Tensor:
    """Gather ``tensor`` from every replica of ``group`` (default: all); ``tensor`` itself when not distributed.

    Equal shapes are stacked to ``[W, *shape]`` (as DDP); shapes differing only in dimension 0 are concatenated in rank
    order to ``[sum_r n_r, *rest]``; other differences raise ``ValueError``.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return tensor
    group = group if group is not None else dist.group.WORLD
    tensor = tensor.contiguous()
    shapes, codes = gather_shapes(tensor, group)
    even = len(set(shapes)) == 1
    if len(set(codes)) > 1 or (not even and any(len(s) == 0 or s[1:] != shapes[0][1:] for s in shapes)):
        dtypes = _dtype_names(tensor, codes)
        described = ", ".join(f"rank {r}: {list(s)} {d}" for r, (s, d) in enumerate(zip(shapes, dtypes)))
        raise ValueError(
            "all_gather: the replicas' tensors differ in more than their first dimension, so they can be neither"
            f" stacked nor concatenated ({described}). HINT: gather tensors of one dtype whose shapes differ at most"
            " in dimension 0 (the samples of each replica's batch)."
        )
    from torch.distributed.nn.functional import all_gather as differentiable_all_gather

    if even:  # DDP's behaviour: stacked to [W, *shape]
        with nullcontext() if sync_grads else torch.no_grad():
            return torch.stack(differentiable_all_gather(tensor, group))
    most = max(s[0] for s in shapes)
    padded = tensor
    if tensor.shape[0] < most:
        padded = torch.cat([tensor, tensor.new_zeros((most - tensor.shape[0], *tensor.shape[1:]))])
    with nullcontext() if sync_grads else torch.no_grad():
        parts = differentiable_all_gather(padded, group)
        return torch.cat([part[: s[0]] for part, s in zip(parts, shapes)])


def _dtype_names(tensor: Tensor, codes: list[int]) -> list[str]:
    """Names of the replicas' dtypes for an error message (known names from their codes; no extra collective)."""
    known = {_dtype_code(d): str(d) for d in _ALL_DTYPES}
    known[_dtype_code(tensor.dtype)] = str(tensor.dtype)
    return [known.get(c, "an unknown dtype") for c in codes]


_ALL_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)


def _structure(data: Any) -> str:
    """A description of where the tensors sit in a nested collection (keys, lengths, types), without their values."""
    if isinstance(data, Tensor):
        return "T"
    if isinstance(data, Mapping):
        return "{" + ",".join(f"{k!r}:{_structure(v)}" for k, v in data.items()) + "}"
    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        fields = ",".join(f"{f.name}:{_structure(getattr(data, f.name))}" for f in dataclasses.fields(data))
        return f"{type(data).__name__}({fields})"
    if isinstance(data, (list, tuple)):
        return f"{type(data).__name__}[" + ",".join(_structure(v) for v in data) + "]"
    return type(data).__name__


def all_gather_collection(data: Any, group: Any = None, sync_grads: bool = False) -> Any:
    """:func:`all_gather_uneven` applied to every tensor of ``data``; other leaves are returned unchanged."""
    if isinstance(data, Tensor):
        return all_gather_uneven(data, group=group, sync_grads=sync_grads)
    if dist.is_available() and dist.is_initialized():
        group = group if group is not None else dist.group.WORLD
        count = [0]
        apply_to_collection(data, Tensor, lambda t: count.__setitem__(0, count[0] + 1))
        mine = torch.tensor([zlib.crc32(_structure(data).encode()), count[0]], dtype=torch.int64)
        rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(rows, mine, group=group)
        if len({int(r[0]) for r in rows}) > 1:
            counts = ", ".join(f"rank {r}: {int(row[1])}" for r, row in enumerate(rows))
            raise ValueError(
                "all_gather: the replicas passed collections of different structure (tensors per replica:"
                f" {counts}), so their gathers cannot pair up. HINT: with uneven batch shares a list of per-sample"
                " values has a different length on each replica: gather one tensor of them"
                " (`torch.tensor(values)`) instead, its first dimension may differ."
            )
    return apply_to_collection(data, Tensor, all_gather_uneven, group=group, sync_grads=sync_grads)


def reduce_counts(reduce: Any, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
    """``reduce(tensor, group=..., reduce_op=...)`` (a strategy's all-reduce), except that the mean of an integer
    tensor is summed in ``float64`` and returned in the default float dtype.

    Lightning's epoch-level ``self.log(..., sync_dist=True)`` mean-reduces its integer batch-size count; DDP's
    in-place division would truncate it (``(10 + 31) / 2 -> 20``), and with uneven shares every epoch metric would be
    off. The logged ``value / count`` then has the logged value's dtype, as in DDP.
    """
    if isinstance(tensor, torch.Tensor) and not (tensor.is_floating_point() or tensor.is_complex()):
        op = reduce_op.lower() if isinstance(reduce_op, str) else reduce_op
        if op in ("mean", "avg", dist.ReduceOp.AVG):
            reduced = reduce(tensor.to(torch.float64), group=group, reduce_op=reduce_op)
            default = torch.get_default_dtype()
            return reduced.to(default if default in (torch.float32, torch.float64) else torch.float32)
    return reduce(tensor, group=group, reduce_op=reduce_op)
