"""``comm="hierarchical"`` and ``"auto"``, with the DDP comm hooks of the node-aware algorithms (no ``from __future__
import annotations``: DDP rejects a hook's string annotations)."""

import logging
import queue
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from lightning_het.arguments import positive_int
from lightning_het.cluster.topology import NodeGroups, build_node_groups, describe_topology
from lightning_het.comm.allreduce import (
    DEFAULT_CHUNK_BYTES,
    AllReduce,
    CommAlgorithm,
    flat_allreduce_traffic,
    hierarchical_traffic,
)

log = logging.getLogger(__name__)


def _future(tensor: torch.Tensor, done: bool = False) -> torch.futures.Future[torch.Tensor]:
    """A future DDP can wait on for ``tensor`` (device-aware on accelerators), already set when ``done``."""
    fut = torch.futures.Future() if tensor.device.type == "cpu" else torch.futures.Future(devices=[tensor.device])
    if done:
        fut.set_result(tensor)
    return fut


class HierarchicalState:
    """State of the comm hooks: the node ``groups`` (``None`` once removed), ``chunk_bytes`` (the largest chunk reduced
    at once), ``flat`` (run a flat all-reduce: the measured choice); for :func:`node_local_hook`, ``node_scale = B /
    (W * B_n)`` and ``exact()`` (whether the step in progress is a warm-up step, reduced exactly)."""

    __slots__ = ("chunk_bytes", "exact", "flat", "groups", "jobs", "node_scale")

    def __init__(
        self, groups: NodeGroups, chunk_bytes: int = DEFAULT_CHUNK_BYTES, exact: Callable[[], bool] = lambda: True
    ) -> None:
        self.groups: NodeGroups | None = groups
        self.chunk_bytes, self.exact, self.node_scale, self.flat = chunk_bytes, exact, 1.0, False
        self.jobs: queue.SimpleQueue[Any] | None = None  # the sums waiting for the thread that issues them

    def stop(self) -> None:
        """End the thread that issues the sums (a later sum starts another)."""
        if self.jobs is not None:
            self.jobs.put(None)
            self.jobs = None


