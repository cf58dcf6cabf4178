"""Spawn/fork launching: the allocation sent back to the parent process, and the process group destroyed at exit."""

from __future__ import annotations

import atexit
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch.distributed as dist

from lightning_het._compat import _MultiProcessingLauncher
from lightning_het.reliability.supervision import validate_launch_environment

log = logging.getLogger(__name__)

_WORKER_DRAIN_S = 0.1  # seconds the interpreter stays whole (GIL released) for the backend's threads at exit


class ExitCleanup:
    """Destroys the default process group when the process exits, if the last fit/evaluation ended normally."""

    registered = False
    clean = True

    @classmethod
    def register(cls) -> None:
        if not cls.registered:
            atexit.register(cls.run)
            cls.registered = True

    @classmethod
    def run(cls) -> None:
        if cls.clean and dist.is_available() and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as err:  # never turn a finished run into a failure at exit
                log.debug("lightning-het: destroying the process group at exit failed: %s", err)
            # a Gloo worker thread may still hold the last collective's tensors; it needs the GIL to free them, and a
            # thread that asks for it once finalisation has begun is ended by a forced unwind that aborts the process
            time.sleep(_WORKER_DRAIN_S)


@runtime_checkable
class AllocationCarrier(Protocol):
    """A strategy whose allocation travels from the spawned workers back to the parent process."""

    def export_allocation(self) -> dict[str, Any]: ...
    def import_allocation(self, state: dict[str, Any]) -> None: ...


class AllocationResultsMixin:
    """Spawn/fork launcher mixin: sends the allocation back to the parent, checks the multi-node rendezvous."""

    #: multi-node rendezvous variables are checked at launch, not at Trainer construction
    validates_launch_environment = True

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        strategy = self._strategy  # type: ignore[attr-defined]
        validate_launch_environment(strategy.num_nodes, strategy.cluster_environment)
        return super().launch(function, *args, trainer=trainer, **kwargs)  # type: ignore[misc]

    def get_extra_results(self, trainer: Any) -> dict[str, Any]:
        extra = super().get_extra_results(trainer)  # type: ignore[misc]
        strategy = trainer.strategy
        if isinstance(strategy, AllocationCarrier):
            extra["lightning_het"] = strategy.export_allocation()
        return extra

    def update_main_process_results(self, trainer: Any, extra: dict[str, Any]) -> None:
        super().update_main_process_results(trainer, extra)  # type: ignore[misc]
        strategy = trainer.strategy
        if isinstance(strategy, AllocationCarrier) and extra.get("lightning_het"):
            strategy.import_allocation(extra["lightning_het"])


class HeterogeneousMultiProcessingLauncher(AllocationResultsMixin, _MultiProcessingLauncher):
    """``lightning.pytorch``'s spawn/fork launcher with :class:`AllocationResultsMixin`."""
