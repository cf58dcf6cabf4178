"""The Lightning package a run uses, as one namespace: ``lightning.pytorch`` or the standalone ``pytorch_lightning``. A
part takes the Lightning classes it needs (and ours built on them) from the flavour of the trainer or strategy it
serves, so that a run meets its own package's objects only (the Fabric strategies carry their one class). A flavour is
the module composing our classes with its package (:mod:`lightning_het.strategy`, :mod:`lightning_het._pl_compat`).
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

#: what the Trainer strategy's parts use of a flavour: its package's names and our classes built on that package
NAMES = ("TrainerFn", "TrainerStatus", "RunningStage", "ModelCheckpoint", "reset_seed", "WatchdogCallback")
NAMES += ("PreemptionCallback", "HeterogeneousBalanceCallback", "MixedAccelerator", "Preempted")

#: standalone or not -> its flavour, registered by the module composing our classes
_FLAVOURS: dict[bool, ModuleType] = {}


@functools.cache
def _standalone(cls: type) -> bool:
    return any(c.__module__.split(".", 1)[0] in ("pytorch_lightning", "lightning_fabric") for c in cls.__mro__)


def register_trainer_flavour(standalone: bool, module: ModuleType) -> None:
    """``module`` (defining :data:`NAMES`) is the flavour of the standalone or the unified package."""
    _FLAVOURS[standalone] = module


def trainer_flavour(obj: Any) -> ModuleType:
    """The flavour of ``obj`` (a trainer, strategy, ... or its class): ``pytorch_lightning``'s or ``lightning``'s."""
    return _FLAVOURS[_standalone(obj if isinstance(obj, type) else type(obj))]
