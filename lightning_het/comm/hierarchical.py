"""``comm="hierarchical"``: exact reduction inside each node, then between node leaders, optionally autotuned."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lightning_het.cluster.topology import NodeGroups
from lightning_het.comm.allreduce import FlatAllReduce
from lightning_het.comm.hooks import HierarchicalState, hierarchical_hook
from lightning_het.comm.stats import CommStats, Traffic, flat_allreduce_traffic, hierarchical_traffic
from lightning_het.comm.tuning import ReductionTuner

log = logging.getLogger(__name__)


class Hierarchical(FlatAllReduce):
    """Node-aware exact reduction; with ``autotune_steps > 0`` timed against a flat all-reduce and the faster kept."""

    mode = "hierarchical"

    def __init__(
        self,
        node_ids: Sequence[int],
        rank: int,
        stats: CommStats,
        *,
        groups: NodeGroups,
        chunk_bytes: int,
        autotune_steps: int = 0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        super().__init__(node_ids, rank, stats)
        self.state = HierarchicalState(groups, chunk_bytes)
        #: the measured flat-vs-hierarchical choice (``None`` without ``autotune_steps``)
        self.tuner = ReductionTuner(autotune_steps, clock=clock) if autotune_steps else None

    @property
    def reduction(self) -> str | None:
        return "flat" if self.state.flat else "hierarchical"

    def describe(self) -> str:
        if self.tuner is None:
            return ""
        return f" ({self.reduction} reduction, measured)" if self.tuner.choice else " (still measuring)"

    def register(self, ddp_model: DistributedDataParallel) -> None:
        ddp_model.register_comm_hook(self.state, hierarchical_hook)

    def step_traffic(self, grad_bytes: int, global_step: int) -> Traffic:
        if self.state.flat:  # the measured choice (or a measuring step) ran a flat all-reduce
            return flat_allreduce_traffic(grad_bytes, self.node_ids)
        return hierarchical_traffic(grad_bytes, self.node_ids)

    def after_step(self, params: list[torch.Tensor], global_step: int, end_of_epoch: bool) -> bool:
        if self.tuner is not None and self.tuner.measuring:
            self._tune(params)
        return False

    def _tune(self, params: list[torch.Tensor]) -> None:
        """One step of the measured flat-vs-hierarchical choice; the decision itself is a small collective."""
        assert self.tuner is not None
        device = params[0].device if params else torch.device("cpu")
        if device.type == "cuda":  # time the step's kernels, not their launch (only while measuring: 2k + 1 steps)
            torch.cuda.synchronize(device)
        if self.tuner.step_done():
            on = device if dist.get_backend() == "nccl" else torch.device("cpu")  # gloo: host tensors
            medians = torch.tensor(self.tuner.medians(), dtype=torch.float64, device=on)
            dist.all_reduce(medians, op=dist.ReduceOp.MAX)  # the same decision everywhere
            flat_s, hier_s = (float(v) for v in medians.tolist())
            choice = self.tuner.decide([flat_s, hier_s])
            if self.rank == 0:
                log.info(
                    "lightning-het comm='hierarchical': median step %.1f ms with a flat all-reduce, %.1f ms through"
                    " the node hierarchy; using the %s reduction from now on.",
                    flat_s * 1e3,
                    hier_s * 1e3,
                    choice,
                )
        self.state.flat = self.tuner.current == "flat"
