"""The Lightning package a run uses, as one namespace: ``lightning.pytorch`` / ``lightning.fabric``, or the standalone
``pytorch_lightning`` / ``lightning_fabric`` (the same code under other names: separate classes, enums and registries).

A part that needs a Lightning class, or one of ours built on one, takes it from the flavour of the trainer or strategy
it serves, so a run meets the objects of its own package only. Our classes are composed with each package's by plain
class statements: next to their flavour-independent bodies for the unified package, in
:mod:`lightning_het._pl_compat` / :mod:`lightning_het._fabric_compat` for the standalone ones.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: the standalone packages, whose objects get the standalone flavour
STANDALONE = ("pytorch_lightning", "lightning_fabric")


@dataclass(frozen=True)
class TrainerFlavour:
    """What the Trainer strategy's parts use of one Trainer package, and our classes built on that package."""

    TrainerFn: Any
    TrainerStatus: Any
    RunningStage: Any
    ModelCheckpoint: type
    reset_seed: Callable[[], Any]
    WatchdogCallback: type
    PreemptionCallback: type
    ProfilerCallback: type
    BalanceCallback: type
    MixedAccelerator: type
    Preempted: type


@dataclass(frozen=True)
class FabricFlavour:
    """What the Fabric strategy uses of one Fabric package, and our classes built on that package."""

    DistributedSamplerWrapper: type


@functools.cache
def _standalone_class(cls: type) -> bool:
    return any(c.__module__.split(".", 1)[0] in STANDALONE for c in cls.__mro__)


def is_standalone(obj: Any) -> bool:
    """Whether ``obj`` (a trainer, strategy, callback, ... or its class) belongs to a standalone package."""
    return _standalone_class(obj if isinstance(obj, type) else type(obj))


#: each package's flavour, registered by the module that builds it (the strategies for the unified package,
#: ``_pl_compat`` / ``_fabric_compat`` for the standalone ones): this module imports nothing of the package
_TRAINER: dict[bool, Callable[[], TrainerFlavour]] = {}
_FABRIC: dict[bool, Callable[[], FabricFlavour]] = {}


def register_trainer_flavour(standalone: bool, build: Callable[[], TrainerFlavour]) -> None:
    """``build`` makes the Trainer flavour of the standalone or the unified package (called on first use)."""
    _TRAINER[standalone] = functools.cache(build)


def register_fabric_flavour(standalone: bool, build: Callable[[], FabricFlavour]) -> None:
    """``build`` makes the Fabric flavour of the standalone or the unified package (called on first use)."""
    _FABRIC[standalone] = functools.cache(build)


def trainer_flavour(obj: Any) -> TrainerFlavour:
    """The flavour of ``obj`` (a trainer, strategy, ... or its class): ``pytorch_lightning``'s or ``lightning``'s."""
    return _TRAINER[is_standalone(obj)]()


def fabric_flavour(obj: Any) -> FabricFlavour:
    """The flavour of ``obj`` (a Fabric strategy or its class): ``lightning_fabric``'s or ``lightning.fabric``'s."""
    return _FABRIC[is_standalone(obj)]()
