"""DDP communication hooks for two-level (intra-node / between-node) topologies.

No ``from __future__ import annotations`` here: DDP inspects a hook's signature and rejects string annotations (the
bucket parameter must be named ``bucket``).
"""

import logging
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from lightning_het.cluster.topology import NodeGroups

log = logging.getLogger(__name__)


class _InOrder:
    """Runs submitted actions strictly in sequence-number order (0, 1, 2, ...), whichever thread submits them.

    Gloo runs completion callbacks in completion order, which may differ between ranks, yet collectives on a group
    must be issued in the same order on every rank: the pipelined stages are funnelled through one of these per group.
    """

    __slots__ = ("_draining", "_lock", "_next", "_pending")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 0
        self._pending: dict[int, tuple[Callable[[], None], Callable[[BaseException], None]]] = {}
        self._draining = False

    def submit(self, seq: int, action: Callable[[], None], on_error: Callable[[BaseException], None]) -> None:
        """Run ``action`` once every action with a smaller ``seq`` has run; report its exception to ``on_error``."""
        with self._lock:
            self._pending[seq] = (action, on_error)
            if self._draining:
                return
            self._draining = True
        while True:
            with self._lock:
                item = self._pending.pop(self._next, None)
                if item is None:
                    self._draining = False
                    return
                self._next += 1
            run, report = item
            try:
                run()
            except BaseException as err:  # must reach the bucket's future, or DDP waits forever
                report(err)


def _nothing(*args: object) -> None:
    """The action (and error handler) of a turn handed on by a failed chunk."""


