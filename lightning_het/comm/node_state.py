"""Each node's own state in a ``comm="node_local"`` checkpoint: its parameters and inner optimizer state (the replicas
of a node hold the same ones: they all-reduce their gradients every step) and its leader's error-feedback residual.

A save gathers them to rank 0 (:func:`gather_node_record`); a resume with the same node layout (number of nodes and
replicas per node) gives every rank its node's (:func:`node_index`). The rest is pure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from lightning_utilities.core.apply_func import apply_to_collection

from lightning_het.cluster.topology import node_members


def node_layout(node_ids: Sequence[int]) -> list[int]:
    """Replicas per node, in node order (normalised node ids: node 0 holds rank 0).

    >>> node_layout([0, 1, 0, 1, 1])
    [2, 3]
    """
    return [len(m) for m in node_members(node_ids)]


def is_leader(node_ids: Sequence[int], rank: int) -> bool:
    """Whether ``rank`` is its node's leader (the node's lowest rank)."""
    return node_members(node_ids)[node_ids[rank]][0] == rank


def node_record(entries: Sequence[Any], node_ids: Sequence[int]) -> dict[str, Any]:
    """The checkpoint's per-node record from one ``(optimizer_states, residual[, params])`` entry per global rank, of
    which only the leaders' are read: ``layout`` (:func:`node_layout`), then per node its ``optimizer_states``,
    ``residual`` and ``params`` (its model's parameters, in the module's order; ``None`` when not given)."""
    leaders = [entries[m[0]] for m in node_members(node_ids)]
    return {
        "layout": node_layout(node_ids),
        "optimizer_states": [entry[0] for entry in leaders],
        "residuals": [entry[1] for entry in leaders],
        "params": [entry[2] if len(entry) > 2 else None for entry in leaders],
    }


def node_index(record: Mapping[str, Any] | None, node_ids: Sequence[int], rank: int) -> int | None:
    """The index in ``record`` of ``rank``'s node when the record's layout is this run's, else ``None`` (no record,
    or another number of nodes or of replicas per node)."""
    if not record or layout_change(record, node_ids) is not None:
        return None
    return node_ids[rank]


def layout_change(record: Mapping[str, Any] | None, node_ids: Sequence[int]) -> str | None:
    """Why ``record``'s per-node states do not apply to this run's nodes (``None``: they do, or there is none)."""
    if not record:
        return None
    saved, now = [int(n) for n in record.get("layout", [])], node_layout(node_ids)
    if saved == now:
        return None
    return f"the checkpoint's nodes held {saved} replicas, this run's hold {now}"


def gather_node_record(
    optimizer_states: Any,
    residual: torch.Tensor | None,
    node_ids: Sequence[int],
    rank: int,
    params: Sequence[torch.Tensor] | None = None,
) -> dict[str, Any] | None:
    """Gather every leader's ``optimizer_states``, ``residual`` and ``params`` (its node's model) to rank 0 over the
    default group (a collective: call it on every rank); the :func:`node_record` on rank 0, ``None`` elsewhere. The
    other leaders' tensors arrive on the CPU; rank 0's own are kept as they are (a checkpoint then stores node 0's
    optimizer state once), except its ``params``, copied (the module goes on training)."""
    send = rank != 0 and is_leader(node_ids, rank)
    own = None if params is None else [p.detach() for p in params]
    mine = apply_to_collection((optimizer_states, residual, own), torch.Tensor, torch.Tensor.cpu) if send else None
    gathered: list[Any] | None = [None] * len(node_ids) if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if gathered is None:
        return None
    gathered[0] = (optimizer_states, residual, None if own is None else [p.clone() for p in own])
    return node_record(gathered, node_ids)
