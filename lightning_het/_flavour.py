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
    ScriptLauncher: type
    Preempted: type


@dataclass(frozen=True)
class FabricFlavour:
    """What the Fabric strategy uses of one Fabric package, and our classes built on that package."""

    DistributedSamplerWrapper: type
    ScriptLauncher: type


@functools.cache
def _standalone_class(cls: type) -> bool:
    return any(c.__module__.split(".", 1)[0] in STANDALONE for c in cls.__mro__)


def is_standalone(obj: Any) -> bool:
    """Whether ``obj`` (a trainer, strategy, callback, ... or its class) belongs to a standalone package."""
    return _standalone_class(obj if isinstance(obj, type) else type(obj))


def trainer_flavour(obj: Any) -> TrainerFlavour:
    """The flavour of ``obj`` (a trainer, strategy, ... or its class): ``pytorch_lightning``'s or ``lightning``'s."""
    if is_standalone(obj):
        from lightning_het._pl_compat import TRAINER_FLAVOUR

        return TRAINER_FLAVOUR
    return _unified_trainer()


def fabric_flavour(obj: Any) -> FabricFlavour:
    """The flavour of ``obj`` (a Fabric strategy or its class): ``lightning_fabric``'s or ``lightning.fabric``'s."""
    if is_standalone(obj):
        from lightning_het._fabric_compat import FABRIC_FLAVOUR

        return FABRIC_FLAVOUR
    return _unified_fabric()


@functools.cache
def _unified_trainer() -> TrainerFlavour:
    from lightning.fabric.utilities.seed import reset_seed
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.trainer.states import RunningStage, TrainerFn, TrainerStatus

    from lightning_het.balance.monitor import HeterogeneousBalanceCallback
    from lightning_het.balance.profiler import ProfilerCallback
    from lightning_het.cluster.accelerators import MixedAccelerator
    from lightning_het.reliability.lifecycle import HeterogeneousScriptLauncher
    from lightning_het.reliability.preemption import Preempted, PreemptionCallback
    from lightning_het.reliability.supervision import WatchdogCallback

    return TrainerFlavour(
        TrainerFn=TrainerFn,
        TrainerStatus=TrainerStatus,
        RunningStage=RunningStage,
        ModelCheckpoint=ModelCheckpoint,
        reset_seed=reset_seed,
        WatchdogCallback=WatchdogCallback,
        PreemptionCallback=PreemptionCallback,
        ProfilerCallback=ProfilerCallback,
        BalanceCallback=HeterogeneousBalanceCallback,
        MixedAccelerator=MixedAccelerator,
        ScriptLauncher=HeterogeneousScriptLauncher,
        Preempted=Preempted,
    )


@functools.cache
def _unified_fabric() -> FabricFlavour:
    from lightning.fabric.utilities.distributed import DistributedSamplerWrapper

    from lightning_het.reliability.lifecycle import HeterogeneousFabricScriptLauncher

    return FabricFlavour(
        DistributedSamplerWrapper=DistributedSamplerWrapper, ScriptLauncher=HeterogeneousFabricScriptLauncher
    )
