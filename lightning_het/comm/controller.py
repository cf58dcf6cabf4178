"""The communication layer as one object the strategy drives (modes and their trade-offs: docs/communication.md)."""

from __future__ import annotations

import copy
import logging
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any, get_args

import torch
from torch.nn.parallel import DistributedDataParallel

from lightning_het.arguments import CommMode, check_comm_args
from lightning_het.cluster.topology import (
    NodeGroups,
    build_node_groups,
    describe_topology,
    node_members,
    validate_node_ids,
)
from lightning_het.comm.allreduce import FlatAllReduce
from lightning_het.comm.hierarchical import Hierarchical
from lightning_het.comm.hooks import DEFAULT_CHUNK_BYTES
from lightning_het.comm.node_local import NodeLocal
from lightning_het.comm.outer import OuterFactory, build_merge
from lightning_het.comm.stats import CommStats

log = logging.getLogger(__name__)


def validate_comm_args(comm: str, global_sync_every: int | None = None, warmup_steps: int = 0) -> None:
    """Constructor-time checks of the communication arguments (``ValueError``); a ``UserWarning`` when
    ``global_sync_every`` or ``warmup_steps`` is given without ``comm="node_local"`` (ignored)."""
    check_comm_args(comm, global_sync_every, warmup_steps)
    for name, value in (("global_sync_every", global_sync_every), ("warmup_steps", warmup_steps)):
        if value and comm != "node_local":
            message = f"`{name}={value}` only applies to `comm='node_local'`; it is ignored with `comm={comm!r}`."
            warnings.warn(message, UserWarning, stacklevel=2)


def register_user_hook(model: DistributedDataParallel, mode: CommMode, hook: Any, state: Any, wrapper: Any) -> None:
    """Register the user's ``ddp_comm_hook`` (with its ``ddp_comm_state`` and ``ddp_comm_wrapper``) on ``model`` on any
    device (Lightning does only on CUDA); ``ValueError`` unless the mode is ``"allreduce"``, which installs none."""
    if hook is None:
        return
    if mode != "allreduce":
        raise ValueError(
            f"You passed `ddp_comm_hook`, but `comm` resolves to {mode!r}, which installs its own hook."
            " HINT: use comm='allreduce' with a custom hook."
        )
    model.register_comm_hook(state=state, hook=wrapper(hook) if wrapper is not None else hook)


def resolve_comm_mode(comm: str, node_ids: Sequence[int]) -> CommMode:
    """The mode to run for ``comm`` and the node of every global rank (pure; same answer on every rank).

    ``"hierarchical"`` without a node holding several replicas falls back to ``"allreduce"``; ``"node_local"`` on
    one node raises ``ValueError``.

    >>> resolve_comm_mode("auto", [0, 0, 1, 1])
    'hierarchical'
    >>> resolve_comm_mode("auto", [0, 0])
    'allreduce'
    """
    validate_comm_args(comm)
    ids = validate_node_ids(node_ids, len(node_ids))
    members = node_members(ids)
    multi_node = len(members) > 1
    worth_it = multi_node and any(len(m) > 1 for m in members)
    if comm == "auto":
        return "hierarchical" if worth_it else "allreduce"
    if comm == "hierarchical" and not worth_it:
        reason = "a single node" if not multi_node else "one replica per node"
        log.info(
            "comm='hierarchical' with %s (%s) is a flat all-reduce: using comm='allreduce'.",
            reason,
            describe_topology(ids),
        )
        return "allreduce"
    if comm == "node_local" and not multi_node:
        raise ValueError(
            f"You set `comm='node_local'`, but all {len(ids)} replicas are on one node (node_ids={list(node_ids)}),"
            " so node-local steps would be exact training. HINT: pass `node_ids` to declare the nodes (e.g."
            " [0, 0, 1, 1]), launch with one NODE_RANK per node, or use comm='allreduce'."
        )
    return comm  # type: ignore[return-value]


def _check_batch_sizes(batch_sizes: Sequence[int], world_size: int) -> list[int]:
    sizes = list(batch_sizes)
    if len(sizes) != world_size or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in sizes):
        raise ValueError(
            f"Expected argument `batch_sizes` to hold one positive integer per replica ({world_size}), but got {sizes}."
        )
    return sizes


