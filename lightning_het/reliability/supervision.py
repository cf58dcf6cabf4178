"""Wiring the watchdog into a run: its Trainer callback, start/attach/stop, launch checks and timeouts."""

from __future__ import annotations

import copy
import itertools
import os
import socket
import subprocess
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from lightning_het._compat import default_store, should_accumulate
from lightning_het._flavour import trainer_flavour
from lightning_het.cluster.rendezvous import TOKEN_ENV, agree_on_token
from lightning_het.reliability.heartbeats import BOOT_ID
from lightning_het.reliability.processes import launched_replicas
from lightning_het.reliability.verdicts import Phase
from lightning_het.reliability.watchdog import Watchdog

_generation = itertools.count()  # one key space per watchdog started in this process (same order on every rank)


class WatchdogCallbackMixin:
    """Feeds the :class:`Watchdog` with the training thread's progress (mixed into each package's ``Callback``)."""

    def __init__(self, watchdog: Watchdog) -> None:
        self.watchdog = watchdog

    def __deepcopy__(self, memo: dict[int, Any]) -> WatchdogCallbackMixin:
        """A copy sharing this process's running watchdog, so ``copy.deepcopy(trainer.callbacks)`` works."""
        return copy.copy(self)

    # loops
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.watchdog.arm("fit")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.watchdog.disarm("fit")
        self.watchdog.emergency = None  # the fit is over: nothing left to save

    def _eval_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.watchdog.arm("eval")
        self.watchdog.mark(Phase.EVAL_LOADING, eval_batch=-1, stage=_stage(trainer))

    def _eval_end(self, *args: Any) -> None:
        self.watchdog.mark(Phase.EVAL_DONE)
        self.watchdog.disarm("eval")

    on_validation_start = on_test_start = on_predict_start = _eval_start
    on_validation_end = on_test_end = on_predict_end = _eval_end

    # training batch
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self.watchdog.mark(Phase.TRAINING_STEP, new_batch=True)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        self.watchdog.mark(Phase.BACKWARD)

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.watchdog.mark(Phase.OPTIMIZER_STEP)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.watchdog.mark(Phase.BETWEEN_BATCHES)
        emergency = self.watchdog.emergency
        if emergency is not None and not should_accumulate(trainer):
            emergency.step_ended()  # what an emergency checkpoint of this step holds besides the tensors

    def _between(self, *args: Any, **kwargs: Any) -> None:
        self.watchdog.mark(Phase.BETWEEN_BATCHES)

    on_train_epoch_start = on_train_epoch_end = _between

    # evaluation batches
    def _eval_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, *args: Any
    ) -> None:
        self.watchdog.mark(Phase.EVAL_STEP, eval_batch=batch_idx, stage=_stage(trainer))

    def _eval_batch_end(self, *args: Any, **kwargs: Any) -> None:
        self.watchdog.mark(Phase.EVAL_LOADING)

    def _eval_epoch_end(self, *args: Any, **kwargs: Any) -> None:
        self.watchdog.mark(Phase.EVAL_EPOCH_END)  # the callbacks' hooks run before the LightningModule's

    on_validation_batch_start = on_test_batch_start = on_predict_batch_start = _eval_batch_start
    on_validation_batch_end = on_test_batch_end = on_predict_batch_end = _eval_batch_end
    on_validation_epoch_end = on_test_epoch_end = on_predict_epoch_end = _eval_epoch_end

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: Any) -> None:
        self.watchdog.mark(self.watchdog.phase)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.watchdog.on_exception(exception)


class WatchdogCallback(WatchdogCallbackMixin, Callback):
    """Feeds the :class:`Watchdog` with the training thread's progress; added to the Trainer by the strategy."""


def _stage(trainer: pl.Trainer) -> str:
    stage = trainer.state.stage
    return str(stage.value) if stage is not None else ""


def as_seconds(value: timedelta | float | None) -> float | None:
    if value is None:
        return None
    return value.total_seconds() if isinstance(value, timedelta) else float(value)


