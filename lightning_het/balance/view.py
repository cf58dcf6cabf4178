"""``BalanceView``: the public, read-only balancing state that both heterogeneous strategies show their users."""

from __future__ import annotations

from typing import Any

from lightning_het.balance.balancer import Balancer
from lightning_het.balance.cost import AffineCost
from lightning_het.comm.allreduce import CommAlgorithm
from lightning_het.config import HeterogeneousConfig
from lightning_het.data.microbatch import MicroBatcher


def _copy(values: list[Any] | None) -> list[Any] | None:
    return None if values is None else list(values)


class BalanceView:
    """The public, read-only balancing state of a heterogeneous strategy (``None`` before the allocation is known)."""

    balancer: Balancer

    @property
    def config(self) -> HeterogeneousConfig:
        """The validated keywords of this strategy (frozen)."""
        return self.balancer.config

    @property
    def batch_sizes(self) -> list[int] | None:
        """Samples per step of every replica, indexed by global rank."""
        return _copy(self.balancer.allocation.batch_sizes)

    @property
    def local_batch_size(self) -> int | None:
        """Samples per step on this replica."""
        sizes = self.balancer.allocation.batch_sizes
        return None if sizes is None else sizes[self.balancer.rank]

    @property
    def global_batch_size(self) -> int | None:
        return self.balancer.allocation.global_batch_size

    @property
    def speeds(self) -> list[float] | None:
        """Relative throughput (samples/s when profiled) of every replica, indexed by global rank."""
        return _copy(self.balancer.allocation.speeds)

    @property
    def speeds_given(self) -> bool:
        """Whether the user gave ``speeds`` (``False``: they are, or will be, profiled)."""
        return self.balancer.config.speeds is not None

    @property
    def node_ids(self) -> list[int] | None:
        return _copy(self.balancer.node_ids)

    @property
    def loss_scale(self) -> float:
        """Factor ``W * b_r / B`` applied to this replica's loss before backward."""
        return self.balancer.allocation.loss_scale

    @property
    def cost_model(self) -> list[AffineCost] | None:
        """Every replica's fitted cost ``t_r(b)`` in seconds; ``None`` when the speeds were given."""
        return _copy(self.balancer.allocation.cost_model)

    @property
    def micro_batcher(self) -> MicroBatcher | None:
        """This replica's micro-batching (its cap, the emulated memory cap), when memory caps are set."""
        return self.balancer.micro

    @property
    def profile_seconds(self) -> float:
        """Wall-clock seconds this replica spent profiling."""
        return self.balancer.allocation.profile_seconds

    @property
    def profiling(self) -> bool:
        """Whether the first training steps are still profiling."""
        return self.balancer.profiling

    @property
    def comm_algorithm(self) -> CommAlgorithm | None:
        """The comm algorithm installed for this replica's fit (``comm`` resolved: see :attr:`comm_mode`)."""
        return self.balancer.comm

    @property
    def comm_mode(self) -> str | None:
        """The communication mode running (``comm`` after ``"auto"`` and fallbacks are resolved)."""
        return None if self.balancer.comm is None else self.balancer.comm.mode

    @property
    def comm_reduction(self) -> str | None:
        """``comm="hierarchical"``: ``"hierarchical"`` or ``"flat"`` after the measured choice; else ``None``."""
        return None if self.balancer.comm is None else self.balancer.comm.reduction

    @property
    def comm_stats(self) -> dict[str, float]:
        """Bytes sent by this replica inside its node and to other nodes, in total and per optimizer step."""
        return {} if self.balancer.comm is None else self.balancer.comm.stats

    def adopt_allocation(
        self, batch_sizes: list[int], speeds: list[float], costs: list[dict[str, float]] | None = None
    ) -> None:
        """Make ``batch_sizes`` (one per global rank) the allocation; every replica calls it with the same arguments.

        The training loader must be rebuilt before the next step. ``costs``: refreshed affine costs
        (``AffineCost.as_dict()`` form), or ``None`` to keep the model.
        """
        self.balancer.adopt(batch_sizes, speeds, costs)
