"""``comm="node_local"``: gradients combined inside each node every step, parameters averaged across nodes every K."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.nn.parallel import DistributedDataParallel

from lightning_het.cluster.topology import NodeGroups
from lightning_het.comm.allreduce import FlatAllReduce
from lightning_het.comm.averaging import average_parameters, share_weights
from lightning_het.comm.hooks import HierarchicalState, NodeLocalState, node_local_hook
from lightning_het.comm.stats import CommStats, Traffic, hierarchical_traffic, node_local_traffic

__all__ = ["NodeLocal"]


class NodeLocal(FlatAllReduce):
    """Node-local optimisation steps plus a periodic share-weighted parameter average (resumes in phase).

    Args:
        node_ids, rank, stats: as :class:`~lightning_het.comm.allreduce.FlatAllReduce`.
        groups: the node process groups.
        chunk_bytes: pipelining granularity of the exact steps and the averages.
        batch_sizes: samples per step of every replica (the merge weights).
        global_sync_every: ``K``, optimizer steps between averages, or ``None``.
        warmup_steps: the first steps reduce gradients exactly over all replicas.
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
    ) -> None:
        super().__init__(node_ids, rank, stats)
        self.hierarchy = HierarchicalState(groups, chunk_bytes)
        self.state = NodeLocalState(self.hierarchy, batch_sizes, warmup_steps)
        self.sync_every = global_sync_every
        self.warmup_steps = warmup_steps
        self._batch_sizes = list(batch_sizes)
        self._in_consensus = True

    def describe(self) -> str:
        return f" K={self.sync_every} warmup={self.warmup_steps}"

    def register(self, ddp_model: DistributedDataParallel) -> None:
        ddp_model.register_comm_hook(self.state, node_local_hook)

    def step_traffic(self, grad_bytes: int, global_step: int) -> Traffic:
        if global_step <= self.warmup_steps:
            return hierarchical_traffic(grad_bytes, self.node_ids)
        return node_local_traffic(grad_bytes, self.node_ids)

    def after_step(self, params: list[torch.Tensor], global_step: int, end_of_epoch: bool) -> bool:
        self.state.completed_steps = global_step
        if global_step > self.warmup_steps:
            self._in_consensus = False
        due = (
            self.sync_every is not None
            and global_step > self.warmup_steps
            and (global_step - self.warmup_steps) % self.sync_every == 0
        )
        return self.synchronize(params) if due or end_of_epoch else False

    def synchronize(self, params: list[torch.Tensor]) -> bool:
        if self._in_consensus:
            return False
        weight = share_weights(self._batch_sizes)[self.rank]
        payload = average_parameters(params, weight, self.hierarchy)
        self.stats.record_sync(hierarchical_traffic(payload, self.node_ids))
        self._in_consensus = True
        return True

    def set_step(self, completed_steps: int) -> None:
        self.state.completed_steps = completed_steps

    def set_batch_sizes(self, batch_sizes: list[int]) -> None:
        self._batch_sizes = list(batch_sizes)
        self.state.set_batch_sizes(self._batch_sizes)