class LaunchingReplicas(Protocol):
    """What :func:`start_watchdog` reads of the strategy: the local replicas its launcher started (a ``popen``
    launcher's ``procs``, local ranks 1, 2, ...; none for a spawn or fork launcher) and where this node's global ranks
    begin (``node_rank * num_processes``)."""

    @property
    def launcher(self) -> Any: ...
    @property
    def node_rank(self) -> int: ...
    @property
    def num_processes(self) -> int: ...


def start_watchdog(
    strategy: LaunchingReplicas, timeout: timedelta | float | None, trainer: pl.Trainer | None = None
) -> Watchdog | None:
    """Start a :class:`Watchdog` for this replica (multi-replica jobs only), in phase ``SETUP``."""
    seconds = as_seconds(timeout)
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2 or not seconds:
        return None
    token = agree_on_token(os.environ.get(TOKEN_ENV, ""))
    base = default_store()
    connection = base.clone() if hasattr(base, "clone") else base
    namespace = f"lightning_het/watchdog/{next(_generation)}/"
    store = dist.PrefixStore(namespace, connection)
    rank = dist.get_rank()
    identities: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(identities, (socket.gethostname(), BOOT_ID, os.getpid()))  # not through the store
    hosts_store = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true"
    watchdog = Watchdog(
        store,
        rank,
        dist.get_world_size(),
        seconds,
        hosts_store=hosts_store,
        children=_launched_replicas(strategy),
        token=token,
        namespace=namespace,
        peers=dict(enumerate(identities)),
    )
    watchdog.start()
    if trainer is not None:
        attach_watchdog(watchdog, trainer)
    return watchdog


def attach_watchdog(watchdog: Watchdog | None, trainer: pl.Trainer) -> None:
    """Give ``trainer`` the :class:`WatchdogCallback` of ``watchdog`` (replacing an older one)."""
    trainer.callbacks[:] = [cb for cb in trainer.callbacks if not isinstance(cb, WatchdogCallbackMixin)]
    if watchdog is not None:  # the trainer's own package's Callback
        trainer.callbacks.append(trainer_flavour(trainer).WatchdogCallback(watchdog))


def stop_watchdog(watchdog: Watchdog | None, trainer: pl.Trainer | None = None, *, finished: bool = False) -> None:
    """Stop ``watchdog`` and remove its callback; ``finished``: first wait until every replica finished."""
    if watchdog is None:
        return
    if finished:
        watchdog.finish()
    else:
        watchdog.stop()
    if trainer is not None:
        attach_watchdog(None, trainer)


def _launched_replicas(strategy: LaunchingReplicas) -> Callable[[], list[tuple[int, subprocess.Popen]]]:
    """The local replicas that this process launched (Lightning's ``popen`` launcher), with their global ranks."""

    def children() -> list[tuple[int, subprocess.Popen]]:
        procs = launched_replicas(strategy.launcher)
        first = strategy.node_rank * strategy.num_processes
        return [(first + local_rank, proc) for local_rank, proc in enumerate(procs, start=1)]

    return children


def validate_launch_environment(num_nodes: int, cluster_environment: Any, environ: Any = None) -> None:
    """Refuse multi-node launches that would wait forever for a rendezvous that cannot happen."""
    environ = os.environ if environ is None else environ
    if num_nodes <= 1 or cluster_environment is None or cluster_environment.creates_processes_externally:
        return
    if type(cluster_environment).__name__ != "LightningEnvironment":
        return
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK") if not environ.get(name)]
    if missing:
        raise ValueError(
            f"You set num_nodes={num_nodes}, but the environment variable(s) {', '.join(missing)} are not set, so the"
            " nodes cannot find each other (each would wait for its own rendezvous until the start-up timeout)."
            " HINT: on every node export MASTER_ADDR=<host of node 0>, MASTER_PORT=<free port, same on all nodes>"
            " and NODE_RANK=<0..num_nodes-1>, or launch through SLURM / torchrun."
        )
