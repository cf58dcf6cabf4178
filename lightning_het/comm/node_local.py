"""``comm="node_local"``: gradients reduced inside each node every step, the replicas' models merged every K steps
(a share-weighted average, or an outer optimizer step on the merged pseudo-gradient, optionally compressed)."""

from __future__ import annotations

import copy
import functools
import logging
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np
import torch
import torch.distributed as dist
from lightning_utilities.core.apply_func import apply_to_collection

from lightning_het.arguments import SYNC_DEFAULTS, ArgumentError, check_sync_args, positive_int
from lightning_het.cluster.topology import build_node_groups, node_members
from lightning_het.comm.allreduce import FLAT_FIELDS, CommAlgorithm, hierarchical_traffic, node_local_traffic
from lightning_het.comm.hierarchical import HierarchicalState, hierarchical_sum, node_local_hook

log = logging.getLogger(__name__)

#: values per float32 scale of an int8 exchange
INT8_BLOCK = 2048


def merge_weights(samples: Sequence[int], node_ids: Sequence[int], by: str = "samples") -> list[float]:
    """Each replica's weight in a merge: ``s_r / S`` (``s_r``: its samples since the last), or ``1 / N`` per node.

    >>> merge_weights([2, 2, 4], [0, 0, 1]), merge_weights([6, 6, 4], [0, 0, 1], by="nodes")
    ([0.25, 0.25, 0.5], [0.25, 0.25, 0.5])
    """
    total = sum(samples)
    if total <= 0 or any(s < 0 for s in samples):
        raise ValueError(f"Expected argument `samples` to hold counts with a positive sum, but got {samples}.")
    if by == "samples":
        return [s / total for s in samples]
    members, out = node_members(node_ids), [0.0] * len(samples)
    for ranks in members:
        node_total = sum(samples[r] for r in ranks)
        for r in ranks:
            out[r] = samples[r] / (node_total * len(members)) if node_total else 1.0 / (len(ranks) * len(members))
    return out


