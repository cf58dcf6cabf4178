"""The strategy's keywords, validated once into one frozen :class:`HeterogeneousConfig` (no torch, no Lightning).

:class:`~lightning_het.HeterogeneousStrategy` and the Fabric strategy build it in their constructors with
:meth:`HeterogeneousConfig.from_keywords`; the checks are the pure validators of :mod:`lightning_het.arguments`,
which the app's config schema (:mod:`lightning_het.app.config`) calls too, so the two can never disagree. Checks
that need the world size run at Trainer construction (:meth:`HeterogeneousConfig.check_world`); those that need the
data, in the strategy.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any, Literal

from lightning_het.arguments import validate_strategy_arguments
from lightning_het.balance.allocation import allocate_batch_sizes

__all__ = ["HeterogeneousConfig"]


@dataclass(frozen=True)
class HeterogeneousConfig:
    """Every keyword of the strategy, normalised: integers as ``int``, numbers as ``float``, timeouts as
    ``timedelta``. ``None`` means "not given" (derived or profiled later). Every field is required: the defaults live
    in the strategy's signature. The lists are the validators' own copies; treat them as read-only."""

    global_batch_size: int | None
    speeds: list[float] | None
    min_batch_size: int
    max_batch_sizes: list[int] | None
    node_ids: list[int] | None
    comm: Any
    global_sync_every: int | None
    comm_warmup_steps: int
    comm_autotune_steps: int
    emulate_slowdown: list[float] | None
    profile_steps: int
    profile_warmup: int
    profile_cache: str | os.PathLike[str] | bool | None
    startup_timeout: timedelta | None
    timeout: timedelta | None
    rebalance_every_n_epochs: int | None
    rebalance_threshold: float | None
    telemetry: bool
    preemption_grace: float
    preemption_checkpoint: str | os.PathLike[str] | Literal[False] | None

    @classmethod
    def from_keywords(cls, **keywords: Any) -> HeterogeneousConfig:
        """Validate every keyword (all fields are required) and return the normalised configuration.

        Raises:
            ArgumentError: the first impossible value, its ``argument`` naming the keyword (a ``ValueError``).
        """
        return cls(**validate_strategy_arguments(**keywords))

    def check_world(self, num_nodes: int, devices: int) -> None:
        """Checks that need only the world size (``num_nodes x devices`` replicas): one entry per global rank in the
        per-replica lists, and a global batch the batch bounds can hold. Run at Trainer construction.

        Raises:
            ValueError: naming the keyword that does not fit the job.
        """
        world = num_nodes * devices
        if world < 1:
            return
        for name, values in (
            ("speeds", self.speeds),
            ("max_batch_sizes", self.max_batch_sizes),
            ("node_ids", self.node_ids),
            ("emulate_slowdown", self.emulate_slowdown),
        ):
            if values is not None and len(values) != world:
                raise ValueError(
                    f"You set `{name}` with {len(values)} entries ({list(values)}), but the job has {world} replicas"
                    f" (num_nodes={num_nodes} x devices={devices}). HINT: give one entry per global rank."
                )
        if self.global_batch_size is not None:
            # raises ValueError naming global_batch_size / max_batch_sizes when the bounds cannot hold it
            allocate_batch_sizes(
                self.global_batch_size,
                self.speeds or [1.0] * world,
                min_batch_size=self.min_batch_size,
                max_batch_sizes=self.max_batch_sizes,
            )

    def as_dict(self) -> dict[str, Any]:
        """The fields by name (shallow: the lists are shared)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}
