"""The strategy's keywords, validated once into one frozen :class:`HeterogeneousConfig` (no torch, no Lightning).

:class:`~lightning_het.HeterogeneousStrategy` and the Fabric strategy build it in their constructors with
:meth:`HeterogeneousConfig.from_keywords`; the checks are the pure validators of :mod:`lightning_het.arguments`,
which the app's config schema (:mod:`lightning_het.app.config`) calls too, so the two can never disagree. Checks
that need the world size or the data run later, in the strategy.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any, Literal

from lightning_het.arguments import validate_strategy_arguments

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

    def as_dict(self) -> dict[str, Any]:
        """The fields by name (shallow: the lists are shared)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}