def hierarchical_sum(state: HierarchicalState, tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """Sum a contiguous ``tensor`` over all ranks in place; a future of it. One thread per state issues the sums in
    order (every rank must issue a group's collectives in the same order), overlapping backward."""
    if state.jobs is None:
        state.jobs = queue.SimpleQueue()
        threading.Thread(target=_issue_sums, args=(state, state.jobs), daemon=True, name="lightning-het-sum").start()
    result = _future(tensor)
    state.jobs.put((tensor, result))
    return result


def _issue_sums(state: HierarchicalState, jobs: queue.SimpleQueue[Any]) -> None:
    while (job := jobs.get()) is not None:
        try:
            job[1].set_result(_sum_in_chunks(state, job[0]))
        except BaseException as err:  # must reach the bucket's future, or DDP waits forever
            job[1].set_exception(err)


def _sum_in_chunks(state: HierarchicalState, tensor: torch.Tensor) -> torch.Tensor:
    """Reduce onto the node leader, all-reduce between leaders, broadcast inside the node; each chunk's next stage
    issued once its last one is done, so that the stages of successive chunks overlap."""
    groups, flat = state.groups, tensor.view(-1)
    assert groups is not None
    chunks = flat.split(max(state.chunk_bytes // flat.element_size(), 1)) if state.chunk_bytes > 0 else [flat]
    several, leads, leader = groups.node_size > 1, groups.is_leader and groups.num_nodes > 1, groups.leader
    stages = (
        lambda c: dist.all_reduce(c, group=groups.leader_group, async_op=True) if leads else None,
        lambda c: dist.broadcast(c, leader, group=groups.intra_bcast_group, async_op=True) if several else None,
        lambda c: None,
    )
    works = [dist.reduce(c, leader, group=groups.intra_group, async_op=True) if several else None for c in chunks]
    for stage in stages:
        for i, (work, chunk) in enumerate(zip(works, chunks)):
            if work is not None:
                work.wait()
            works[i] = stage(chunk)
    return tensor


def hierarchical_hook(state: HierarchicalState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Exact gradient mean ``(1/W) * sum_r g_r`` through the node hierarchy (flat: DDP's all-reduce)."""
    if state.flat or state.groups is None:
        return allreduce_hook(None, bucket)  # type: ignore[arg-type]
    return hierarchical_sum(state, bucket.buffer().div_(state.groups.world_size))


def node_local_hook(state: HierarchicalState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Gradient of this node's mean loss, ``B / (W * B_n) * sum_{r in n} g_r``, summed inside the node only."""
    groups = state.groups
    if groups is None or state.exact():
        return hierarchical_hook(state, bucket)
    tensor = bucket.buffer().mul_(state.node_scale)
    if groups.node_size == 1:
        return _future(tensor, done=True)
    work = dist.all_reduce(tensor, group=groups.intra_group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


@dataclass
class Hierarchical(CommAlgorithm):
    """Exact two-level reduction: inside each node, then between the nodes' leaders, then back (a flat all-reduce
    when no node holds several replicas). ``autotune_steps``: the first ``2 * n + 1`` steps alternate the hierarchy
    with a flat all-reduce and keep the faster; 0: always the hierarchy."""

    mode: ClassVar[str] = "hierarchical"
    autotune_steps: int = 5
    _clock = staticmethod(time.perf_counter)

    def __post_init__(self) -> None:
        positive_int("autotune_steps", self.autotune_steps, allow_none=False, minimum=0)

    def resolve(self, node_ids: Sequence[int]) -> CommAlgorithm:
        if 1 < len(set(node_ids)) < len(node_ids):  # several nodes, one of them with several replicas
            return self
        reason = "a single node" if len(set(node_ids)) < 2 else "one replica per node"
        topology = describe_topology(node_ids)
        log.info("comm='hierarchical' with %s (%s) is a flat all-reduce: using comm='allreduce'.", reason, topology)
        return AllReduce()

    def _start(self, model: Any) -> None:
        self._groups = self._groups or build_node_groups(self._node_ids, self._rank)
        self._hook_state = HierarchicalState(self._groups, self._chunk_bytes)
        self._times: dict[str, list[float]] = {"flat": [], "hierarchical": []}  # step times under each, measured
        self._last, self._measured = None, not self.autotune_steps
        model.register_comm_hook(self._hook_state, hierarchical_hook)

    @property
    def reduction(self) -> str | None:
        return None if self._hook_state is None else ("flat" if self._hook_state.flat else "hierarchical")

    def _describe(self) -> str:
        measured = f" ({self.reduction} reduction, measured)" if self._measured else " (still measuring)"
        return measured if self.autotune_steps else ""

    def _pattern(self, step: int) -> Callable[[float, Sequence[int]], np.ndarray]:
        return flat_allreduce_traffic if self._hook_state.flat else hierarchical_traffic

    @torch.no_grad()
    def _after_step(self, step: int, epoch_end: bool) -> None:
        """While measuring: time the step that ended, pick the next step's reduction, or decide (all ranks agree)."""
        if self._measured:
            return
        device = self._params[0].device if self._params else torch.device("cpu")
        if device.type == "cuda":  # time the step's kernels, not their launch (only while measuring)
            torch.cuda.synchronize(device)
        now, times = self._clock(), self._times
        if self._last is not None:  # the first step is not timed
            times[self.reduction].append(now - self._last)  # type: ignore[index]
        self._last = now
        if min(len(t) for t in times.values()) < self.autotune_steps:
            self._hook_state.flat = len(times["flat"]) <= len(times["hierarchical"])
            return
        on = device if dist.get_backend() == "nccl" else torch.device("cpu")  # gloo: host tensors
        medians = torch.tensor([statistics.median(t) for t in times.values()], dtype=torch.float64, device=on)
        dist.all_reduce(medians, op=dist.ReduceOp.MAX)  # the slowest rank of each: the same decision everywhere
        flat_s, hier_s = medians.tolist()
        self._hook_state.flat, self._measured = flat_s < hier_s * 0.98, True  # the hierarchy unless 2 % slower
        if self._rank == 0:
            log.info(
                f"lightning-het comm='hierarchical': median step {flat_s * 1e3:.1f} ms with a flat all-reduce,"
                f" {hier_s * 1e3:.1f} ms through the node hierarchy; using the {self.reduction} reduction from now on."
            )


@dataclass
class Auto(Hierarchical):
    """``comm="auto"``: :class:`Hierarchical` when the job spans several nodes of several replicas, else
    :class:`AllReduce`."""

    mode: ClassVar[str] = "auto"

    def resolve(self, node_ids: Sequence[int]) -> CommAlgorithm:
        return Hierarchical(self.autotune_steps) if 1 < len(set(node_ids)) < len(node_ids) else AllReduce()
