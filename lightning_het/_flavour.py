"""The Lightning package a run uses, as one namespace: the module composing our classes with ``lightning.pytorch``
(:mod:`lightning_het.strategy`) or with the standalone ``pytorch_lightning`` (:mod:`lightning_het._pl_compat`)."""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

#: what the Trainer strategy's parts use of a flavour: its package's names and our classes built on that package
NAMES = ("TrainerFn", "TrainerStatus", "RunningStage", "ModelCheckpoint", "reset_seed", "WatchdogCallback")
NAMES += ("PreemptionCallback", "HeterogeneousBalanceCallback", "MixedAccelerator", "Preempted")

#: standalone or not -> its flavour (defining :data:`NAMES`), set by the module composing our classes
FLAVOURS: dict[bool, ModuleType] = {}


@functools.cache
def _standalone(cls: type) -> bool:
    return any(c.__module__.split(".", 1)[0] in ("pytorch_lightning", "lightning_fabric") for c in cls.__mro__)


def trainer_flavour(obj: Any) -> ModuleType:
    """The flavour of ``obj`` (a trainer, strategy, ... or its class): ``pytorch_lightning``'s or ``lightning``'s."""
    return FLAVOURS[_standalone(obj if isinstance(obj, type) else type(obj))]