def unique_floating(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The floating-point tensors of ``tensors``, each once, in order."""
    return list({id(t): t for t in tensors if torch.is_floating_point(t)}.values())


@torch.no_grad()
def average_parameters(tensors: Iterable[torch.Tensor], weight: float, state: HierarchicalState) -> int:
    """Replace every floating tensor by ``sum_r weight_r * t_r`` over the replicas, in place; the bytes per rank."""
    buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p in unique_floating(tensors):
        buckets.setdefault((p.device, p.dtype), []).append(p)
    payload, pending = 0, []
    for (_, dtype), members in buckets.items():
        acc = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        flat = torch.cat([p.detach().reshape(-1).to(acc) for p in members]).mul_(weight)
        payload += flat.numel() * flat.element_size()
        pending.append((members, flat, hierarchical_sum(state, flat)))
    for members, flat, fut in pending:
        fut.wait()
        for p, part in zip(members, flat.split([p.numel() for p in members])):
            p.detach().copy_(part.view_as(p))
    return payload


def wire_bytes(numel: int, dtype: str) -> int:
    """Bytes one leader sends per copy of a float32 vector of ``numel`` values encoded as ``dtype``."""
    return numel + 4 * math.ceil(numel / INT8_BLOCK) if dtype == "int8" else numel * (2 if dtype == "bfloat16" else 4)


def encode(vector: torch.Tensor, dtype: str) -> torch.Tensor:
    """A float32 1-D ``vector`` as bytes (``uint8``): bfloat16, or int8 with one float32 scale per block."""
    if dtype != "int8":
        return vector.to(torch.bfloat16).view(torch.uint8)
    n, blocks = vector.numel(), math.ceil(vector.numel() / INT8_BLOCK)
    padded = torch.nn.functional.pad(vector, (0, blocks * INT8_BLOCK - n)).view(blocks, INT8_BLOCK)
    scale = (padded.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(padded / scale[:, None]).clamp_(-127, 127).to(torch.int8).reshape(-1)[:n]
    return torch.cat([scale.view(torch.uint8), q.view(torch.uint8)])  # the scales first: aligned for their view


def decode(payload: torch.Tensor, numel: int, dtype: str) -> torch.Tensor:
    """The float32 vector of ``numel`` values that :func:`encode`'s ``payload`` stands for."""
    if dtype != "int8":
        return payload.view(torch.bfloat16).float()
    blocks = math.ceil(numel / INT8_BLOCK)
    scale = payload[: 4 * blocks].view(torch.float32)
    q = torch.nn.functional.pad(payload[4 * blocks :].view(torch.int8).float(), (0, blocks * INT8_BLOCK - numel))
    return (q.view(blocks, INT8_BLOCK) * scale[:, None]).reshape(-1)[:numel]


def compressed_sum(
    state: HierarchicalState, vector: torch.Tensor, dtype: str, residual: torch.Tensor | None
) -> torch.Tensor | None:
    """Sum a float32 ``vector`` over all replicas in place, the leaders' sums (plus their ``residual``) crossing the
    nodes as ``dtype``; this leader's new residual (error feedback)."""
    if dtype == "float32":
        hierarchical_sum(state, vector).wait()
        return residual
    groups = state.groups
    assert groups is not None
    if groups.node_size > 1:
        dist.reduce(vector, dst=groups.leader, group=groups.intra_group)
    if groups.is_leader:
        target = vector if residual is None else vector + residual.to(vector.device)  # resumed: on the CPU
        payload = encode(target, dtype)
        residual = target - decode(payload, target.numel(), dtype)
        gathered = [torch.empty_like(payload) for _ in range(groups.num_nodes)]
        dist.all_gather(gathered, payload, group=groups.leader_group)
        vector.zero_()
        for part in gathered:
            vector.add_(decode(part, vector.numel(), dtype))
    if groups.node_size > 1:
        dist.broadcast(vector, src=groups.leader, group=groups.intra_bcast_group)
    return residual


def layout_change(record: dict[str, Any] | None, node_ids: Sequence[int]) -> str | None:
    """Why ``record``'s per-node states do not apply to this run's nodes (``None``: they do, or there is none)."""
    saved, now = [int(n) for n in (record or {}).get("layout", [])], [len(m) for m in node_members(node_ids)]
    if not record or saved == now:
        return None
    return f"the checkpoint's nodes held {saved} replicas, this run's hold {now}"


@dataclass
class NodeLocal(CommAlgorithm):
    """Node-local steps (gradients reduced inside each node every step) and a merge of the replicas' models every
    ``sync_every`` optimizer steps (``None``: at the epoch ends). ``warmup_steps``: exact steps first. ``outer``:
    what a sync does with the merged pseudo-gradient: ``None`` (the plain weighted average), ``"nesterov"``
    (DiLoCo's outer step with ``outer_lr`` and ``outer_momentum``) or a callable building a ``torch.optim`` optimizer
    from a list of tensors. ``sync_dtype``: the exchange's dtype (``"float32"``, ``"bfloat16"``, ``"int8"``);
    ``merge``: the replicas' weights in it (``"samples"`` trained since the last sync, or ``"nodes"`` equally)."""

    mode: ClassVar[str] = "node_local"
    sync_every: int | None = None
    warmup_steps: int = 0
    outer: Literal["nesterov"] | Callable[..., Any] | None = SYNC_DEFAULTS["outer_optimizer"]
    outer_lr: float = SYNC_DEFAULTS["outer_lr"]
    outer_momentum: float = SYNC_DEFAULTS["outer_momentum"]
    sync_dtype: Literal["float32", "bfloat16", "int8"] = SYNC_DEFAULTS["sync_dtype"]
    merge: Literal["samples", "nodes"] = SYNC_DEFAULTS["merge_weights"]

    def __post_init__(self) -> None:
        positive_int("sync_every", self.sync_every)
        positive_int("warmup_steps", self.warmup_steps, allow_none=False, minimum=0)
        try:
            check_sync_args(self.outer, self.outer_lr, self.outer_momentum, self.sync_dtype, self.merge)
        except ArgumentError as err:  # the same rule, told with this object's names
            message = str(err).replace("outer_optimizer", "outer").replace("merge_weights", "merge")
            raise ArgumentError(FLAT_FIELDS[err.argument], message) from None

    def resolve(self, node_ids: Sequence[int]) -> CommAlgorithm:
        if len(set(node_ids)) < 2:
            raise ValueError(
                f"You set `comm='node_local'`, but all {len(node_ids)} replicas are on one node"
                f" (node_ids={list(node_ids)}), so node-local steps would be exact training. HINT: pass `node_ids` to"
                " declare the nodes (e.g. [0, 0, 1, 1]), launch with one NODE_RANK per node, or use comm='allreduce'."
            )
        return self

    def _start(self, model: Any) -> None:
        self._groups = self._groups or build_node_groups(self._node_ids, self._rank)
        exact = lambda: self._position()[0] < self.warmup_steps  # noqa: E731
        self._hook_state = HierarchicalState(self._groups, self._chunk_bytes, exact)
        self.set_batch_sizes(self._batch_sizes)  # the node's gradient scale
        self._samples = [0] * len(self._node_ids)  # per replica, since the last sync
        self._in_consensus, self._own, self._residual = True, None, None
        outer, momentum = self.outer, self.outer_momentum
        if outer == "nesterov":
            outer = functools.partial(torch.optim.SGD, lr=self.outer_lr, momentum=momentum, nesterov=momentum > 0)
        elif outer is None and self.sync_dtype != "float32":  # compressed, no outer step: SGD with lr 1, the average
            outer = functools.partial(torch.optim.SGD, lr=1.0)
        # the model of the last sync, which the outer optimizer steps (DDP broadcast rank 0's: the replicas agree)
        self._anchor = [p.detach().clone() for p in unique_floating(self._params)] if outer is not None else []
        self._outer: torch.optim.Optimizer | None = None if outer is None else outer(self._anchor)
        model.register_comm_hook(self._hook_state, node_local_hook)

    def set_batch_sizes(self, batch_sizes: Sequence[int]) -> None:
        super().set_batch_sizes(batch_sizes)
        if self._hook_state is not None:
            node_total = sum(self._batch_sizes[r] for r in node_members(self._node_ids)[self._node_ids[self._rank]])
            self._hook_state.node_scale = sum(self._batch_sizes) / (len(self._batch_sizes) * node_total)

    def _describe(self) -> str:
        return f" K={self.sync_every} warmup={self.warmup_steps}"

    def _pattern(self, step: int) -> Callable[[float, Sequence[int]], np.ndarray]:
        return hierarchical_traffic if step <= self.warmup_steps else node_local_traffic

    @torch.no_grad()
    def _after_step(self, step: int, epoch_end: bool) -> None:
        if step <= self.warmup_steps:
            self._begin()  # an exact step: the replicas still agree
            return
        self._in_consensus = False
        self._samples = [s + b for s, b in zip(self._samples, self._batch_sizes)]
        if epoch_end or (self.sync_every is not None and (step - self.warmup_steps) % self.sync_every == 0):
            self.sync()

    @torch.no_grad()
    def _begin(self) -> None:
        """The replicas agree: the anchor of the next outer step is the model now."""
        for a, p in zip(self._anchor, unique_floating(self._params)):
            a.copy_(p)

    def _weight(self) -> float:
        """This replica's weight in a merge or a consensus now."""
        samples = self._samples if any(self._samples) else self._batch_sizes
        return merge_weights(samples, self._node_ids, self.merge)[self._rank]

    @torch.no_grad()
    def sync(self) -> bool:
        if self._in_consensus:
            return False
        self.hide_consensus()  # a merge of the replicas' own models
        ids = self._node_ids
        if self._outer is None:
            traffic = hierarchical_traffic(average_parameters(self._params, self._weight(), self._hook_state), ids)
        else:
            params, device = unique_floating(self._params), self._anchor[0].device
            delta = torch.cat([(a - p.to(device)).reshape(-1).float() for a, p in zip(self._anchor, params)])
            delta.mul_(self._weight())
            self._residual = compressed_sum(self._hook_state, delta, self.sync_dtype, self._residual)
            for a, part in zip(self._anchor, delta.split([a.numel() for a in self._anchor])):
                a.grad = part.view_as(a).to(a.dtype)
            self._outer.step()
            for a, p in zip(self._anchor, params):
                a.grad = None
                p.copy_(a)
            wire = (len(set(ids)) - 1) * wire_bytes(delta.numel(), self.sync_dtype)  # all-gathered between leaders
            traffic = hierarchical_traffic(delta.numel() * 4, ids, None if self.sync_dtype == "float32" else wire)
        self._record_sync(traffic)
        self._in_consensus, self._samples = True, [0] * len(self._samples)
        return True

    @torch.no_grad()
    def consensus(self) -> list[torch.Tensor] | None:
        """The replicas' parameters averaged with the next merge's weights, as new tensors, changing nothing of the
        training; ``None`` when the replicas agree or the consensus is shown. A collective unless ``None``."""
        if self._in_consensus or self._own is not None:
            return None
        copies = [p.detach().clone() for p in self._params]
        average_parameters(copies, self._weight(), self._hook_state)
        return copies

    @torch.no_grad()
    def show_consensus(self) -> None:
        if not (self._in_consensus or self._own is not None):
            self._own = [p.detach().clone() for p in self._params]
            average_parameters(self._params, self._weight(), self._hook_state)

    @torch.no_grad()
    def hide_consensus(self) -> None:
        if self._own is not None:
            for p, own in zip(self._params, self._own):
                p.copy_(own)
            self._own = None

    def consensus_state_dict(self, module: torch.nn.Module, state: dict[str, Any]) -> dict[str, Any]:
        consensus = self.consensus()
        if consensus is None:
            return state
        by_id, out = {id(p): c for p, c in zip(self._params, consensus)}, copy.copy(state)  # copy: keeps `_metadata`
        named = module.named_parameters(remove_duplicate=False)
        out.update((name, by_id[id(p)]) for name, p in named if name in state and id(p) in by_id)
        return out

    def state_dict(self) -> dict[str, Any]:
        """The samples since the last sync, whether the replicas agree, the outer optimizer's state and its anchor
        (the same on every rank)."""
        merge = {}
        if self._outer is not None:
            merge = {"optimizer": copy.deepcopy(self._outer.state_dict()), "anchor": [a.clone() for a in self._anchor]}
        return {"samples": list(self._samples), "in_consensus": self._in_consensus, "merge": merge}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Also, with a ``"nodes"`` record of this run's layout, this rank's node's parameters (the module holds the
        consensus) and a leader's residual; else every node goes on from the consensus, the residual from zero."""
        if not state:
            return
        if len(state.get("samples", [])) == len(self._samples):
            self._samples = [int(s) for s in state["samples"]]
        self._in_consensus = bool(state.get("in_consensus", True))
        merge = state.get("merge") or {}  # the outer optimizer's state and anchor (of this model's shapes)
        if self._outer is not None and merge.get("optimizer") is not None:
            self._outer.load_state_dict(merge["optimizer"])
        anchor = merge.get("anchor") or []
        if len(anchor) == len(self._anchor) and all(a.shape == s.shape for a, s in zip(self._anchor, anchor)):
            for a, saved in zip(self._anchor, anchor):
                a.copy_(saved)
        record = state.get("nodes")
        if not record or layout_change(record, self._node_ids) is not None:
            return
        node = self._node_ids[self._rank]
        if node_members(self._node_ids)[node][0] == self._rank:
            self._residual = record["residuals"][node]
        params = (record.get("params") or [None] * (node + 1))[node]
        if params is not None and len(params) == len(self._params):
            for p, saved in zip(self._params, params):
                p.copy_(saved)

    def gather_node_states(self, optimizer_states: list[Any]) -> dict[str, Any] | None:
        """Every node's own parameters, inner ``optimizer_states`` and leader's residual (one list each, by node),
        gathered to rank 0 (a collective; ``None`` off rank 0; rank 0 keeps its objects, the others' on the CPU)."""
        own = [p.detach() for p in (self._own if self._own is not None else self._params)]
        members, mine = node_members(self._node_ids), (optimizer_states, self._residual, own)
        leads = self._rank != 0 and members[self._node_ids[self._rank]][0] == self._rank
        sent = apply_to_collection(mine, torch.Tensor, torch.Tensor.cpu) if leads else None
        gathered: list[Any] | None = [None] * len(self._node_ids) if self._rank == 0 else None
        dist.gather_object(sent, gathered, dst=0)
        if gathered is None:
            return None
        gathered[0] = (optimizer_states, self._residual, [p.clone() for p in own])
        leaders = [gathered[m[0]] for m in members]
        names = ("optimizer_states", "residuals", "params")
        return {"layout": [len(m) for m in members], **{name: [e[i] for e in leaders] for i, name in enumerate(names)}}

    def node_optimizer_states(self, state: dict[str, Any] | None) -> list[Any] | None:
        """``None`` (rank 0's for every node) without a ``"nodes"`` record or for another layout, which rank 0 logs."""
        record = (state or {}).get("nodes") or {}
        change = layout_change(record, self._node_ids)
        if change is not None and self._rank == 0:
            log.info(
                "lightning-het comm='node_local': %s, so every node resumes rank 0's inner optimizer state"
                " and the compression residual restarts from zero",
                change,
            )
        return None if not record or change is not None else record["optimizer_states"][self._node_ids[self._rank]]
