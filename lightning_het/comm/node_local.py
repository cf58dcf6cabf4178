"""``comm="node_local"``: gradients combined inside each node every step, parameters averaged across nodes every K."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from lightning_het.cluster.topology import NodeGroups
from lightning_het.comm.allreduce import FlatAllReduce
from lightning_het.comm.averaging import average_parameters, merge_weights
from lightning_het.comm.hooks import HierarchicalState, NodeLocalState, node_local_hook
from lightning_het.comm.node_state import gather_node_record, is_leader, layout_change, node_index
from lightning_het.comm.outer import OuterStep, ParameterAverage
from lightning_het.comm.stats import (
    CommStats,
    Traffic,
    compressed_sync_traffic,
    hierarchical_traffic,
    node_local_traffic,
)

log = logging.getLogger(__name__)


class NodeLocal(FlatAllReduce):
    """Node-local optimisation steps plus a merge of the replicas' models every ``global_sync_every`` steps.

    The merge weighs each replica by the samples it trained on since the last one (``merge_by="samples"``) or each
    node equally (``"nodes"``); what it does with them is ``merge``'s (:mod:`lightning_het.comm.outer`).

    Observing the model changes nothing: :meth:`consensus` computes the weighted average of the replicas' models
    without a merge (no outer step, the residual and the schedule untouched), which a checkpoint stores as its weights
    and :meth:`show_consensus` puts into the module for an evaluation until :meth:`hide_consensus` gives every replica
    its own model back. A checkpoint's :meth:`state_dict` and :meth:`gather_node_states` hold the rest of the state
    (each node's parameters, inner optimizer state and residual; the anchor and the outer optimizer's state).
    """

    mode = "node_local"

    def __init__(
        self,
        node_ids: Sequence[int],
        rank: int,
        stats: CommStats,
        *,
        groups: NodeGroups,
        chunk_bytes: int,
        batch_sizes: list[int],
        global_sync_every: int | None,
        warmup_steps: int = 0,
        merge: ParameterAverage | OuterStep | None = None,
        merge_by: str = "samples",
    ) -> None:
        super().__init__(node_ids, rank, stats)
        self.hierarchy = HierarchicalState(groups, chunk_bytes)
        self.state = NodeLocalState(self.hierarchy, batch_sizes, warmup_steps)
        self.sync_every = global_sync_every
        self.warmup_steps = warmup_steps
        self._batch_sizes = list(batch_sizes)
        self._in_consensus = True
        self.merge = ParameterAverage() if merge is None else merge
        self.merge_by = merge_by
        self._samples = [0] * len(self._batch_sizes)  # per replica, since the last sync
        self._params: list[torch.Tensor] = []  # the module's parameters (set by `register`)
        self._own: list[torch.Tensor] | None = None  # this replica's own parameters while the consensus is shown

    def describe(self) -> str:
        return f" K={self.sync_every} warmup={self.warmup_steps}"

    def register(self, ddp_model: DistributedDataParallel) -> None:
        ddp_model.register_comm_hook(self.state, node_local_hook)
        self._params = list(ddp_model.parameters())
        self.merge.begin(self._params)  # DDP broadcast rank 0's model: the replicas agree

    def step_traffic(self, grad_bytes: int, global_step: int) -> Traffic:
        if global_step <= self.warmup_steps:
            return hierarchical_traffic(grad_bytes, self.node_ids)
        return node_local_traffic(grad_bytes, self.node_ids)

    def after_step(self, params: list[torch.Tensor], global_step: int, end_of_epoch: bool) -> bool:
        self.state.completed_steps = global_step
        if global_step > self.warmup_steps:
            self._in_consensus = False
            self._samples = [s + b for s, b in zip(self._samples, self._batch_sizes)]
        else:
            self.merge.begin(params)  # an exact step: the replicas still agree
        due = (
            self.sync_every is not None
            and global_step > self.warmup_steps
            and (global_step - self.warmup_steps) % self.sync_every == 0
        )
        return self.synchronize(params) if due or end_of_epoch else False

    def _weight(self) -> float:
        """This replica's weight in a merge or a consensus now."""
        samples = self._samples if any(self._samples) else self._batch_sizes
        return merge_weights(samples, self.node_ids, self.merge_by)[self.rank]

    def synchronize(self, params: list[torch.Tensor]) -> bool:
        if self._in_consensus:
            return False
        self.hide_consensus(params)  # a merge of the replicas' own models
        payload, wire = self.merge.merge(params, self._weight(), self.hierarchy)
        traffic = hierarchical_traffic(payload, self.node_ids)
        if wire is not None:
            traffic = compressed_sync_traffic(payload, wire, self.node_ids)
        self.stats.record_sync(traffic)
        self._in_consensus = True
        self._samples = [0] * len(self._samples)
        return True

    @torch.no_grad()
    def consensus(self, params: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """The replicas' ``params`` averaged with the weights the next merge would use, as new tensors, without a
        merge (nothing of the training state changes); ``None`` when the replicas agree or the module shows the
        consensus already. A collective (exact, float32) unless ``None``: call it on every rank."""
        if self._in_consensus or self._own is not None:
            return None
        copies = [p.detach().clone() for p in params]
        average_parameters(copies, self._weight(), self.hierarchy)
        return copies

    @torch.no_grad()
    def show_consensus(self, params: list[torch.Tensor]) -> None:
        """Put the :meth:`consensus` into ``params`` (e.g. for an evaluation), keeping this replica's own values for
        :meth:`hide_consensus`. A collective unless the replicas agree."""
        consensus = self.consensus(params)
        if consensus is None:
            return
        self._own = [p.detach().clone() for p in params]
        for p, c in zip(params, consensus):
            p.copy_(c)

    @torch.no_grad()
    def hide_consensus(self, params: list[torch.Tensor]) -> None:
        """Give ``params`` this replica's own values back after :meth:`show_consensus` (nothing otherwise)."""
        if self._own is None:
            return
        for p, own in zip(params, self._own):
            p.copy_(own)
        self._own = None

    def state_dict(self) -> dict[str, Any]:
        """The merge's state (the anchor and the outer optimizer's), the samples since the last sync and whether the
        replicas agree (the same on every rank; no collective)."""
        return {"samples": list(self._samples), "in_consensus": self._in_consensus, "merge": self.merge.state_dict()}

    def gather_node_states(self, optimizer_states: list[Any]) -> dict[str, Any] | None:
        """Every node's parameters (its own, also while the consensus is shown), inner ``optimizer_states`` and its
        leader's residual, for the ``"nodes"`` entry of :meth:`state_dict` in a checkpoint: a collective over all
        ranks; ``None`` off rank 0."""
        own = self._own if self._own is not None else self._params
        return gather_node_record(optimizer_states, self.merge.residual, self.node_ids, self.rank, own)

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output after :meth:`register`; with a ``"nodes"`` entry of this run's node
        layout, also this rank's node's parameters (the module was loaded with the consensus) and a leader's residual
        (else every node goes on from the consensus and the residual restarts from zero)."""
        if len(state.get("samples", [])) == len(self._samples):
            self._samples = [int(s) for s in state["samples"]]
        self._in_consensus = bool(state.get("in_consensus", True))
        self.merge.load_state_dict(state.get("merge", {}))
        node = node_index(state.get("nodes"), self.node_ids, self.rank)
        if node is None:
            return
        if is_leader(self.node_ids, self.rank):
            self.merge.residual = state["nodes"]["residuals"][node]
        params = (state["nodes"].get("params") or [None] * (node + 1))[node]
        if params is not None and len(params) == len(self._params):
            for p, saved in zip(self._params, params):
                p.copy_(saved)

    def node_optimizer_states(self, state: dict[str, Any]) -> list[Any] | None:
        """This rank's node's inner optimizer states in a checkpoint's ``"nodes"`` entry; ``None`` (rank 0's for every
        node) without one or for another node layout, which rank 0 logs."""
        record = state.get("nodes") or {}
        change = layout_change(record, self.node_ids)
        if change is not None and self.rank == 0:
            log.info(
                "lightning-het comm='node_local': %s, so every node resumes rank 0's inner optimizer state"
                " and the compression residual restarts from zero",
                change,
            )
        return None if not record or change is not None else record["optimizer_states"][self.node_ids[self.rank]]

    def set_step(self, completed_steps: int) -> None:
        self.state.completed_steps = completed_steps

    def set_batch_sizes(self, batch_sizes: list[int]) -> None:
        self._batch_sizes = list(batch_sizes)
        self.state.set_batch_sizes(self._batch_sizes)
