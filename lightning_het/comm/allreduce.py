"""``comm="allreduce"``: DDP's own flat all-reduce, and the small protocol every communication mode follows."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from lightning_het.comm.stats import CommStats, Traffic, flat_allreduce_traffic


class FlatAllReduce:
    """DDP's built-in all-reduce (mean over the replicas) of the pre-scaled gradients: exact, nothing registered."""

    mode = "allreduce"

    def __init__(self, node_ids: Sequence[int], rank: int, stats: CommStats) -> None:
        self.node_ids = list(node_ids)
        self.rank = rank
        self.stats = stats
        self._traffic: tuple[int, Traffic] | None = None  # (gradient bytes, the traffic of one step)

    @property
    def reduction(self) -> str | None:
        """How gradients are reduced now, where a mode chooses (``None``: fixed by the mode)."""
        return None

    def describe(self) -> str:
        """The schedule, for the summary line (empty: none)."""
        return ""

    def register(self, ddp_model: DistributedDataParallel) -> None:
        """Install the mode's gradient hook on ``ddp_model`` (nothing: DDP all-reduces already)."""

    def step_traffic(self, grad_bytes: int, global_step: int) -> Traffic:
        """The bytes of optimizer step ``global_step``'s gradient exchange (the same every step)."""
        cached = self._traffic
        if cached is None or cached[0] != grad_bytes:
            cached = self._traffic = (grad_bytes, flat_allreduce_traffic(grad_bytes, self.node_ids))
        return cached[1]

    def after_step(self, params: list[torch.Tensor], global_step: int, end_of_epoch: bool) -> bool:
        """Called after every optimizer step, on every rank; returns whether parameters were averaged."""
        return False

    def synchronize(self, params: list[torch.Tensor]) -> bool:
        """Bring every replica to one model now; returns whether an average ran (never: they always agree)."""
        return False

    def consensus(self, params: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """The model the replicas agree on, computed without changing training (``None``: ``params`` are it)."""
        return None

    def show_consensus(self, params: list[torch.Tensor]) -> None:
        """Put the consensus model into ``params`` until :meth:`hide_consensus` (nothing: the replicas agree)."""

    def hide_consensus(self, params: list[torch.Tensor]) -> None:
        """Give ``params`` this replica's own values back after :meth:`show_consensus`."""

    def set_step(self, completed_steps: int) -> None:
        """Optimizer steps already taken (a resumed fit keeps its schedule)."""

    def set_batch_sizes(self, batch_sizes: list[int]) -> None:
        """A new allocation (same list on every rank)."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the mode (tensors allowed; nothing here)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output."""

    def gather_node_states(self, optimizer_states: list[Any]) -> dict[str, Any] | None:
        """What a checkpoint keeps of each node's own state, on rank 0 (nothing here: the replicas agree)."""
        return None

    def node_optimizer_states(self, state: dict[str, Any]) -> list[Any] | None:
        """This rank's node's inner optimizer states in a checkpoint's :meth:`state_dict` (``None``: rank 0's)."""
        return None
