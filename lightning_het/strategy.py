"""``HeterogeneousStrategy``: DDP with per-replica batch sizes proportional to speed and exact gradients."""

from __future__ import annotations

import inspect
import os
import sys
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.distributed import ReduceOp
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_het._compat import (
    _BatchNorm,
    _register_ddp_comm_hook,
    attached_trainer,
    record_loader_arguments,
)
from lightning_het.arguments import check_ddp_keywords
from lightning_het.balance.allocation import allocate_batch_sizes
from lightning_het.balance.cost import AffineCost
from lightning_het.balance.monitor import BalanceMonitor, attach_monitor
from lightning_het.balance.planner import (
    batch_bounds,
    cached_costs,
    measured_speeds,
    monitor_settings,
    profile_cache_entry,
    split_global_batch,
    start_profiler,
    warn_useless_replicas,
)
from lightning_het.balance.profiler import InLoopProfiler, attach_profiler
from lightning_het.balance.profiling import ProfileCache
from lightning_het.balance.report import telemetry_section
from lightning_het.balance.state import Allocation, render_balance_table
from lightning_het.cluster.accelerators import (
    apply_local_settings,
    configure_devices,
    device_labels,
    mixed_accelerator_kwargs,
    unbound_process_group,
)
from lightning_het.cluster.devices import DeviceMapArg, DevicePlan
from lightning_het.cluster.rendezvous import keep_sockets_local, restore_job_environment
from lightning_het.cluster.startup import detect_node_ids, init_process_group, startup_timeout_scope
from lightning_het.comm.controller import CommController, resolve_comm_mode, validate_comm_args
from lightning_het.comm.gather import all_gather_collection
from lightning_het.comm.modes import CommChoice
from lightning_het.config import HeterogeneousConfig
from lightning_het.data.splitting import LoaderSplitter, TrainingSplit, eval_weights
from lightning_het.reliability.checkpointing import (
    CHECKPOINT_KEY,
    checkpoint_record,
    log_resumed_allocation,
    plan_allocation,
    read_record,
    synchronize_before_save,
)
from lightning_het.reliability.launcher import ExitCleanup, HeterogeneousMultiProcessingLauncher
from lightning_het.reliability.loader_workers import shield_loader_workers
from lightning_het.reliability.preemption import (
    DEFAULT_GRACE,
    PreemptionHandler,
    attach_preemption,
    detach_preemption,
)
from lightning_het.reliability.supervision import (
    attach_watchdog,
    start_watchdog,
    stop_watchdog,
    validate_launch_environment,
)
from lightning_het.reliability.verdicts import Phase
from lightning_het.reliability.watchdog import Watchdog

__all__ = ["HeterogeneousStrategy"]


