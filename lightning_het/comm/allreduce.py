"""The base of the ``comm=`` algorithms (hooks installed and removed, the step schedule, the byte counters) and
``comm="allreduce"``: DDP's own flat all-reduce of the share-scaled gradients (exact)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch

from lightning_het.cluster.topology import NodeGroups, describe_topology, validate_node_ids
from lightning_het.comm.stats import CommStats, Traffic, flat_allreduce_traffic

log = logging.getLogger(__name__)

#: the optimizer steps completed before the one in progress, and whether that one ends an epoch
Position = Callable[[], tuple[int, bool]]
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


class CommAlgorithm:
    """Base of the ``comm=`` objects: :meth:`install` registers the DDP comm hook and optimizer step post-hooks and
    starts a run's state; :meth:`remove` removes the step hooks (DDP cannot unregister a comm hook: ours then runs
    DDP's all-reduce). Settings are dataclass fields; the run's state is private and not pickled."""

    mode: ClassVar[str] = ""
    _stats: CommStats | None = None
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
        position: Position | None = None,
        groups: NodeGroups | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        """Start a run on ``model`` (DDP) and ``optimizers`` as global ``rank`` of nodes ``node_ids``, trained with
        ``batch_sizes`` (``None``: equal). ``position``: default, steps counted here and no epoch ends. A collective
        where node ``groups`` are built."""
        self.remove()
        ids = validate_node_ids(node_ids, len(node_ids))
        if not 0 <= rank < len(ids):
            raise ValueError(f"Expected argument `rank` in [0, {len(ids)}), but got {rank}.")
        self._node_ids, self._rank, self._groups, self._chunk_bytes = ids, rank, groups, chunk_bytes
        self._stats, self._traffic_cache, self._stepped = CommStats(rank, len(ids)), {}, None
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

    def set_batch_sizes(self, batch_sizes: Sequence[int]) -> None:
        """Follow a new split of the global batch (the same list on every rank)."""
        sizes = list(batch_sizes)
        if len(sizes) != len(self._node_ids) or any(
            isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in sizes
        ):
            raise ValueError(
                f"Expected argument `batch_sizes` to hold one positive integer per replica ({len(self._node_ids)}),"
                f" but got {sizes}."
            )
        self._batch_sizes = sizes

    def _on_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        done, epoch_end = self._position()
        first = done + 1 if self._stepped is None else self._stepped + 1  # < done + 1: a gradient scaler skipped steps
        for step in range(first, done + 2):  # caught up, so that every rank runs the same collectives
            pattern = self._pattern(step)
            if pattern not in self._traffic_cache:
                self._traffic_cache[pattern] = pattern(self._grad_bytes, self._node_ids)
            self._stats.record(self._traffic_cache[pattern])  # type: ignore[union-attr]
            with torch.no_grad():
                self._after_step(step, epoch_end and step == done + 1)
        self._stepped = done + 1

    # ------------------------------------------------------------------ what the algorithms override
    def _start(self, model: Any) -> None:
        """Register the comm hook on ``model`` (none here: DDP all-reduces)."""

    def _pattern(self, step: int) -> Callable[[float, Sequence[int]], Traffic]:
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
        """Bytes this rank and the job sent inside nodes and between nodes, in total and per optimizer step."""
        return {} if self._stats is None else self._stats.as_dict()

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


def register_user_hook(model: Any, algorithm: CommAlgorithm, hook: Any, state: Any, wrapper: Any) -> None:
    """Register the user's ``ddp_comm_hook`` (with ``ddp_comm_state``, ``ddp_comm_wrapper``) on any device; a
    ``ValueError`` unless ``algorithm`` is :class:`AllReduce` (the others install their own)."""
    if hook is None:
        return
    if not isinstance(algorithm, AllReduce):
        raise ValueError(
            f"You passed `ddp_comm_hook`, but `comm` resolves to {algorithm.mode!r}, which installs its own hook."
            " HINT: use comm='allreduce' with a custom hook."
        )
    model.register_comm_hook(state=state, hook=wrapper(hook) if wrapper is not None else hook)
