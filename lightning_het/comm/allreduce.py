"""The base of the ``comm=`` algorithms (hooks installed and removed, the step schedule, the byte model and counters)
and ``comm="allreduce"``: DDP's own flat all-reduce of the share-scaled gradients (exact)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import numpy as np
import torch

from lightning_het.cluster.topology import NodeGroups, describe_topology, node_members, validate_node_ids

log = logging.getLogger(__name__)

#: the largest chunk a hierarchical sum reduces at once (its stages overlap across chunks; 0: no chunks)
DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024
#: the strategy's old flat keyword -> the field of the algorithm object that replaces it
FLAT_FIELDS: dict[str, str] = {
    "global_sync_every": "sync_every",
    "comm_warmup_steps": "warmup_steps",
    "comm_autotune_steps": "autotune_steps",
    "outer_optimizer": "outer",
    "outer_lr": "outer_lr",
    "outer_momentum": "outer_momentum",
    "sync_dtype": "sync_dtype",
    "merge_weights": "merge",
}


def _ring(nbytes: float, ranks: Sequence[int], node_ids: Sequence[int], per_rank: float | None = None) -> np.ndarray:
    """The bytes each rank sends (row 0: inside its node, row 1: to other nodes) in a ring over ``ranks``
    (ascending), each sending ``per_rank`` bytes (default: an all-reduce's) to the next."""
    traffic, ring = np.zeros((2, len(node_ids))), sorted(ranks)
    if len(ring) > 1:
        per_rank = 2.0 * (len(ring) - 1) / len(ring) * nbytes if per_rank is None else per_rank
        for src, dst in zip(ring, ring[1:] + ring[:1]):
            traffic[int(node_ids[src] != node_ids[dst]), src] += per_rank
    return traffic


def flat_allreduce_traffic(nbytes: float, node_ids: Sequence[int]) -> np.ndarray:
    """One ring all-reduce over all ranks (DDP's).

    >>> flat_allreduce_traffic(100, [0, 0, 1, 1]).tolist()
    [[150.0, 0.0, 150.0, 0.0], [0.0, 150.0, 0.0, 150.0]]
    """
    return _ring(nbytes, range(len(node_ids)), node_ids)


def hierarchical_traffic(nbytes: float, node_ids: Sequence[int], per_rank: float | None = None) -> np.ndarray:
    """Reduce inside each node, a ring among node leaders (``per_rank`` bytes each: a compressed all-gather),
    broadcast inside each node.

    >>> hierarchical_traffic(100, [0, 0, 1, 1]).tolist(), hierarchical_traffic(400, [0, 0, 1], per_rank=100)[1].tolist()
    ([[100.0, 100.0, 100.0, 100.0], [100.0, 0.0, 100.0, 0.0]], [100.0, 0.0, 100.0])
    """
    members = node_members(node_ids)
    traffic = _ring(nbytes, [m[0] for m in members], node_ids, per_rank)
    for leader, *others in members:
        traffic[0, leader] += nbytes * len(others)
        traffic[0, others] += nbytes
    return traffic


def node_local_traffic(nbytes: float, node_ids: Sequence[int]) -> np.ndarray:
    """One all-reduce inside each node, nothing between nodes."""
    return sum(_ring(nbytes, members, node_ids) for members in node_members(node_ids))


class CommAlgorithm:
    """Base of the ``comm=`` objects: :meth:`install` registers the DDP comm hook and optimizer step post-hooks,
    :meth:`remove` the step hooks (the comm hook then runs DDP's all-reduce). Settings are dataclass fields."""

    mode: ClassVar[str] = ""
    _total: np.ndarray | None = None
    _handles: tuple[Any, ...] = ()
    _hook_state: Any = None

    def keywords(self) -> dict[str, Any]:
        """The strategy's flat settings this object stands for (``comm`` plus the fields, under their flat names)."""
        by_field = {new: old for old, new in FLAT_FIELDS.items()}
        return {"comm": self.mode} | {by_field[f.name]: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]

    def resolve(self, node_ids: Sequence[int]) -> CommAlgorithm:
        """The algorithm to run on the nodes ``node_ids``: ``self``, or a simpler one that does the same there."""
        return self

    def install(
        self,
        model: Any,
        optimizers: Iterable[torch.optim.Optimizer],
        node_ids: Sequence[int],
        rank: int,
        batch_sizes: Sequence[int] | None = None,
        *,
        position: Callable[[], tuple[int, bool]] | None = None,
        groups: NodeGroups | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        """Start a run on ``model`` (DDP) and ``optimizers`` as global ``rank`` of nodes ``node_ids`` (a collective
        where node ``groups`` are built); ``position()``: the steps done and whether this one ends an epoch."""
        self.remove()
        ids = validate_node_ids(node_ids, len(node_ids))
        if not 0 <= rank < len(ids):
            raise ValueError(f"Expected argument `rank` in [0, {len(ids)}), but got {rank}.")
        self._node_ids, self._rank, self._groups, self._chunk_bytes = ids, rank, groups, chunk_bytes
        self._total, self._steps, self._syncs, self._patterns = np.zeros((2, len(ids))), 0, 0, {}
        self._traffic, self._stepped = functools.cache(lambda pattern: pattern(self._grad_bytes, ids)), None
        self._position = position or (lambda: (self._stepped or 0, False))
        self._params = list(model.parameters())
        self._grad_bytes = sum(p.numel() * p.element_size() for p in self._params if p.requires_grad)
        self.set_batch_sizes([1] * len(ids) if batch_sizes is None else batch_sizes)
        self._start(model)
        for optimizer in optimizers:
            self.hook_optimizer(optimizer)
        if rank == 0 and len(ids) > 1:  # one replica communicates nothing
            log.info("lightning-het comm=%r%s over %s", self.mode, self._describe(), describe_topology(ids))

    def hook_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Run the algorithm after each step of ``optimizer`` (one more optimizer of the installed run)."""
        self._handles = (*self._handles, optimizer.register_step_post_hook(self._on_step))

    def remove(self) -> None:
        """Remove the step hooks and let the comm hook run DDP's all-reduce (the run's counters stay readable)."""
        for handle in self._handles:
            handle.remove()
        self._handles = ()
        if self._hook_state is not None:
            self._hook_state.groups = None
            self._hook_state.stop()

    def set_batch_sizes(self, batch_sizes: Sequence[int]) -> None:
        """Follow a new split of the global batch (the same list on every rank)."""
        sizes = list(batch_sizes)
        if len(sizes) != len(self._node_ids) or not all(type(b) is int and b > 0 for b in sizes):
            raise ValueError(
                f"Expected argument `batch_sizes` to hold one positive integer per replica ({len(self._node_ids)}),"
                f" but got {sizes}."
            )
        self._batch_sizes = sizes

    def _on_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        done, epoch_end = self._position()
        first = done + 1 if self._stepped is None else self._stepped + 1  # < done + 1: a gradient scaler skipped steps
        for step in range(first, done + 2):  # caught up, so that every rank runs the same collectives
            pattern = self._pattern(step)  # counted per pattern: the bytes are summed when read (numpy: ~20 us)
            self._steps, self._patterns[pattern] = self._steps + 1, self._patterns.get(pattern, 0) + 1
            self._after_step(step, epoch_end and step == done + 1)  # (an algorithm's own: under `torch.no_grad`)
        self._stepped = done + 1

    def _record_sync(self, traffic: np.ndarray) -> None:
        """Count one global parameter average."""
        self._syncs, self._total = self._syncs + 1, self._total + traffic

    # ------------------------------------------------------------------ what the algorithms override
    def _start(self, model: Any) -> None:
        """Register the comm hook on ``model`` (none here: DDP all-reduces)."""

    def _pattern(self, step: int) -> Callable[[float, Sequence[int]], np.ndarray]:
        """The traffic of optimizer step ``step``'s gradient exchange."""
        return flat_allreduce_traffic

    def _after_step(self, step: int, epoch_end: bool) -> None:
        """After optimizer step ``step`` (1-based), on every rank."""

    def _describe(self) -> str:
        return ""

    @property
    def reduction(self) -> str | None:
        """How gradients are reduced now where the algorithm chooses (``"flat"``, ``"hierarchical"``), else ``None``."""
        return None

    def sync(self) -> bool:
        """Bring every replica to one model now; whether an average ran (a collective where replicas differ)."""
        return False

    def show_consensus(self) -> None:
        """Put the replicas' consensus model into the module until :meth:`hide_consensus` (a collective)."""

    def hide_consensus(self) -> None:
        """Give the module this replica's own model back."""

    def consensus_state_dict(self, module: torch.nn.Module, state: dict[str, Any]) -> dict[str, Any]:
        """``module``'s ``state`` with the consensus model's parameters (a collective)."""
        return state

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore :meth:`state_dict`'s output after :meth:`install` (``None``: nothing saved)."""

    def gather_node_states(self, optimizer_states: list[Any]) -> dict[str, Any] | None:
        """Each node's own state for a checkpoint, on rank 0 (a collective where nodes differ)."""
        return None

    def node_optimizer_states(self, state: dict[str, Any] | None) -> list[Any] | None:
        """This rank's node's inner optimizer states in a checkpoint's comm state (``None``: rank 0's)."""
        return None

    # ------------------------------------------------------------------ reports
    @property
    def stats(self) -> dict[str, float]:
        """Bytes this rank and the job sent inside and between nodes, in total and per optimizer step."""
        if self._total is None:
            return {}
        out, steps = {"steps": float(self._steps), "global_syncs": float(self._syncs)}, max(self._steps, 1)
        total = self._total + sum(n * self._traffic(pattern) for pattern, n in self._patterns.items())
        for kind, sent in zip(("intra", "inter"), total.tolist()):
            mine, job = sent[self._rank], sum(sent)
            out |= {f"bytes_{kind}_total": mine, f"bytes_{kind}_per_step": mine / steps}
            out |= {f"job_bytes_{kind}_total": job, f"job_bytes_{kind}_per_step": job / steps}
        return out

    def summary(self) -> str:
        """One log line: mode, schedule and bytes per step."""
        s = self.stats
        return (
            f"comm={self.mode}{self._describe()}: {int(s['steps'])} steps, {int(s['global_syncs'])} global"
            f" syncs; per step this rank sent {s['bytes_intra_per_step'] / 1e6:.3f} MB inside its node and"
            f" {s['bytes_inter_per_step'] / 1e6:.3f} MB to other nodes"
            f" (whole job: {s['job_bytes_inter_per_step'] / 1e6:.3f} MB between nodes)"
        )

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if not k.startswith("_")}


@dataclass
class AllReduce(CommAlgorithm):
    """DDP's flat all-reduce of the share-weighted gradients, every step (exact)."""

    mode: ClassVar[str] = "allreduce"

    def _on_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._steps += 1  # the same exchange every step, no schedule: counted only
        self._patterns[flat_allreduce_traffic] = self._steps


def register_user_hook(model: Any, algorithm: CommAlgorithm, hook: Any, state: Any, wrapper: Any) -> None:
    """Register the user's ``ddp_comm_hook`` (with its state and wrapper) on any device, with :class:`AllReduce`."""
    if hook is None:
        return
    if not isinstance(algorithm, AllReduce):
        raise ValueError(
            f"You passed `ddp_comm_hook`, but `comm` resolves to {algorithm.mode!r}, which installs its own hook."
            " HINT: use comm='allreduce' with a custom hook."
        )
    model.register_comm_hook(state=state, hook=wrapper(hook) if wrapper is not None else hook)