class HeterogeneousStrategyBase:
    """Data-parallel training where each replica's batch is sized to its speed.

    Every optimizer step consumes one *global batch* of ``global_batch_size`` samples, split among the replicas so that
    the slowest replica's step is as short as possible: by :func:`~lightning_het.balance.cost.allocate_affine` from each
    replica's profiled cost per step (fixed seconds plus seconds per sample, measured on the real training step), or
    in proportion to ``speeds`` when they are given (:func:`~lightning_het.allocate_batch_sizes`). See
    ``docs/balancing.md``. Every replica runs the same number of steps per epoch. Each replica's loss is multiplied by
    ``loss_scale = W * b_r / B`` before backward, so DDP's mean all-reduce yields exactly the gradient of the mean loss
    over the global batch (see :func:`~lightning_het.balance.allocation.loss_scale`); the logged loss is not scaled.

    Args:
        global_batch_size: samples per optimizer step over all replicas. Default: the datamodule's
            ``global_batch_size`` attribute when it has one, else the training DataLoader's ``batch_size`` x world size.
        speeds: relative throughput of each replica, indexed by global rank. Default: profiled.
        min_batch_size: no replica gets fewer samples per step.
        max_batch_sizes: per-replica upper bounds (device memory), indexed by global rank.
        node_ids: node id of each global rank. Default: detected from the cluster environment's node rank.
        comm: gradient communication: ``"allreduce"`` (DDP's all-reduce of pre-scaled gradients), ``"hierarchical"``,
            ``"node_local"`` or ``"auto"``. See ``docs/communication.md``.
        global_sync_every: K for ``node_local``: optimizer steps between global parameter averages.
        comm_autotune_steps: ``hierarchical`` (also when ``"auto"`` resolves to it): the first
            ``2 * comm_autotune_steps + 1`` optimizer steps alternate the node hierarchy with a flat all-reduce and
            time them; the faster is kept for the rest of ``fit`` (both are exact; ``strategy.comm_reduction`` says
            which). ``0``: always the hierarchy. See :mod:`lightning_het.comm.tuning`.
        emulate_slowdown: *emulation only*: replica ``r``'s steps take ``emulate_slowdown[r]`` times their real compute
            time (the profiled steps too: they are training steps), to reproduce a heterogeneous platform on
            homogeneous hardware. The replica sleeps ``f - 1`` times the forward time it just measured after the
            forward pass, and ``f - 1`` times the backward time it just measured at the end of its local backward,
            before the gradients are synchronised (see :class:`~lightning_het.balance.clock.StepClock`).
        profile_steps: trial steps per trial split. Without ``speeds``, the fit's first training steps profile each
            replica's cost per step, ``t(b) = fixed + per_sample * b`` seconds (:mod:`lightning_het.balance.cost`):
            they are ordinary training steps (every hook in Lightning's order, exact gradients) whose global batches
            are split by a schedule of trial splits instead of the allocation, and the step clock times each
            replica's local compute (without the wait in the gradient all-reduce). After the warm-up, two trial
            splits around the rough split alternate, ``profile_steps`` steps each, so every replica runs two batch
            sizes about 3x apart; each replica fits its cost through its fastest step at each size, the costs are
            all-gathered at the end of the last trial step, and the global batches not drawn yet by the loader are
            split to minimise the slowest replica's step (:func:`~lightning_het.balance.cost.allocate_affine`).
            Nothing profiles with one replica. See :mod:`lightning_het.balance.profiler` and ``docs/balancing.md``.
        profile_warmup: untimed equal-split steps first (CUDA context, ``cudnn.benchmark``, compilation); their
            fastest step gives the rough speeds that the trial splits are centred on (``0``: trials around the equal
            split).
        profile_cache: speed cache: a directory (or ``True``: ``~/.cache/lightning_het/profiles``) where each
            replica's fitted cost is kept under a key made of the module class and parameter count, the device, one
            training sample's tensor shapes, the precision, the emulated slowdown and the replicas per node
            (:func:`~lightning_het.balance.profiling.cache_key`). When every replica finds its entry, profiling is
            skipped (no trial split at all). ``None`` (default) or ``False``: off. Delete the directory to forget stale
            entries.
        device_map: the device of each local replica, e.g. ``["cuda:0", "cuda:1", "cpu"]`` (the same on every node), or
            ``{node_rank: [...]}`` when nodes differ. Mixes CPU and GPU replicas in one job through a
            :class:`~lightning_het.cluster.accelerators.MixedAccelerator` (leave
            ``Trainer(accelerator=..., devices=...)`` at ``"auto"``); Gloo is chosen when any replica is a CPU. See
            ``docs/mixed_devices.md``.
        cpu_threads: with ``device_map``: intra-op threads per CPU replica (int) or per local replica (list).
            Default: the node's cores minus one per GPU replica, split evenly among the CPU replicas.
        startup_timeout: seconds (or ``timedelta``) the replicas wait for each other at start-up; ``timeout`` then
            bounds every collective and the hung-replica watchdog. Default: the larger of ``timeout`` and 10 minutes.
            See ``docs/reliability.md``.
        rebalance_every_n_epochs: semi-dynamic rebalancing: at the end of every n-th epoch, re-derive the speeds
            from the measured compute times (all-gathered, so every rank agrees) and re-allocate the global batch for
            the next epoch when the hysteresis allows (see ``rebalance_threshold``). Keeps the global batch, equal step
            counts and exact gradients. Default ``None``: every epoch when ``rebalance_threshold`` is set, else never.
        rebalance_threshold: imbalance (max / min median compute time per step across replicas, >= 1) from which a
            rebalancing check re-allocates; a new allocation is adopted only if it is also predicted to shorten the
            step by >= 3 %. Default: 1.1 when ``rebalance_every_n_epochs`` is set. See ``docs/benchmarks.md``.
        telemetry: time every step of every replica (compute, wait in gradient synchronisation, samples/s), log
            per-epoch figures through the trainer's loggers (``het/...``) and write a balance report (table and plot)
            into ``trainer.log_dir`` when ``fit`` ends. Required by rebalancing. See
            :mod:`lightning_het.balance.monitor`.
        preemption_checkpoint: where rank 0 writes the checkpoint when the job receives ``SIGTERM`` (or ``SIGUSR1``)
            during ``fit``: a file path, or a directory (``last.ckpt`` inside it). Default: ``last.ckpt`` in the
            directory of the trainer's first ``ModelCheckpoint``, else ``<default_root_dir>/checkpoints/last.ckpt``.
            ``False``: no checkpoint; the replicas still stop together at a step boundary and exit with status 143.
            ``Trainer(enable_checkpointing=False)`` does not switch the preemption save off. See
            ``docs/preemption.md``.
        preemption_grace: seconds a replica has, from the signal, to reach the next step boundary, save and exit;
            a replica still running then (e.g. stuck in a collective) ends with status 143 anyway. Keep it below the
            scheduler's kill delay (SLURM ``KillWait``, often 30 s).
        **kwargs: everything else goes to :class:`~lightning.pytorch.strategies.DDPStrategy` (``timeout``,
            ``start_method``, ``process_group_backend``, ``find_unused_parameters``, ...).
    """

    strategy_name = "heterogeneous"
    #: launcher class used for ``start_method`` spawn/fork/forkserver (set by the concrete class)
    _spawn_launcher_cls: type = HeterogeneousMultiProcessingLauncher
    #: whether a Lightning ``Trainer`` drives this strategy (set by each concrete class, whatever its package:
    #: ``lightning.pytorch`` or the standalone ``pytorch_lightning``). A Trainer strategy gets the hung/dead-replica
    #: watchdog from ``setup_environment`` on and, under ``popen``, the
    #: :mod:`lightning_het.reliability.lifecycle` launcher; a
    #: Fabric strategy (your own loop, no progress hooks) keeps Fabric's launcher.
    _trainer_loop: bool = False

    def __init__(
        self,
        global_batch_size: int | None = None,
        speeds: Sequence[float] | None = None,
        min_batch_size: int = 1,
        max_batch_sizes: Sequence[int] | None = None,
        node_ids: Sequence[int] | None = None,
        comm: CommChoice = "auto",
        global_sync_every: int | None = None,
        emulate_slowdown: Sequence[float] | None = None,
        profile_steps: int = 2,
        profile_warmup: int = 1,
        profile_cache: str | os.PathLike[str] | bool | None = None,
        device_map: DeviceMapArg | None = None,
        cpu_threads: int | Sequence[int] | None = None,
        startup_timeout: float | timedelta | None = None,
        rebalance_every_n_epochs: int | None = None,
        rebalance_threshold: float | None = None,
        telemetry: bool = True,
        comm_warmup_steps: int = 0,
        comm_autotune_steps: int = 5,
        preemption_checkpoint: str | os.PathLike | Literal[False] | None = None,
        preemption_grace: float = DEFAULT_GRACE,
        **kwargs: Any,
    ) -> None:
        # every value check of our keywords (the validators the app's config schema calls too)
        self._config = config = HeterogeneousConfig.from_keywords(
            global_batch_size=global_batch_size,
            speeds=speeds,
            min_batch_size=min_batch_size,
            max_batch_sizes=max_batch_sizes,
            node_ids=node_ids,
            comm=comm,
            global_sync_every=global_sync_every,
            comm_warmup_steps=comm_warmup_steps,
            comm_autotune_steps=comm_autotune_steps,
            emulate_slowdown=emulate_slowdown,
            profile_steps=profile_steps,
            profile_warmup=profile_warmup,
            profile_cache=profile_cache,
            startup_timeout=startup_timeout,
            timeout=kwargs.get("timeout"),
            rebalance_every_n_epochs=rebalance_every_n_epochs,
            rebalance_threshold=rebalance_threshold,
            telemetry=telemetry,
            preemption_grace=preemption_grace,
            preemption_checkpoint=preemption_checkpoint,
        )
        validate_comm_args(comm, global_sync_every, comm_warmup_steps)  # its warnings for settings that do nothing
        # a misspelt DDP keyword or an unknown backend would otherwise fail only after the launch
        check_ddp_keywords(type(self), list(inspect.signature(HeterogeneousStrategyBase.__init__).parameters), kwargs)
        if config.timeout is not None:
            kwargs["timeout"] = config.timeout  # seconds or timedelta
        self._watchdog = None  # hung/dead-replica watchdog, running between setup and teardown
        # SIGTERM/SIGUSR1: agree at a step boundary, save, exit 143 (docs/preemption.md)
        self._preemption: PreemptionHandler | None = None
        kwargs = mixed_accelerator_kwargs(type(self), device_map, cpu_threads, kwargs)  # MixedAccelerator
        super().__init__(**kwargs)
        self._init_parts()

    def _init_parts(self) -> None:
        """The per-process state and the parts the strategy owns (empty until the Trainer sets them up)."""
        self._device_plan: DevicePlan | None = None  # resolved from the device map at Trainer construction
        self._comm_controller: CommController | None = None  # built per process when DDP wraps the model
        # set once the allocation is known (in the worker processes, and in the parent after spawn)
        self._allocation = Allocation()
        self._node_ids: list[int] | None = None
        self._profiler: InLoopProfiler | None = None  # the fit's in-loop profiling (balance/profiler.py)
        self._comm_sizes: list[int] | None = None  # the split the comm controller was last given
        self._cache_entry: tuple[ProfileCache | None, str | None] = (None, None)  # this replica's speed cache key
        self._loaders = LoaderSplitter()  # the loader split: training sampler, resume record, evaluation weights
        self._batchnorm_layers: list[str] = []  # per-replica batch norm layers found at setup
        # telemetry and semi-dynamic rebalancing; the monitor is built per process in `setup`
        self._monitor: BalanceMonitor | None = None
        self._sockets_set: list[str] = []  # socket variables this Trainer call set in os.environ (unset at teardown)

    # ------------------------------------------------------------------ public state
    @property
    def config(self) -> HeterogeneousConfig:
        """The validated keywords of this strategy (frozen)."""
        return self._config

    @property
    def batch_sizes(self) -> list[int] | None:
        """Samples per step of every replica, indexed by global rank (``None`` before the allocation)."""
        return None if self._allocation.batch_sizes is None else list(self._allocation.batch_sizes)

    @property
    def local_batch_size(self) -> int | None:
        """Samples per step on this replica."""
        return None if self._allocation.batch_sizes is None else self._allocation.batch_sizes[self.global_rank]

    @property
    def global_batch_size(self) -> int | None:
        return self._allocation.global_batch_size

    @property
    def speeds(self) -> list[float] | None:
        """Relative throughput (samples/s when profiled) of every replica, indexed by global rank."""
        return None if self._allocation.speeds is None else list(self._allocation.speeds)

    @property
    def speeds_given(self) -> bool:
        """Whether the user gave ``speeds`` (``False``: they are, or will be, profiled)."""
        return self._config.speeds is not None

    @property
    def node_ids(self) -> list[int] | None:
        return None if self._node_ids is None else list(self._node_ids)

    @property
    def loss_scale(self) -> float:
        """Factor ``W * b_r / B`` applied to this replica's loss before backward."""
        return self._allocation.loss_scale

    @property
    def cost_model(self) -> list[AffineCost] | None:
        """Every replica's fitted cost ``t_r(b) = fixed_s + per_sample_s * b`` (seconds), indexed by global rank;
        ``None`` when the speeds were given rather than profiled."""
        return None if self._allocation.cost_model is None else list(self._allocation.cost_model)

    @property
    def profile_seconds(self) -> float:
        """Wall-clock seconds this replica spent profiling."""
        return self._allocation.profile_seconds

    @property
    def process_group_timeout(self) -> timedelta | None:
        """The collective timeout (the ``timeout`` keyword; ``None``: torch's default). During the rendezvous it is the
        longer ``startup_timeout`` (see :meth:`_startup_timeout_scope`)."""
        return self._timeout

    @property
    def device_plan(self) -> DevicePlan | None:
        """Where every replica runs and with how many threads (``device_map``), resolved at Trainer construction;
        ``None`` without a device map."""
        return self._device_plan

    @property
    def comm_controller(self) -> CommController | None:
        """The gradient communication of this replica (built when DDP wraps the model; ``None`` before)."""
        return self._comm_controller

    @property
    def watchdog(self) -> Watchdog | None:
        """This replica's hung/dead-replica watchdog while one runs (multi-replica jobs, setup to teardown)."""
        return self._watchdog

    def release_watchdog(self) -> Watchdog | None:
        """Hand the running watchdog over (to the launcher's run-to-the-end barrier, which stops it): the strategy
        forgets it. Returns ``None`` when none runs."""
        watchdog, self._watchdog = self._watchdog, None
        return watchdog

    def _startup_timeout_scope(self) -> AbstractContextManager[None]:
        """Around the rendezvous: ``startup_timeout`` when longer than ``timeout``, then ``timeout`` again (see
        :func:`~lightning_het.cluster.startup.startup_timeout_scope`). The only place that changes the timeout."""
        return startup_timeout_scope(self._timeout, self._config.startup_timeout, self._set_timeout)

    def _set_timeout(self, timeout: timedelta | None) -> None:
        self._timeout = timeout

    # ------------------------------------------------------------------ registration
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        if cls.strategy_name in strategy_registry:
            return
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="Heterogeneous data parallelism: speed-proportional batches, exact gradients (lightning-het)",
        )

    # ------------------------------------------------------------------ launch / environment
    @override
    def _configure_launcher(self) -> None:
        # registered before the launcher's own exit handlers, so it runs after them (after the launching process has
        # waited for its replicas): no "terminate called without an active exception" at interpreter exit
        ExitCleanup.register()
        self._device_plan = configure_devices(self)  # device map -> parallel_devices, backend, threads
        if self._device_plan is not None:
            self._process_group_backend = self._device_plan.backend
        self._config.check_world(self.num_nodes, self.num_processes)  # before any worker starts
        super()._configure_launcher()
        if self._start_method != "popen":
            self._launcher = self._spawn_launcher_cls(self, start_method=self._start_method)
        elif self._trainer_loop:  # no orphans, end barrier, exit statuses 124/130, output dir check
            from lightning_het.reliability.lifecycle import (
                HeterogeneousScriptLauncher,  # (imports lightning: not at module import)
            )

            assert self.cluster_environment is not None
            self._launcher = HeterogeneousScriptLauncher.for_strategy(self)  # on the strategy's Lightning package
        if not getattr(self._launcher, "validates_launch_environment", False):  # one of Lightning's: check now
            validate_launch_environment(self.num_nodes, self.cluster_environment)

    @override
    def setup_environment(self) -> None:
        apply_local_settings(self)  # device map: this replica's intra-op threads
        super().setup_environment()
        if self._trainer_loop:  # the Trainer's loops (either package): watched from here on, setup hooks to teardown
            self._watchdog = start_watchdog(self, self._timeout, self._trainer())
        self._node_ids = detect_node_ids(self._config.node_ids, self.world_size, self.cluster_environment)

    def _trainer(self) -> pl.Trainer | None:
        return attached_trainer(getattr(self, "_lightning_module", None))

    def _mark(self, phase: Phase) -> None:
        """Tell the watchdog where this replica is (setup, profiling, ...)."""
        if self._watchdog is not None:
            self._watchdog.mark(phase)

    @override
    def setup_distributed(self) -> None:
        # mixed CPU/GPU job: no rank binds a device to the default group; a short `timeout` does not fail the
        # rendezvous of replicas that start slowly
        with unbound_process_group(self), self._startup_timeout_scope():
            self._init_process_group()

    def _init_process_group(self) -> None:
        """``DDPStrategy.setup_distributed`` on a store that only the job can reach: loopback for one node, the
        interface of ``MASTER_ADDR`` for several (see :mod:`lightning_het.cluster.rendezvous`)."""
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
            super().setup_distributed()  # torchrun's agent hosts the store
            return
        # also for the subgroups a later Trainer call adds to an existing group; unset again at teardown
        self._sockets_set += keep_sockets_local(self.num_nodes)
        if dist.is_initialized():
            super().setup_distributed()
            return
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()
        assert self.cluster_environment is not None
        init_process_group(
            self.cluster_environment,
            self._process_group_backend,
            rank=self.global_rank,
            world_size=self.world_size,
            num_nodes=self.num_nodes,
            timeout=self._timeout,
            device=self.root_device,
        )

    @property
    def comm_mode(self) -> str | None:
        """The communication mode running (``comm`` after ``"auto"`` and fallbacks are resolved)."""
        return None if self._comm_controller is None else self._comm_controller.mode

    @property
    def comm_reduction(self) -> str | None:
        """How exact steps reduce gradients under ``comm="hierarchical"``: ``"hierarchical"`` or ``"flat"`` (after
        the measured choice, see ``comm_autotune_steps``); ``None`` in other modes."""
        return None if self._comm_controller is None else self._comm_controller.reduction

    @property
    def comm_stats(self) -> dict[str, float]:
        """Bytes sent by this replica inside its node and to other nodes, in total and per optimizer step."""
        return {} if self._comm_controller is None else self._comm_controller.stats

    @override
    def _register_ddp_hooks(self) -> None:
        # Lightning registers comm hooks only on CUDA; ours (and a user's `ddp_comm_hook`) run on any device
        assert isinstance(self.model, DistributedDataParallel) and self._node_ids is not None
        mode = resolve_comm_mode(self._config.comm, self._node_ids)
        if self._ddp_comm_hook is not None:
            if mode != "allreduce":
                raise ValueError(
                    f"You passed `ddp_comm_hook`, but `comm` resolves to {mode!r}, which installs its own hook."
                    " HINT: use comm='allreduce' with a custom hook."
                )
            _register_ddp_comm_hook(
                model=self.model,
                ddp_comm_state=self._ddp_comm_state,
                ddp_comm_hook=self._ddp_comm_hook,
                ddp_comm_wrapper=self._ddp_comm_wrapper,
            )
        self._comm_controller = self._new_comm_controller(mode)
        self._comm_controller.register(self.model)

    def _new_comm_controller(self, mode: str) -> CommController:
        """This rank's communication controller for the resolved ``mode`` (a collective: call it on every rank)."""
        assert self._node_ids is not None
        return CommController(
            mode,  # type: ignore[arg-type]
            self._node_ids,
            self._allocation.batch_sizes,
            self.global_rank,
            global_sync_every=self._config.global_sync_every,
            warmup_steps=self._config.comm_warmup_steps,
            autotune_steps=self._config.comm_autotune_steps,
        )

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        controller = self._comm_controller
        if controller is not None and self._lightning_module is not None:
            trainer = self._lightning_module.trainer
            end_of_epoch = bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)
            with torch.no_grad():
                controller.after_optimizer_step(
                    self._lightning_module.parameters(), trainer.global_step + 1, end_of_epoch=end_of_epoch
                )
        return output

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self._comm_controller is not None and self._lightning_module is not None:
            # the node_local schedule (warm-up, every K) follows the global step, so resumed runs keep their phase
            self._comm_controller.set_step(self._lightning_module.trainer.global_step)

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        if self._comm_controller is not None and self._lightning_module is not None:
            with torch.no_grad():  # a fit stopped mid-epoch (max_steps) still ends on one consensus model
                self._comm_controller.synchronize(self._lightning_module.parameters())
            rank_zero_info(self._comm_controller.summary())

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        if self._comm_controller is not None and self._lightning_module is not None:
            with torch.no_grad():  # node_local: validation sees the consensus model
                self._comm_controller.synchronize(self._lightning_module.parameters())

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        """All-reduce ``tensor``; the mean of an integer tensor is computed in ``float64`` and returned as a float.

        Lightning's epoch-level ``self.log(..., sync_dist=True, batch_size=...)`` mean-reduces its integer
        batch-size accumulator; DDP's in-place division would truncate it (e.g. ``(10 + 31) / 2 -> 20``), and with
        uneven shares every epoch metric would be off. Here the count is summed in ``float64`` (exact) and divided by
        the world size, then returned in the default float dtype (``float32`` unless the default is ``float64``, as
        Lightning keeps logged values), so that the logged ``value / count`` has the logged value's dtype, as in DDP.
        """
        if isinstance(tensor, Tensor) and not (tensor.is_floating_point() or tensor.is_complex()):
            op = reduce_op.lower() if isinstance(reduce_op, str) else reduce_op
            if op in ("mean", "avg", ReduceOp.AVG):
                reduced = super().reduce(tensor.to(torch.float64), group=group, reduce_op=reduce_op)
                default = torch.get_default_dtype()
                return reduced.to(default if default in (torch.float32, torch.float64) else torch.float32)
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    @override
    def all_gather(self, tensor: Any, group: Any | None = None, sync_grads: bool = False) -> Any:
        """Gather a tensor (or every tensor of a nested collection) from all replicas, uneven batch shares included.

        Tensors of the same shape on every replica are stacked to ``[W, *shape]``, exactly as in DDP. Per-sample
        tensors whose first dimension differs between replicas (each replica's share of the batch) are concatenated
        in rank order to ``[sum of n_r, *rest]``: every sample once. Other mismatches raise ``ValueError`` naming
        every replica's shape, on every replica; so do collections whose structure differs between replicas. See
        :mod:`lightning_het.comm.gather`.
        """
        return all_gather_collection(tensor, group=group, sync_grads=sync_grads)

    @property
    def _train_min_batch_size(self) -> int:
        """Fewest training samples per replica and step: ``min_batch_size``, and 2 where batch norm trains per
        replica (one sample has no batch statistics)."""
        return max(self._config.min_batch_size, 2 if self._batchnorm_layers else 1)

    def _check_batchnorm(self) -> None:
        """Find batch norm layers that normalise per replica (no ``sync_batchnorm``) and warn once, naming them."""
        module = self._lightning_module
        self._batchnorm_layers = [
            name
            for name, layer in (module.named_modules() if module is not None else [])
            if isinstance(layer, _BatchNorm) and not isinstance(layer, torch.nn.SyncBatchNorm)
        ]
        if self._batchnorm_layers and self.world_size > 1:
            shown = ", ".join(self._batchnorm_layers[:5]) + (", ..." if len(self._batchnorm_layers) > 5 else "")
            rank_zero_warn(
                f"The model has {len(self._batchnorm_layers)} batch norm layer(s) ({shown}) that normalise each"
                " replica's batch separately: with uneven per-replica batches the gradient is no longer exactly the"
                " global-batch gradient, and every replica now gets at least 2 samples per step. HINT: pass"
                " `Trainer(sync_batchnorm=True)` for global batch statistics."
            )

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            self._allocation.reset()  # a new fit derives a new allocation
            self._loaders.train_sampler = None
            self._loaders.train_pass = None
            self._profiler = None
            attach_profiler(None, trainer)
        super().setup(trainer)
        record_loader_arguments(trainer)  # a DataLoader subclass's own arguments survive Lightning's copy
        self._check_batchnorm()  # after super(): `sync_batchnorm=True` has converted the layers by now
        attach_watchdog(self._watchdog, trainer)  # hung/dead replicas end the job
        config = self._config
        self._preemption = attach_preemption(self, trainer, config.preemption_grace, config.preemption_checkpoint)
        if trainer.state.fn == TrainerFn.FITTING:
            self._monitor = attach_monitor(
                self,
                trainer,
                monitor_settings(self._config, self.global_rank, self.world_size, self._train_min_batch_size),
                self._monitor,
            )

    @override
    def teardown(self) -> None:
        self._end_watch()
        detach_preemption(self._preemption, attached_trainer(self._lightning_module))
        self._preemption = None
        self._loaders.resume_record = None
        self._loaders.train_sampler = None
        ExitCleanup.clean = sys.exc_info()[0] is None  # Lightning tears down inside its `except` after a failure
        super().teardown()
        restore_job_environment(dict.fromkeys(self._sockets_set))  # GLOO/NCCL_SOCKET_IFNAME as before the call
        self._sockets_set = []

    def _end_watch(self) -> None:
        """Teardown: after an exception, stop the watchdog (the exception goes to the caller); after a normal run,
        keep it watching the end-of-run hooks until every replica has finished (the popen launcher waits for that)."""
        trainer = self._trainer()
        interrupted = trainer is not None and trainer.state.status == TrainerStatus.INTERRUPTED
        if interrupted or not getattr(self._launcher, "finishes_runs", False):
            stop_watchdog(self._watchdog, trainer, finished=not interrupted)
            self._watchdog = None
        else:
            self._mark(Phase.TEARDOWN)

    # ------------------------------------------------------------------ checkpoints (docs/reliability.md)
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        synchronize_before_save(self.comm_controller, self.lightning_module)  # node_local: save the consensus model
        return super().lightning_module_state_dict()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        speeds = None if self.profiling else self.speeds  # still profiling: none yet (a resumed run profiles again)
        record = checkpoint_record(
            self._trainer(), self.batch_sizes, speeds, self.node_ids, profiled=not self.speeds_given
        )
        checkpoint[CHECKPOINT_KEY] = record  # allocation + training sampler position
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        self._loaders.resume_record = read_record(checkpoint)  # used by the next training loader split
        return checkpoint

    # ------------------------------------------------------------------ data
    @override
    def process_dataloader(self, dataloader: object) -> object:
        # workers ignore SIGTERM/SIGUSR1 so that they do not die before their replica saves (docs/preemption.md)
        return shield_loader_workers(self._process_dataloader(dataloader), self.global_rank)

    def _process_dataloader(self, dataloader: object) -> object:
        if not isinstance(dataloader, DataLoader):
            return dataloader
        trainer = self.lightning_module.trainer
        return self._loaders.process(dataloader, trainer, self._training_split(), self._eval_weights())

    def _training_split(self) -> TrainingSplit:
        """What the loader splitter needs to split a training loader: this replica and the allocation's callables."""
        return TrainingSplit(
            rank=self.global_rank,
            world_size=self.world_size,
            min_batch_size=self._train_min_batch_size,
            given_global_batch=self._config.global_batch_size,
            given_speeds=self._config.speeds,
            batch_sizes=lambda: self._allocation.batch_sizes,
            allocate=lambda loader, global_batch, order: self._allocate(
                loader, global_batch, order.shuffle, order.seed, order.sampler
            ),
            adopt=self.adopt_allocation,
            profiler=lambda: self._profiler if self.profiling else None,
        )

    def _eval_weights(self) -> list[float]:
        return eval_weights(self._allocation.batch_sizes, self._config.speeds, self.world_size)

    # ------------------------------------------------------------------ allocation
    def _allocate(
        self, dataloader: DataLoader, global_batch: int, shuffle: bool, seed: int, order_sampler: Any = None
    ) -> None:
        world = self.world_size
        bounds = self._batch_bounds
        allocate_batch_sizes(global_batch, [1.0] * world, **bounds)  # validates the bounds before any profiling
        resume = plan_allocation(self._loaders.resume_record, world_size=world, given_speeds=self._config.speeds)
        costs = None
        if resume.speeds is not None or self._config.speeds is not None:
            # given (or resumed) speeds: the one-number model, proportional split
            speeds = list(resume.speeds if resume.speeds is not None else self._config.speeds)  # type: ignore[arg-type]
        else:
            costs = self._measured_costs(dataloader, global_batch, shuffle, seed, order_sampler)
            speeds = [1.0] * world  # profiled on the first training steps (or one replica): the equal split till then
        self._allocation.cost_model = costs
        batch_sizes, speeds = split_global_batch(global_batch, speeds, costs, bounds)
        if costs is not None:
            warn_useless_replicas(global_batch, costs, batch_sizes, device_labels(self), bounds)
        self.adopt_allocation(batch_sizes, speeds)
        log_resumed_allocation(resume, self._loaders.resume_record, batch_sizes)  # re-balanced or reused on resume
        if self._profiler is None:
            rank_zero_info(self.balance_table())
        else:
            rank_zero_info(
                f"HeterogeneousStrategy: profiling on the first {self._profiler.plan.gather_step + 1} training steps"
                f" (trial splits); the fitted split applies from step {self._profiler.plan.switch_step}"
            )

    @property
    def _batch_bounds(self) -> dict[str, Any]:
        return batch_bounds(self._train_min_batch_size, self._config.max_batch_sizes)

    def _measured_costs(
        self, dataloader: DataLoader, global_batch: int, shuffle: bool, seed: int, order_sampler: Any = None
    ) -> list[AffineCost] | None:
        """Every replica's cost from the speed cache when every replica has an entry; else ``None``, and with more
        than one replica the first training steps profile (:mod:`lightning_het.balance.profiler`)."""
        self._allocation.profile_seconds = 0.0
        self._allocation.profile_cached = False
        if self.world_size == 1:
            return None
        costs = self._cached_costs(dataloader)
        if costs is None:
            monitor = self._monitor

            def clock() -> tuple[int, float] | None:
                return monitor.clock.open_step() if monitor is not None and monitor.clock is not None else None

            self._profiler = start_profiler(
                dataloader,
                global_batch,
                self._config,
                self._batch_bounds,
                rank=self.global_rank,
                world_size=self.world_size,
                device=self.root_device,
                clock=clock,
                on_agreed=self._adopt_profiled,
                trainer=self._trainer(),
            )
        return costs

    def _cached_costs(self, dataloader: DataLoader) -> list[AffineCost] | None:
        """The costs of every replica from the speed cache (``profile_cache``) when every replica has an entry (one
        all-gather when the cache is on), else ``None``."""
        module, precision = self._profiled_module()
        factors = self._config.emulate_slowdown
        self._cache_entry = profile_cache_entry(  # where the profiled cost goes
            self._config.profile_cache,
            module,
            dataloader,
            precision=precision,
            device=self.root_device,
            slowdown=factors[self.global_rank] if factors else 1.0,
            replicas_on_node=self.num_processes,
        )
        costs = cached_costs(*self._cache_entry, self._all_gather_floats)
        if costs is not None:
            self._allocation.profile_cached = True
        return costs

    def _adopt_profiled(self, costs: list[AffineCost], batch_sizes: list[int]) -> None:
        """The profiler agreed on the costs (every rank, at the same step): the fitted split applies to the global
        batches not drawn yet."""
        self._allocation.cost_model = costs
        speeds = measured_speeds(batch_sizes, costs)
        warn_useless_replicas(sum(batch_sizes), costs, batch_sizes, device_labels(self), self._batch_bounds)
        self.adopt_allocation(batch_sizes, speeds)
        assert self._profiler is not None
        for sampler in self._profiler.samplers:  # every training loader's batches not drawn yet
            total = sampler.global_batch_size
            floor = self._train_min_batch_size
            sampler.set_batch_sizes(
                batch_sizes if total == sum(batch_sizes) else allocate_batch_sizes(total, speeds, min_batch_size=floor)
            )
        self._allocation.profile_seconds = self._profiler.overhead_s
        cache, key = self._cache_entry
        if cache is not None and key is not None:
            cache.put(key, costs[self.global_rank])
        rank_zero_info(self.balance_table())

    @property
    def profiling(self) -> bool:
        """Whether the first training steps are still profiling (trial splits, costs not agreed yet)."""
        return self._profiler is not None and not self._profiler.done

    def adopt_allocation(
        self, batch_sizes: list[int], speeds: list[float], costs: list[dict[str, float]] | None = None
    ) -> None:
        """Make ``batch_sizes`` (one per global rank) the allocation: batch sizes, speeds, global batch, loss scale and
        the comm controller's sample shares change together, on this replica.

        Every replica must call it with the same arguments (the allocation and rebalancing code do, from gathered
        values); the training loader must then be rebuilt before the next step (``process_dataloader``).

        Args:
            batch_sizes: samples per step of every replica (``>= 0`` each, summing to the global batch).
            speeds: relative throughput of every replica (samples/s when measured).
            costs: a refreshed affine cost per replica (``AffineCost.as_dict()`` form), or ``None`` to keep the model.
        """
        self._allocation.adopt(batch_sizes, speeds, self.global_rank, costs)
        if self._comm_controller is not None:
            self._comm_controller.set_batch_sizes(self._allocation.batch_sizes)
            self._comm_sizes = list(self._allocation.batch_sizes)

    def _all_gather_floats(self, values: list[float]) -> list[list[float]]:
        gathered = torch.tensor(values, dtype=torch.float64, device=self.root_device)
        everyone = [torch.zeros_like(gathered) for _ in range(self.world_size)]
        dist.all_gather(everyone, gathered)
        return [t.tolist() for t in everyone]

    def _profiled_module(self) -> tuple[torch.nn.Module | None, str]:
        """The module whose steps are profiled (``None`` before there is one) and the precision's name: what the
        speed cache keys on besides the device and the data."""
        return getattr(self, "_lightning_module", None), type(self.precision_plugin).__name__

    def export_allocation(self) -> dict[str, Any]:
        """The allocation, costs and telemetry as plain data: what a spawned worker sends back to the parent."""
        telemetry = telemetry_section(self._monitor, self._allocation.telemetry_snapshot, include_series=True)
        return self._allocation.export(self._node_ids, telemetry)

    def import_allocation(self, state: dict[str, Any]) -> None:
        """Adopt what :meth:`export_allocation` returned in a worker (in the parent process, after spawn)."""
        self._allocation.import_(state, self.global_rank)
        self._node_ids = state.get("node_ids")

    # ------------------------------------------------------------------ reporting
    def balance_report(self, include_series: bool = False) -> dict[str, Any]:
        """The allocation as plain data (for ``metrics.json`` and loggers).

        With telemetry on, ``"telemetry"`` holds the per-epoch, per-replica figures of the last ``fit``
        (``epochs``: compute / wait / step seconds, samples/s, imbalance; ``rebalances`` and ``checks``), and, with
        ``include_series=True``, the step-by-step ``series`` behind the balance plot. ``"profile_seconds"`` is the
        time this replica spent profiling.
        """
        allocation = self._allocation
        return allocation.report(
            node_ids=self._node_ids,
            profiled=self._config.speeds is None,
            emulate_slowdown=self._config.emulate_slowdown,
            devices=device_labels(self),
            telemetry=telemetry_section(self._monitor, allocation.telemetry_snapshot, include_series=include_series),
        )

    def balance_table(self) -> str:
        """A human-readable table: rank, node, device, speed, batch size, share."""
        return render_balance_table(self.balance_report())

    # ------------------------------------------------------------------ training hooks
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        sizes = self._step_batch_sizes()
        if self._comm_controller is not None and sizes and sizes != self._comm_sizes:
            self._comm_controller.set_batch_sizes(sizes)  # the split of this step (trial, tail or allocation)
            self._comm_sizes = sizes
        clock = self._monitor.clock if self._monitor is not None else None  # telemetry / emulation
        if clock is None:
            return super().training_step(*args, **kwargs)
        clock.step_start(sizes[self.global_rank] if sizes else 0)
        output = super().training_step(*args, **kwargs)
        clock.forward_end()  # sleeps (f - 1) x the forward time under emulate_slowdown
        return output

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        clock = self._monitor.clock if self._monitor is not None else None
        if clock is not None:
            clock.before_backward(closure_loss)  # end of local backward compute vs gradient-sync wait
        scale = self._step_loss_scale()
        super().backward(closure_loss * scale if scale != 1.0 else closure_loss, optimizer, *args, **kwargs)
        if clock is not None:
            clock.after_backward()
        return closure_loss

    def _step_batch_sizes(self) -> list[int]:
        """Per-replica samples of the global batch being trained now (see :meth:`Allocation.step_batch_sizes`)."""

        def batch_idx() -> int | None:
            trainer = attached_trainer(self._lightning_module)
            return None if trainer is None else trainer.fit_loop.epoch_loop.batch_idx  # 0-based step within the epoch

        return self._allocation.step_batch_sizes(self._loaders.train_sampler, batch_idx)

    def _step_loss_scale(self) -> float:
        """``W * b_r / B`` for the global batch being trained now (the tail batch has its own)."""
        return self._allocation.step_loss_scale(self._step_batch_sizes(), self.global_rank)


class HeterogeneousStrategy(HeterogeneousStrategyBase, DDPStrategy):
    __doc__ = HeterogeneousStrategyBase.__doc__
    _trainer_loop = True