class CommController:
    """Runs one communication mode for one rank: registers the DDP hook, averages parameters, counts bytes.

    Build it on every rank after ``init_process_group`` (the constructor creates process groups, a collective); call
    :meth:`after_optimizer_step` and :meth:`synchronize` on every rank too. Not picklable. ``mode`` is resolved
    (:func:`resolve_comm_mode`); ``batch_sizes`` ``None`` means equal until :meth:`set_batch_sizes`; ``groups`` are
    built when ``None``; the other keywords are the strategy's (``docs/communication.md``).
    """

    def __init__(
        self,
        mode: CommMode,
        node_ids: Sequence[int],
        batch_sizes: Sequence[int] | None,
        rank: int,
        *,
        global_sync_every: int | None = None,
        warmup_steps: int = 0,
        groups: NodeGroups | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        autotune_steps: int = 0,
        autotune_clock: Callable[[], float] = time.perf_counter,
        outer_optimizer: str | OuterFactory | None = None,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        sync_dtype: str = "float32",
        merge_weights: str = "samples",
    ) -> None:
        if mode not in get_args(CommMode):
            raise ValueError(f"Expected argument `mode` to be one of {list(get_args(CommMode))}, but got {mode!r}.")
        validate_comm_args(mode, global_sync_every if mode == "node_local" else None, warmup_steps)
        self._node_ids = validate_node_ids(node_ids, len(node_ids))
        if not 0 <= rank < len(self._node_ids):
            raise ValueError(f"Expected argument `rank` in [0, {len(self._node_ids)}), but got {rank}.")
        if mode == "node_local" and len(node_members(self._node_ids)) < 2:
            resolve_comm_mode(mode, self._node_ids)  # raises the documented error
        if isinstance(autotune_steps, bool) or not isinstance(autotune_steps, int) or autotune_steps < 0:
            raise ValueError(f"Expected argument `autotune_steps` to be an integer >= 0, but got {autotune_steps!r}.")
        world_size = len(self._node_ids)
        self._batch_sizes = [1] * world_size if batch_sizes is None else _check_batch_sizes(batch_sizes, world_size)
        self._stats = CommStats(rank=rank, world_size=world_size)
        self._groups = groups
        if self._groups is None and mode != "allreduce":
            self._groups = build_node_groups(self._node_ids, rank)
        args = (self._node_ids, rank, self._stats)
        common = {"groups": self._groups, "chunk_bytes": chunk_bytes}
        self._algorithm: FlatAllReduce
        if mode == "allreduce":
            self._algorithm = FlatAllReduce(*args)
        elif mode == "hierarchical":
            self._algorithm = Hierarchical(*args, autotune_steps=autotune_steps, clock=autotune_clock, **common)
        else:
            self._algorithm = NodeLocal(
                *args,
                batch_sizes=self._batch_sizes,
                global_sync_every=global_sync_every,
                warmup_steps=warmup_steps,
                merge=build_merge(outer_optimizer, outer_lr, outer_momentum, sync_dtype),
                merge_by=merge_weights,
                **common,
            )
        self._grad_bytes: int | None = None
        if rank == 0 and len(self._node_ids) > 1:  # one replica communicates nothing
            log.info("lightning-het comm=%r%s over %s", mode, self._algorithm.describe(), describe_topology(node_ids))

    @property
    def algorithm(self) -> FlatAllReduce:
        """The running mode's object (:class:`~lightning_het.comm.allreduce.FlatAllReduce` or a subclass)."""
        return self._algorithm

    @property
    def mode(self) -> CommMode:
        return self._algorithm.mode  # type: ignore[return-value]

    @property
    def groups(self) -> NodeGroups | None:
        """Node process groups (``None`` for ``"allreduce"``)."""
        return self._groups

    @property
    def reduction(self) -> str | None:
        """How ``"hierarchical"`` reduces gradients now: ``"flat"`` or ``"hierarchical"`` (``None`` in other modes)."""
        return self._algorithm.reduction

    @property
    def stats(self) -> dict[str, float]:
        """Bytes sent so far and per optimizer step, inside nodes and between nodes (see :class:`CommStats`)."""
        return self._stats.as_dict()

    def register(self, ddp_model: DistributedDataParallel) -> None:
        """Register the mode's comm hook on ``ddp_model`` (none for ``"allreduce"``) and record the gradient bytes."""
        self._grad_bytes = _grad_bytes(ddp_model.parameters())
        self._algorithm.register(ddp_model)

    def set_step(self, completed_steps: int) -> None:
        """Set the number of optimizer steps already taken (call at fit start with ``trainer.global_step``)."""
        self._algorithm.set_step(completed_steps)

    def set_batch_sizes(self, batch_sizes: Sequence[int]) -> None:
        """Use a new allocation (e.g. after rebalancing at an epoch boundary); same list on every rank."""
        self._batch_sizes = _check_batch_sizes(batch_sizes, len(self._node_ids))
        self._algorithm.set_batch_sizes(self._batch_sizes)

    def after_optimizer_step(
        self, params: Iterable[torch.Tensor], global_step: int, *, end_of_epoch: bool = False
    ) -> bool:
        """Account for step ``global_step`` (``trainer.global_step + 1``); for ``node_local`` average ``params``
        when due or at ``end_of_epoch``. Collective; returns whether a global parameter average ran."""
        params = list(params)
        if self._grad_bytes is None:
            self._grad_bytes = _grad_bytes(params)
        self._stats.record_step(self._algorithm.step_traffic(self._grad_bytes, global_step))
        return self._algorithm.after_step(params, global_step, end_of_epoch)

    def synchronize(self, params: Iterable[torch.Tensor]) -> bool:
        """Bring all replicas to one consensus model now (``node_local``); whether an average ran. Collective."""
        return self._algorithm.synchronize(list(params))

    def consensus(self, params: Iterable[torch.Tensor]) -> list[torch.Tensor] | None:
        """``node_local``: the share-weighted average of the replicas' ``params`` as new tensors, without a sync (no
        outer step; training goes on as if nothing had looked); ``None`` when the replicas agree (``params`` are the
        consensus) or it is shown already. A collective unless ``None``: call it on every rank."""
        return self._algorithm.consensus(list(params))

    def consensus_state_dict(self, module: torch.nn.Module, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` (``module``'s state dict) with the :meth:`consensus` of ``module``'s parameters in place of this
        replica's (a new dict; ``state`` itself when the replicas agree). A collective: call it on every rank."""
        params = list(module.parameters())
        consensus = self.consensus(params)
        if consensus is None:
            return state
        by_id = {id(p): c for p, c in zip(params, consensus)}
        names = {name: by_id[id(p)] for name, p in module.named_parameters(remove_duplicate=False) if id(p) in by_id}
        out = copy.copy(state)  # keeps a state dict's `_metadata`
        out.update((key, names[key]) for key in state if key in names)
        return out

    def show_consensus(self, params: Iterable[torch.Tensor]) -> None:
        """``node_local``: put the :meth:`consensus` into ``params`` (e.g. for validation) until
        :meth:`hide_consensus`, which gives every replica its own model back. A collective (call on every rank)."""
        self._algorithm.show_consensus(list(params))

    def hide_consensus(self, params: Iterable[torch.Tensor]) -> None:
        """Give ``params`` this replica's own values back after :meth:`show_consensus` (no collective)."""
        self._algorithm.hide_consensus(list(params))

    def state_dict(self) -> dict[str, Any]:
        """The mode's state for a checkpoint (``node_local``: the samples since the last sync, whether the replicas
        agree, the anchor and the outer optimizer's state), the same on every rank."""
        return self._algorithm.state_dict()

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore :meth:`state_dict`'s output (``None``: nothing saved)."""
        if state:
            self._algorithm.load_state_dict(state)

    def gather_node_states(self, optimizer_states: list[Any]) -> dict[str, Any] | None:
        """``node_local``: every node's parameters, inner ``optimizer_states`` (this rank's, as a checkpoint holds
        them) and its leader's compression residual, gathered to rank 0 for a checkpoint's comm state (``"nodes"``). A
        collective in ``node_local``: call it on every rank; ``None`` off rank 0 and in the other modes."""
        return self._algorithm.gather_node_states(optimizer_states)

    def node_optimizer_states(self, state: dict[str, Any] | None) -> list[Any] | None:
        """``node_local``: this rank's node's inner optimizer states in a checkpoint's comm state, when its node layout
        is this run's; ``None`` (keep the checkpoint's, rank 0's) otherwise."""
        return self._algorithm.node_optimizer_states(state) if state else None

    def close(self) -> None:
        """Drop references to the process groups (they are destroyed with the default group)."""
        self._groups = None
        self._algorithm = FlatAllReduce(self._node_ids, self._algorithm.rank, self._stats)

    def summary(self) -> str:
        """One log line: mode, schedule and bytes per step, e.g. for ``on_train_end``."""
        s = self.stats
        return (
            f"comm={self.mode}{self._algorithm.describe()}: {int(s['steps'])} steps, {int(s['global_syncs'])} global"
            f" syncs; per step this rank sent {s['bytes_intra_per_step'] / 1e6:.3f} MB inside its node and"
            f" {s['bytes_inter_per_step'] / 1e6:.3f} MB to other nodes"
            f" (whole job: {s['job_bytes_inter_per_step'] / 1e6:.3f} MB between nodes)"
        )


def _grad_bytes(params: Iterable[torch.Tensor]) -> int:
    return sum(p.numel() * p.element_size() for p in params if p.requires_grad)
