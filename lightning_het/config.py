"""The strategy's keywords, validated once into one frozen :class:`HeterogeneousConfig` (no torch, no Lightning)."""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any, Literal

from lightning_het.allocation import allocate_batch_sizes
from lightning_het.arguments import validate_strategy_arguments

#: seconds a replica has, from SIGTERM, to reach a step boundary, save and exit
DEFAULT_GRACE = 25.0

#: every flat setting of the Trainer strategy and its default (the typed keywords and their objects map onto them;
#: the grouped ones are also the deprecated flat keywords, see ``docs/strategy.md``)
KEYWORD_DEFAULTS: dict[str, Any] = {
    "global_batch_size": None,
    "speeds": None,
    "min_batch_size": 1,
    "max_batch_sizes": None,
    "max_micro_batch_sizes": None,
    "node_ids": None,
    "comm": "auto",
    "global_sync_every": None,
    "emulate_slowdown": None,
    "emulate_memory_cap": None,
    "profile_steps": 2,
    "profile_warmup": 1,
    "profile_cache": None,
    "device_map": None,
    "cpu_threads": None,
    "startup_timeout": None,
    "rebalance_every_n_epochs": None,
    "rebalance_threshold": None,
    "telemetry": True,
    "comm_warmup_steps": 0,
    "comm_autotune_steps": 5,
    "outer_optimizer": None,
    "outer_lr": 0.7,
    "outer_momentum": 0.9,
    "sync_dtype": "float32",
    "merge_weights": "samples",
    "preemption_checkpoint": None,
    "preemption_grace": DEFAULT_GRACE,
    "resume": None,
}

#: the keywords that mean the same in a Fabric loop; the others need the Trainer's loop
FABRIC_KEYWORDS = (
    "global_batch_size",
    "speeds",
    "min_batch_size",
    "max_batch_sizes",
    "node_ids",
    "comm",
    "global_sync_every",
    "comm_warmup_steps",
    "comm_autotune_steps",
    "outer_optimizer",
    "outer_lr",
    "outer_momentum",
    "sync_dtype",
    "merge_weights",
    "profile_steps",
    "profile_warmup",
    "profile_cache",
    "startup_timeout",
)

#: keywords that configure the devices (the mixed accelerator), not the config
DEVICE_KEYWORDS = ("device_map", "cpu_threads")


@dataclass(frozen=True)
class HeterogeneousConfig:
    """Every keyword of the strategy, normalised (``int``, ``float``, ``timedelta``); ``None``: not given.
    All fields required (defaults: :data:`KEYWORD_DEFAULTS`); treat the lists as read-only."""

    global_batch_size: int | None
    speeds: list[float] | None
    min_batch_size: int
    max_batch_sizes: list[int] | None
    max_micro_batch_sizes: list[int] | Literal["auto"] | None
    node_ids: list[int] | None
    comm: Any
    global_sync_every: int | None
    comm_warmup_steps: int
    comm_autotune_steps: int
    outer_optimizer: Any
    outer_lr: float
    outer_momentum: float
    sync_dtype: str
    merge_weights: str
    emulate_slowdown: list[float] | None
    emulate_memory_cap: list[int] | None
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
    resume: Literal["auto", False] | None

    @classmethod
    def from_keywords(cls, **keywords: Any) -> HeterogeneousConfig:
        """Validate every keyword (all required); an ``ArgumentError`` names the first impossible one."""
        return cls(**validate_strategy_arguments(**keywords))

    @classmethod
    def split_keywords(
        cls, strategy_cls: type, names: Collection[str], kwargs: Mapping[str, Any], **fixed: Any
    ) -> tuple[HeterogeneousConfig, dict[str, Any], dict[str, Any]]:
        """Split a strategy's keywords: a validated config (``fixed`` forced), device keywords, ``DDPStrategy``'s."""
        from lightning_het.arguments import check_ddp_keywords
        from lightning_het.comm.algorithms import validate_comm_args

        rest = dict(kwargs)
        given = {n: rest.pop(n, KEYWORD_DEFAULTS[n]) for n in KEYWORD_DEFAULTS if n in names}
        devices = {n: given.pop(n, None) for n in DEVICE_KEYWORDS}
        keywords = {n: v for n, v in KEYWORD_DEFAULTS.items() if n not in DEVICE_KEYWORDS} | given | fixed
        config = cls.from_keywords(**keywords, timeout=rest.get("timeout"))
        validate_comm_args(keywords["comm"], keywords["global_sync_every"], keywords["comm_warmup_steps"])  # warnings
        check_ddp_keywords(strategy_cls, list(names), rest)
        if config.timeout is not None:
            rest["timeout"] = config.timeout
        return config, devices, rest

    def check_world(self, num_nodes: int, devices: int) -> None:
        """Checks that need the world size (list lengths, a global batch the bounds can hold); ``ValueError``."""
        world = num_nodes * devices
        if world < 1:
            return
        for name, values in (
            ("speeds", self.speeds),
            ("max_batch_sizes", self.max_batch_sizes),
            ("node_ids", self.node_ids),
            ("emulate_slowdown", self.emulate_slowdown),
            ("max_micro_batch_sizes", None if self.max_micro_batch_sizes == "auto" else self.max_micro_batch_sizes),
            ("emulate_memory_cap", self.emulate_memory_cap),
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