def _new_future(tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """An unset future that DDP can wait on for ``tensor`` (device-aware on accelerators)."""
    return torch.futures.Future() if tensor.device.type == "cpu" else torch.futures.Future(devices=[tensor.device])


def _done_future(tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    fut = _new_future(tensor)
    fut.set_result(tensor)
    return fut


def _first_tensor(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
    return fut.value()[0]


DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024


class HierarchicalState:
    """State of :func:`hierarchical_hook` and :func:`hierarchical_sum`.

    ``chunk_bytes``: largest chunk reduced at once, so that the three stages of successive chunks overlap (1-8 MiB
    suits TCP and NCCL; ``0``: no chunking). ``flat``: run one flat all-reduce instead (the measured choice).
    """

    __slots__ = ("_seq", "bcast_order", "chunk_bytes", "flat", "groups", "leader_order", "world_size")

    def __init__(self, groups: NodeGroups, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        self.groups = groups
        self.chunk_bytes = chunk_bytes
        self.world_size = groups.world_size
        self.flat = False
        self._seq = 0
        self.leader_order = _InOrder()  # chunks' all-reduces between node leaders, in issue order
        self.bcast_order = _InOrder()  # chunks' broadcasts inside the node, in issue order

    def next_seq(self) -> int:
        """The issue number of the next chunk (0, 1, 2, ...; every rank numbers its chunks in the same order)."""
        seq, self._seq = self._seq, self._seq + 1
        return seq


def hierarchical_sum(state: HierarchicalState, tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """Sum a contiguous ``tensor`` over all ranks, in place, through the node hierarchy; return a future of it."""
    flat = tensor.view(-1)
    chunk = state.chunk_bytes // max(flat.element_size(), 1)
    if state.chunk_bytes <= 0 or flat.numel() <= chunk:
        return _hierarchical_sum_chunk(state, tensor)
    parts = [_hierarchical_sum_chunk(state, part) for part in flat.split(chunk)]
    return _when_all(parts, tensor)


def _when_all(
    parts: list[torch.futures.Future[torch.Tensor]], tensor: torch.Tensor
) -> torch.futures.Future[torch.Tensor]:
    """A future of ``tensor`` that completes when every part has (or fails with the first failure)."""
    result = _new_future(tensor)
    lock = threading.Lock()
    remaining = [len(parts)]

    def part_done(fut: torch.futures.Future[torch.Tensor]) -> None:
        try:
            fut.value()
        except BaseException as err:
            with lock:
                if not result.done():
                    result.set_exception(err)
            return
        with lock:
            remaining[0] -= 1
            if remaining[0] == 0 and not result.done():
                result.set_result(tensor)

    for part in parts:
        part.then(part_done)
    return result


def _hierarchical_sum_chunk(state: HierarchicalState, tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """Stages 1-3 of :func:`hierarchical_sum` on one contiguous chunk."""
    groups = state.groups
    seq = state.next_seq()
    result = _new_future(tensor)
    # the ordered stages this chunk still holds a turn in; a chunk that fails before them hands its turn on, or every
    # later chunk would wait for it until the watchdog ends the job
    turns = {"leaders": groups.is_leader and groups.num_nodes > 1, "bcast": groups.node_size > 1}

    def release() -> None:
        if turns.pop("leaders", False):
            state.leader_order.submit(seq, _nothing, _nothing)
        if turns.pop("bcast", False):
            state.bcast_order.submit(seq, _nothing, _nothing)

    def fail(err: BaseException) -> None:
        if not result.done():
            result.set_exception(err)
        release()

    def chain(work: dist.Work, then: Callable[[], None]) -> None:
        def callback(fut: torch.futures.Future[list[torch.Tensor]]) -> None:
            try:
                fut.value()
                then()
            except BaseException as err:
                fail(err)

        work.get_future().then(callback)

    def finish() -> None:
        result.set_result(tensor)

    def broadcast() -> None:
        chain(dist.broadcast(tensor, src=groups.leader, group=groups.intra_bcast_group, async_op=True), finish)

    def after_leaders() -> None:
        if turns.pop("bcast", False):
            state.bcast_order.submit(seq, broadcast, fail)
        else:
            finish()

    def leaders_allreduce() -> None:
        chain(dist.all_reduce(tensor, group=groups.leader_group, async_op=True), after_leaders)

    def after_reduce() -> None:
        if turns.pop("leaders", False):
            state.leader_order.submit(seq, leaders_allreduce, fail)
        else:
            after_leaders()

    try:
        if groups.node_size > 1:
            chain(dist.reduce(tensor, dst=groups.leader, group=groups.intra_group, async_op=True), after_reduce)
        else:
            after_reduce()
    except BaseException as err:
        fail(err)
    return result


def hierarchical_hook(state: HierarchicalState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Exact gradient mean ``(1/W) * sum_r g_r``, reduced inside nodes, all-reduced between leaders, broadcast back.

    Use: ``ddp_model.register_comm_hook(HierarchicalState(build_node_groups(node_ids, rank)), hierarchical_hook)``.
    """
    tensor = bucket.buffer()
    tensor.div_(state.world_size)
    if state.flat:
        return dist.all_reduce(tensor, async_op=True).get_future().then(_first_tensor)
    return hierarchical_sum(state, tensor)


class NodeLocalState:
    """State of :func:`node_local_hook`: ``hierarchical`` runs the exact warm-up steps (its groups define the nodes);
    ``node_scale`` = ``B / (W * B_n)`` is applied to this rank's pre-scaled gradient before the node's sum."""

    __slots__ = ("completed_steps", "hierarchical", "node_scale", "warmup_steps")

    def __init__(self, hierarchical: HierarchicalState, batch_sizes: list[int], warmup_steps: int = 0) -> None:
        self.hierarchical = hierarchical
        self.warmup_steps = warmup_steps
        self.completed_steps = 0
        self.node_scale = 1.0
        self.set_batch_sizes(batch_sizes)

    def set_batch_sizes(self, batch_sizes: list[int]) -> None:
        """Recompute ``node_scale`` for a new allocation."""
        groups = self.hierarchical.groups
        node_total = sum(batch_sizes[r] for r in groups.node_ranks)
        self.node_scale = sum(batch_sizes) / (len(batch_sizes) * node_total)

    @property
    def exact(self) -> bool:
        """Whether the step in progress is a warm-up step (exact global reduction)."""
        return self.completed_steps < self.warmup_steps


def node_local_hook(state: NodeLocalState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Gradient of this node's mean loss: ``B / (W * B_n) * sum_{r in n} g_r``, summed inside the node only."""
    tensor = bucket.buffer()
    if state.exact:
        tensor.div_(state.hierarchical.world_size)
        return hierarchical_sum(state.hierarchical, tensor)
    tensor.mul_(state.node_scale)
    groups = state.hierarchical.groups
    if groups.node_size == 1:
        return _done_future(tensor)
    work = dist.all_reduce(tensor, group=groups.intra_group, async_op=True)
    return work.get_future().then(_first_tensor)
