"""The Lightning package a run uses, as one namespace: ``lightning.pytorch`` or the standalone ``pytorch_lightning``. A
part takes the Lightning classes it needs (and ours built on them) from the flavour of the trainer or strategy it
serves, so that a run meets its own package's objects only (the Fabric strategies carry their one class)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any


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
    BalanceCallback: type
    MixedAccelerator: type
    Preempted: type

    @classmethod
    def of(cls, names: dict[str, Any]) -> TrainerFlavour:
        """The flavour of the names in ``names`` (a module's globals); ``BalanceCallback``: ours, by its name."""
        names = {**names, "BalanceCallback": names["HeterogeneousBalanceCallback"]}
        return cls(**{field.name: names[field.name] for field in fields(cls)})


#: standalone or not -> its flavour, built on first use by what the module composing our classes registered
_FLAVOURS: dict[bool, Callable[[], TrainerFlavour]] = {}


@functools.cache
def _standalone(cls: type) -> bool:
    return any(c.__module__.split(".", 1)[0] in ("pytorch_lightning", "lightning_fabric") for c in cls.__mro__)


def register_trainer_flavour(standalone: bool, build: Callable[[], TrainerFlavour]) -> None:
    """``build`` makes the flavour of the standalone or the unified package (called on first use)."""
    _FLAVOURS[standalone] = functools.cache(build)


def trainer_flavour(obj: Any) -> TrainerFlavour:
    """The flavour of ``obj`` (a trainer, strategy, ... or its class): ``pytorch_lightning``'s or ``lightning``'s."""
    return _FLAVOURS[_standalone(obj if isinstance(obj, type) else type(obj))]()
