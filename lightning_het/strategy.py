"""``HeterogeneousStrategy``: DDP with per-replica batch sizes proportional to speed and exact gradients."""

from __future__ import annotations

import atexit
import inspect
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.data import has_iterable_dataset
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.distributed import ReduceOp
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler
from typing_extensions import override

from lightning_het._compat import (
    _BatchNorm,
    _init_dist_connection,
    _MultiProcessingLauncher,
    _register_ddp_comm_hook,
    attached_trainer,
    cached_validation_loader,
    forget_validation_loader,
    record_loader_arguments,
    uses_distributed_sampler,
)
from lightning_het.arguments import check_ddp_keywords, validate_strategy_arguments
from lightning_het.balance.allocation import allocate_batch_sizes, loss_scale, sample_shares
from lightning_het.balance.cost import AffineCost, allocate_affine, step_time, useless_replica_message
from lightning_het.balance.profiler import InLoopProfiler, attach_profiler, loader_prefetch_depth, profile_plan
from lightning_het.balance.profiling import ProfileCache, cache_key
from lightning_het.balance.telemetry import BalanceMonitor, MonitorSettings, attach_monitor, telemetry_section
from lightning_het.cluster.accelerators import (
    apply_local_settings,
    configure_devices,
    device_labels,
    mixed_accelerator_kwargs,
    unbound_process_group,
)
from lightning_het.cluster.devices import DeviceMapArg, DevicePlan
from lightning_het.cluster.rendezvous import create_store, keep_sockets_local, restore_job_environment
from lightning_het.cluster.topology import gather_node_ids, validate_node_ids
from lightning_het.comm.controller import CommController, resolve_comm_mode, validate_comm_args
from lightning_het.comm.gather import all_gather_collection
from lightning_het.comm.modes import CommChoice
from lightning_het.data.loaders import (
    as_batch_size,
    batch_sampler_error,
    loader_batch_size,
    lost_batch_sampler,
    rebuild_loader,
    rebuild_with_batch_sampler,
    training_order,
)
from lightning_het.data.sampler import (
    EvalBatchSampler,
    ProportionalBatchSampler,
    ProportionalDistributedSampler,
    eval_batch_plan,
)
from lightning_het.reliability.checkpointing import (
    CHECKPOINT_KEY,
    apply_sampler_resume,
    checkpoint_record,
    log_resumed_allocation,
    plan_allocation,
    read_record,
    resumed_global_batch_size,
    synchronize_before_save,
)
from lightning_het.reliability.loader_workers import shield_loader_workers
from lightning_het.reliability.preemption import (
    DEFAULT_GRACE,
    PreemptionHandler,
    attach_preemption,
    detach_preemption,
)
from lightning_het.reliability.supervision import (
    apply_collective_timeout,
    attach_watchdog,
    rendezvous_timeout,
    start_watchdog,
    stop_watchdog,
    validate_launch_environment,
)
from lightning_het.reliability.verdicts import Phase
from lightning_het.reliability.watchdog import Watchdog

__all__ = ["HeterogeneousStrategy"]

log = logging.getLogger(__name__)

_EVAL_STAGES = (RunningStage.VALIDATING, RunningStage.TESTING, RunningStage.SANITY_CHECKING)


_WORKER_DRAIN_S = 0.1  # seconds the interpreter stays whole (GIL released) for the backend's threads at exit


class _ExitCleanup:
    """Destroys the default process group when the process exits, if the last fit/evaluation ended normally.

    Lightning never destroys the process group (a script may fit again). Left alive until interpreter shutdown, torch
    tears the group, its Gloo threads and the rendezvous store down during finalisation, in no particular order; a
    thread object destroyed while still joinable then aborts the process ("terminate called without an active
    exception", exit status -6) after a successful run. Destroying the group from an ``atexit`` handler, while the
    interpreter is still whole, joins those threads in order. After a failed run the group may hold a collective that
    never completes, so it is left alone (the watchdog ends such processes).
    """

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


class AllocationResultsMixin:
    """Spawn/fork launcher mixin that also sends the allocation back to the parent process, and checks a multi-node
    job's rendezvous variables before it starts the workers."""

    #: multi-node rendezvous variables are checked at launch, not at Trainer construction
    validates_launch_environment = True

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        strategy = self._strategy  # type: ignore[attr-defined]
        validate_launch_environment(strategy.num_nodes, strategy.cluster_environment)
        return super().launch(function, *args, trainer=trainer, **kwargs)  # type: ignore[misc]

    def get_extra_results(self, trainer: Any) -> dict[str, Any]:
        extra = super().get_extra_results(trainer)  # type: ignore[misc]
        strategy = trainer.strategy
        if isinstance(strategy, HeterogeneousStrategyBase):
            extra["lightning_het"] = strategy._export_allocation()
        return extra

    def update_main_process_results(self, trainer: Any, extra: dict[str, Any]) -> None:
        super().update_main_process_results(trainer, extra)  # type: ignore[misc]
        strategy = trainer.strategy
        if isinstance(strategy, HeterogeneousStrategyBase) and extra.get("lightning_het"):
            strategy._import_allocation(extra["lightning_het"])


class _HeterogeneousMultiProcessingLauncher(AllocationResultsMixin, _MultiProcessingLauncher):
    pass


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
            before the gradients are synchronised (see :class:`~lightning_het.balance.telemetry.StepClock`).
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
            :mod:`lightning_het.balance.telemetry`.
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
    _spawn_launcher_cls: type = _HeterogeneousMultiProcessingLauncher
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
        # every value check of our keywords, the same function the app's config schema calls
        args = validate_strategy_arguments(
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
        if args["timeout"] is not None:
            kwargs["timeout"] = args["timeout"]  # seconds or timedelta (#7)
        self._startup_timeout = args["startup_timeout"]
        self._watchdog = None  # hung/dead-replica watchdog, running between setup and teardown (#7)
        self._resume_record: dict[str, Any] | None = None  # checkpoint["lightning_het"] of the fit being resumed (#7)
        # SIGTERM/SIGUSR1: agree at a step boundary, save, exit 143 (docs/preemption.md)
        self._preemption_grace = args["preemption_grace"]
        self._preemption_checkpoint = args["preemption_checkpoint"]  # a path, None (default) or False (no save)
        self._preemption: PreemptionHandler | None = None
        kwargs = mixed_accelerator_kwargs(type(self), device_map, cpu_threads, kwargs)  # MixedAccelerator (#8)
        super().__init__(**kwargs)
        self._device_plan: DevicePlan | None = None  # resolved from the device map at Trainer construction
        self._global_batch_size_arg = args["global_batch_size"]
        self._speeds_arg = args["speeds"]
        self._min_batch_size = args["min_batch_size"]
        self._max_batch_sizes = args["max_batch_sizes"]
        self._node_ids_arg = args["node_ids"]
        self._comm = comm
        self._global_sync_every = global_sync_every
        self._comm_warmup_steps = comm_warmup_steps
        self._comm_autotune_steps = args["comm_autotune_steps"]
        self._comm_controller: CommController | None = None  # built per process when DDP wraps the model
        self._emulate_slowdown = args["emulate_slowdown"]
        self._profile_steps = args["profile_steps"]
        self._profile_warmup = args["profile_warmup"]
        # set once the allocation is known (in the worker processes, and in the parent after spawn)
        self._batch_sizes: list[int] | None = None
        self._speeds: list[float] | None = None
        self._node_ids: list[int] | None = None
        self._global_batch_size: int | None = None
        self._loss_scale = 1.0
        self._profile_cache_arg = profile_cache
        self._profile_cached = False  # the last allocation's costs came from the cache
        self._profiler: InLoopProfiler | None = None  # the fit's in-loop profiling (balance/profiler.py)
        self._comm_sizes: list[int] | None = None  # the split the comm controller was last given
        self._cache_entry: tuple[ProfileCache | None, str | None] = (None, None)  # this replica's speed cache key
        self._cost_model: list[AffineCost] | None = None  # per-replica costs behind the last profiled allocation
        self._profile_seconds = 0.0
        self._eval_weights_used: list[float] | None = None
        self._train_sampler: ProportionalDistributedSampler | None = None  # the fit's training sampler (tail step)
        #: (the loader set-up of this fit it belongs to, the global batch of its first training loader)
        self._train_pass: tuple[Any, int] | None = None
        self._batchnorm_layers: list[str] = []  # per-replica batch norm layers found at setup
        # telemetry and semi-dynamic rebalancing (#6); the monitor is built per process in `setup`
        self._rebalance_every_n_epochs = args["rebalance_every_n_epochs"]
        self._rebalance_threshold = args["rebalance_threshold"]
        self._telemetry = telemetry
        self._monitor: BalanceMonitor | None = None
        self._telemetry_snapshot: dict[str, Any] | None = None  # the workers' telemetry, in the parent after spawn
        self._own_sharding_warned = False  # `use_distributed_sampler=False` warned about (once)
        self._sockets_set: list[str] = []  # socket variables this Trainer call set in os.environ (unset at teardown)

    # ------------------------------------------------------------------ public state
    @property
    def batch_sizes(self) -> list[int] | None:
        """Samples per step of every replica, indexed by global rank (``None`` before the allocation)."""
        return None if self._batch_sizes is None else list(self._batch_sizes)

    @property
    def local_batch_size(self) -> int | None:
        """Samples per step on this replica."""
        return None if self._batch_sizes is None else self._batch_sizes[self.global_rank]

    @property
    def global_batch_size(self) -> int | None:
        return self._global_batch_size

    @property
    def speeds(self) -> list[float] | None:
        """Relative throughput (samples/s when profiled) of every replica, indexed by global rank."""
        return None if self._speeds is None else list(self._speeds)

    @property
    def speeds_given(self) -> bool:
        """Whether the user gave ``speeds`` (``False``: they are, or will be, profiled)."""
        return self._speeds_arg is not None

    @property
    def node_ids(self) -> list[int] | None:
        return None if self._node_ids is None else list(self._node_ids)

    @property
    def loss_scale(self) -> float:
        """Factor ``W * b_r / B`` applied to this replica's loss before backward."""
        return self._loss_scale

    @property
    def cost_model(self) -> list[AffineCost] | None:
        """Every replica's fitted cost ``t_r(b) = fixed_s + per_sample_s * b`` (seconds), indexed by global rank;
        ``None`` when the speeds were given rather than profiled."""
        return None if self._cost_model is None else list(self._cost_model)

    @property
    def profile_seconds(self) -> float:
        """Wall-clock seconds this replica spent profiling."""
        return self._profile_seconds

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

    @contextmanager
    def _startup_timeout_scope(self) -> Iterator[None]:
        """Around the rendezvous: the strategy's timeout becomes ``startup_timeout`` when that is longer (see
        :func:`~lightning_het.reliability.watchdog.rendezvous_timeout`); afterwards ``timeout`` is restored, on the
        strategy and on the default process group's collectives and store. The only place that changes the
        strategy's timeout."""
        timeout = self._timeout
        startup = rendezvous_timeout(timeout, self._startup_timeout)
        if startup is None:
            yield
            return
        self._timeout = startup
        try:
            yield
        finally:
            self._timeout = timeout
        apply_collective_timeout(timeout)

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
    @property
    def _world(self) -> int:
        return self.num_nodes * self.num_processes

    def _validate_against_world(self) -> None:
        """Checks that need only the world size; run at Trainer construction, before any worker starts."""
        world = self._world
        if world < 1:
            return
        for name, values in (
            ("speeds", self._speeds_arg),
            ("max_batch_sizes", self._max_batch_sizes),
            ("node_ids", self._node_ids_arg),
            ("emulate_slowdown", self._emulate_slowdown),
        ):
            if values is not None and len(values) != world:
                raise ValueError(
                    f"You set `{name}` with {len(values)} entries ({list(values)}), but the job has {world} replicas"
                    f" (num_nodes={self.num_nodes} x devices={self.num_processes}). HINT: give one entry per global"
                    " rank."
                )
        if self._global_batch_size_arg is not None:
            # raises ValueError naming global_batch_size / max_batch_sizes when the bounds cannot hold it
            allocate_batch_sizes(
                self._global_batch_size_arg,
                self._speeds_arg or [1.0] * world,
                min_batch_size=self._min_batch_size,
                max_batch_sizes=self._max_batch_sizes,
            )

    @override
    def _configure_launcher(self) -> None:
        # registered before the launcher's own exit handlers, so it runs after them (after the launching process has
        # waited for its replicas): no "terminate called without an active exception" at interpreter exit
        _ExitCleanup.register()
        self._device_plan = configure_devices(self)  # device map -> parallel_devices, backend, threads (#8)
        if self._device_plan is not None:
            self._process_group_backend = self._device_plan.backend
        self._validate_against_world()
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
        apply_local_settings(self)  # device map: this replica's intra-op threads (#8)
        super().setup_environment()
        if self._trainer_loop:  # the Trainer's loops (either package): watched from here on, setup hooks to teardown
            self._watchdog = start_watchdog(self, self._timeout, self._trainer())
        self._node_ids = self._detect_node_ids()

    def _trainer(self) -> pl.Trainer | None:
        return attached_trainer(getattr(self, "_lightning_module", None))

    def _mark(self, phase: Phase) -> None:
        """Tell the watchdog where this replica is (setup, profiling, ...)."""
        if self._watchdog is not None:
            self._watchdog.mark(phase)

    @override
    def setup_distributed(self) -> None:
        # mixed CPU/GPU job: no rank binds a device to the default group (#8); a short `timeout` does not fail the
        # rendezvous of replicas that start slowly (#7)
        with unbound_process_group(self), self._startup_timeout_scope():
            self._init_process_group()

    def _init_process_group(self) -> None:
        """``DDPStrategy.setup_distributed`` on a store that only the job can reach (#14): loopback for one node, the
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
        env = self.cluster_environment
        timeout = self._timeout if self._timeout is not None else timedelta(minutes=30)
        store = create_store(
            master_addr=env.main_address,
            port=env.main_port,
            rank=self.global_rank,
            world_size=self.world_size,
            num_nodes=self.num_nodes,
            timeout=timeout,
        )
        kwargs: dict[str, Any] = {"timeout": self._timeout, "store": store}
        kwargs["device_id"] = self.root_device if self.root_device.type != "cpu" else None
        try:
            _init_dist_connection(env, self._process_group_backend, **kwargs)
        except (dist.DistError, RuntimeError) as err:  # a replica never joined (hung or died while starting)
            raise _rendezvous_failed(err, timeout, self.global_rank, self.world_size) from err

    def _detect_node_ids(self) -> list[int]:
        """The user's ``node_ids``, else one all-gather of (node rank, host name) over the job (#3)."""
        if self._node_ids_arg is not None:
            return validate_node_ids(self._node_ids_arg, self.world_size)
        assert self.cluster_environment is not None
        return gather_node_ids(self.cluster_environment)

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
        """Bytes sent by this replica inside its node and to other nodes, in total and per optimizer step (#3)."""
        return {} if self._comm_controller is None else self._comm_controller.stats

    @override
    def _register_ddp_hooks(self) -> None:
        # Lightning registers comm hooks only on CUDA; ours (and a user's `ddp_comm_hook`) run on any device (#3)
        assert isinstance(self.model, DistributedDataParallel) and self._node_ids is not None
        mode = resolve_comm_mode(self._comm, self._node_ids)
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
            self._batch_sizes,
            self.global_rank,
            global_sync_every=self._global_sync_every,
            warmup_steps=self._comm_warmup_steps,
            autotune_steps=self._comm_autotune_steps,
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
        return max(self._min_batch_size, 2 if self._batchnorm_layers else 1)

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
            self._batch_sizes = None  # a new fit derives a new allocation
            self._loss_scale = 1.0  # until then (and for good with a loader we leave alone): plain DDP
            self._train_sampler = None
            self._train_pass = None
            self._profiler = None
            attach_profiler(None, trainer)
        super().setup(trainer)
        record_loader_arguments(trainer)  # a DataLoader subclass's own arguments survive Lightning's copy
        self._check_batchnorm()  # after super(): `sync_batchnorm=True` has converted the layers by now
        attach_watchdog(self._watchdog, trainer)  # hung/dead replicas end the job (#7, #14)
        self._preemption = attach_preemption(self, trainer, self._preemption_grace, self._preemption_checkpoint)
        if trainer.state.fn == TrainerFn.FITTING:
            self._monitor = attach_monitor(self, trainer, self._monitor_settings(), self._monitor)  # (#6)

    @override
    def teardown(self) -> None:
        self._end_watch()  # (#7, #14)
        detach_preemption(self._preemption, attached_trainer(self._lightning_module))
        self._preemption = None
        self._resume_record = None
        self._train_sampler = None
        _ExitCleanup.clean = sys.exc_info()[0] is None  # Lightning tears down inside its `except` after a failure
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

    # ------------------------------------------------------------------ checkpoints (#7, docs/reliability.md)
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        synchronize_before_save(self)  # comm="node_local": a checkpoint holds the consensus model
        return super().lightning_module_state_dict()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        checkpoint[CHECKPOINT_KEY] = checkpoint_record(self)  # allocation + training sampler position
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        self._resume_record = read_record(checkpoint)  # used by the next training loader split
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
        stage = trainer.state.stage
        if has_iterable_dataset(dataloader):
            if stage == RunningStage.TRAINING:
                rank_zero_warn(
                    "The training DataLoader wraps an IterableDataset, which HeterogeneousStrategy cannot re-split:"
                    " every replica reads it as in plain DDP, with equal weights and no load balancing. HINT: use a"
                    " map-style Dataset for speed-proportional batches and exact gradients."
                )
            return dataloader
        if stage in (RunningStage.TRAINING, *_EVAL_STAGES) and _read_as_given(dataloader, trainer):
            self._warn_own_sharding()  # plain DDP behaviour for this loader
            return dataloader
        if stage == RunningStage.TRAINING:
            return self._split_training_loader(dataloader, trainer)
        if stage in _EVAL_STAGES:
            return self._split_eval_loader(dataloader)
        return dataloader

    def _warn_own_sharding(self) -> None:
        if self._own_sharding_warned:
            return
        self._own_sharding_warned = True
        rank_zero_warn(
            "HeterogeneousStrategy: `Trainer(use_distributed_sampler=False)`: every replica reads its DataLoaders"
            " whole, as given (shard inside the Dataset), and the strategy falls back to plain DDP behaviour for them:"
            " no speed-proportional batches, equal weights in the gradient mean (exact when the replicas' batches are"
            " equal). HINT: leave `use_distributed_sampler` at True for load balancing."
        )

    def _resolve_global_batch_size(self, dataloader: DataLoader, trainer: pl.Trainer) -> int:
        if self._global_batch_size_arg is not None:
            return self._global_batch_size_arg
        datamodule_value = getattr(trainer.datamodule, "global_batch_size", None) if trainer.datamodule else None
        if as_batch_size(datamodule_value) is not None:  # int or NumPy integer
            return int(as_batch_size(datamodule_value))  # type: ignore[arg-type]
        saved = resumed_global_batch_size(self._resume_record)
        if saved is not None:  # resuming: the checkpoint's global batch, whatever the number of replicas now
            per_replica = loader_batch_size(dataloader)
            if per_replica is not None and per_replica * self.world_size != saved:
                rank_zero_info(
                    f"HeterogeneousStrategy: resuming with the checkpoint's global batch of {saved} samples (not the"
                    f" DataLoader's batch_size {per_replica} x {self.world_size} replicas); pass `global_batch_size`"
                    " to change it"
                )
            return saved
        per_replica = loader_batch_size(dataloader)
        if per_replica is None:
            raise ValueError(
                "The training DataLoader has no `batch_size` (built with `batch_size=None`), so the global batch cannot"
                " be inferred. HINT: pass `HeterogeneousStrategy(global_batch_size=...)`, or give the DataLoader a"
                " `batch_size`."
            )
        return per_replica * self.world_size

    def _split_training_loader(self, dataloader: DataLoader, trainer: pl.Trainer) -> DataLoader:
        if isinstance(dataloader.sampler, ProportionalDistributedSampler):
            sampler = dataloader.sampler
            if self._batch_sizes is None:
                self.adopt_allocation(
                    list(sampler.batch_sizes), self._speeds_arg or list(map(float, sampler.batch_sizes))
                )
            elif list(sampler.batch_sizes) != self._batch_sizes:
                raise ValueError(
                    f"The training DataLoader's ProportionalDistributedSampler has batch_sizes={sampler.batch_sizes},"
                    f" but the strategy allocated {self._batch_sizes}. HINT: build it from `strategy.batch_sizes`."
                )
            apply_sampler_resume(sampler, self._resume_record, trainer.fit_loop.epoch_progress.current.processed)
            self._resume_record = None
            self._train_sampler = sampler
            return dataloader
        if lost_batch_sampler(dataloader):  # `batch_sampler=` that Lightning's sampler injection dropped
            raise batch_sampler_error("given as `batch_sampler=`")
        order = training_order(dataloader)
        dataset = dataloader.dataset
        global_batch = self._resolve_global_batch_size(dataloader, trainer)
        length = len(order.sampler) if order.sampler is not None else len(dataset)
        if length < global_batch:
            raise ValueError(
                f"The training dataset holds {length} samples, fewer than one global batch of {global_batch}"
                f" (global_batch_size={global_batch}, {self.world_size} replicas): no step could run. HINT: lower"
                " `global_batch_size` or use more data."
            )
        pass_key = (id(trainer), trainer.fit_loop.epoch_progress.current.processed, trainer.global_step)
        if self._train_pass is not None and self._train_pass[0] == pass_key and self._train_pass[1] != global_batch:
            return self._split_other_training_loader(dataloader, order, global_batch)
        if self._batch_sizes is None or sum(self._batch_sizes) != global_batch:
            self._allocate(dataloader, global_batch, order.shuffle, order.seed, order.sampler)
        assert self._batch_sizes is not None
        self._train_pass = (pass_key, global_batch)
        sampler = ProportionalDistributedSampler(
            dataset,
            self._batch_sizes,
            self.global_rank,
            shuffle=order.shuffle,
            seed=order.seed,
            drop_last=order.drop_last,
            min_batch_size=self._train_min_batch_size,
            order_sampler=order.sampler,
        )
        if sampler.dropped_per_epoch and not order.drop_last:
            rank_zero_warn(
                f"HeterogeneousStrategy: the last {sampler.dropped_per_epoch} training sample(s) of each epoch are too"
                f" few for a last global batch over {self.world_size} replicas (at least"
                f" {self._train_min_batch_size} each) and are not trained. HINT: choose `global_batch_size` so that"
                " the remainder of the dataset size is 0 or at least that many."
            )
        # epoch (and, when resuming, the global batches already trained on) before Lightning's first iterator (#7)
        apply_sampler_resume(sampler, self._resume_record, trainer.fit_loop.epoch_progress.current.processed)
        self._resume_record = None
        self._train_sampler = sampler
        self._reset_cached_eval_loaders(trainer)
        if self.profiling:  # the first steps' splits follow the profiler's plan: batches cut one at a time
            assert self._profiler is not None
            self._profiler.bind(sampler)
            return rebuild_loader(
                dataloader,
                sampler,
                self._batch_sizes[self.global_rank],
                batch_sampler=ProportionalBatchSampler(sampler),
            )
        return rebuild_loader(dataloader, sampler, self._batch_sizes[self.global_rank])

    def _split_other_training_loader(self, dataloader: DataLoader, order: Any, global_batch: int) -> DataLoader:
        """A further training loader of the same fit (Lightning combines a dict or list of them) whose global batch
        differs from the first's: split in proportion to the same speeds (during profiling, to each step's trial
        split). The first loader keeps the allocation, the loss scale and the checkpointed position."""
        assert self._batch_sizes is not None
        sizes = allocate_batch_sizes(global_batch, self._batch_sizes, min_batch_size=self._train_min_batch_size)
        sampler = ProportionalDistributedSampler(
            dataloader.dataset,
            sizes,
            self.global_rank,
            shuffle=order.shuffle,
            seed=order.seed,
            drop_last=order.drop_last,
            min_batch_size=self._train_min_batch_size,
            order_sampler=order.sampler,
        )
        sampler.set_epoch(self._train_sampler.epoch if self._train_sampler is not None else 0)
        if not self.profiling:
            return rebuild_loader(dataloader, sampler, sizes[self.global_rank])
        assert self._profiler is not None
        self._profiler.bind(sampler)
        batches = ProportionalBatchSampler(sampler)
        return rebuild_loader(dataloader, sampler, sizes[self.global_rank], batch_sampler=batches)

    def _split_eval_loader(self, dataloader: DataLoader) -> DataLoader:
        """Every replica runs the same number of evaluation batches, sized in proportion to its share
        (:class:`~lightning_het.data.sampler.EvalBatchSampler`); each sample is evaluated once."""
        if isinstance(dataloader.sampler, DistributedSampler) and type(dataloader.sampler) is not DistributedSampler:
            return dataloader  # the user's own distributed sampler
        if type(dataloader.batch_sampler) is not BatchSampler:
            return dataloader
        weights = self._eval_weights()
        self._eval_weights_used = weights
        batch_size = dataloader.batch_size or 1
        batches = EvalBatchSampler(dataloader.dataset, weights, self.global_rank, batch_size)
        if batches.repeats > 1:
            rank_zero_warn(
                f"HeterogeneousStrategy: the evaluation set holds {len(dataloader.dataset)} sample(s), fewer than the"
                f" {self.world_size} replicas; every replica needs one, so the set is evaluated {batches.repeats}"
                " times over (each sample equally often): means and accuracies are exact, summed values are"
                f" {batches.repeats} times larger. HINT: evaluate at least one sample per replica."
            )
        return rebuild_with_batch_sampler(dataloader, batches)

    def _eval_weights(self) -> list[float]:
        if self._batch_sizes is not None:
            return [float(b) for b in self._batch_sizes]
        if self._speeds_arg is not None:
            return list(self._speeds_arg)
        return [1.0] * self.world_size

    def _reset_cached_eval_loaders(self, trainer: pl.Trainer) -> None:
        """Validation loaders built during the sanity check used the pre-allocation shares; rebuild them when the
        allocation changes a replica's shard (Lightning then calls ``val_dataloader()`` again). Shares that split
        every cached loader as before (speeds ``[1, 1]`` and batches ``[2, 2]``) keep the loaders, as DDP would."""
        cached = cached_validation_loader(trainer)
        weights = self._eval_weights()
        if cached is None or self._eval_weights_used == weights:
            return
        for loader in getattr(cached, "flattened", [cached]):
            batches = getattr(loader, "batch_sampler", None)
            if not isinstance(batches, EvalBatchSampler):
                continue  # not split by the weights (the user's own sampler, an iterable dataset)
            if eval_batch_plan(len(batches.sampler.dataset), weights, batches.batch_size)[0] != batches.shares:
                forget_validation_loader(trainer)
                return
        self._eval_weights_used = weights

    # ------------------------------------------------------------------ allocation
    def _allocate(
        self, dataloader: DataLoader, global_batch: int, shuffle: bool, seed: int, order_sampler: Any = None
    ) -> None:
        world = self.world_size
        bounds = {"min_batch_size": self._train_min_batch_size, "max_batch_sizes": self._max_batch_sizes}
        allocate_batch_sizes(global_batch, [1.0] * world, **bounds)  # validates the bounds before any profiling
        resume = plan_allocation(self._resume_record, world_size=world, given_speeds=self._speeds_arg)  # (#7)
        costs = None
        if resume.speeds is not None or self._speeds_arg is not None:
            # given (or resumed) speeds: the one-number model, proportional split
            speeds = list(resume.speeds if resume.speeds is not None else self._speeds_arg)  # type: ignore[arg-type]
        else:
            costs = self._measured_costs(dataloader, global_batch, shuffle, seed, order_sampler)
            speeds = [1.0] * world  # profiled on the first training steps (or one replica): the equal split till then
        self._cost_model = costs
        if costs is None:
            batch_sizes = allocate_batch_sizes(global_batch, speeds, **bounds)
        else:
            batch_sizes = allocate_affine(global_batch, costs, **bounds)
            speeds = [b / max(c(b), 1e-12) for b, c in zip(batch_sizes, costs)]  # samples/s at the allocation
            self._warn_useless_replicas(global_batch, costs, batch_sizes)
        self.adopt_allocation(batch_sizes, speeds)
        log_resumed_allocation(resume, self._resume_record, batch_sizes)  # re-balanced or reused on resume (#7)
        if self._profiler is None:
            rank_zero_info(self.balance_table())
        else:
            rank_zero_info(
                f"HeterogeneousStrategy: profiling on the first {self._profiler.plan.gather_step + 1} training steps"
                f" (trial splits); the fitted split applies from step {self._profiler.plan.switch_step}"
            )

    def _measured_costs(
        self, dataloader: DataLoader, global_batch: int, shuffle: bool, seed: int, order_sampler: Any = None
    ) -> list[AffineCost] | None:
        """Every replica's cost from the speed cache when every replica has an entry; else ``None``, and with more
        than one replica the first training steps profile (:mod:`lightning_het.balance.profiler`)."""
        self._profile_seconds = 0.0
        self._profile_cached = False
        if self.world_size == 1:
            return None
        costs = self._cached_costs(dataloader)
        if costs is None:
            self._start_profiler(dataloader, global_batch)
        return costs

    def _cached_costs(self, dataloader: DataLoader) -> list[AffineCost] | None:
        """The costs of every replica from the speed cache (``profile_cache``) when every replica has an entry (one
        all-gather when the cache is on), else ``None``."""
        cache, key = self._profile_cache_entry(dataloader)
        self._cache_entry = (cache, key)  # where the profiled cost goes
        if cache is None:
            return None
        cached = cache.get(key) if key is not None else None
        row = [1.0, cached.fixed_s, cached.per_sample_s] if cached is not None else [0.0, 0.0, 0.0]
        rows = self._all_gather_floats(row)
        if not all(r[0] == 1.0 for r in rows):
            return None
        self._profile_cached = True
        return [AffineCost(r[1], r[2]) for r in rows]

    def _start_profiler(self, dataloader: DataLoader, global_batch: int) -> None:
        """Plan the trial splits of the first training steps and hook the profiler into the fit loop."""
        bounds = {"min_batch_size": self._train_min_batch_size, "max_batch_sizes": self._max_batch_sizes}
        plan = profile_plan(
            global_batch,
            self.world_size,
            warmup=self._profile_warmup,
            steps=self._profile_steps,
            lag=loader_prefetch_depth(dataloader),
            **bounds,
        )
        monitor = self._monitor

        def clock() -> tuple[int, float] | None:
            return monitor.clock.open_step() if monitor is not None and monitor.clock is not None else None

        self._profiler = InLoopProfiler(
            plan, self.global_rank, self.world_size, self.root_device, clock, self._adopt_profiled
        )
        trainer = self._trainer()
        if trainer is not None:
            attach_profiler(self._profiler, trainer)

    def _adopt_profiled(self, costs: list[AffineCost], batch_sizes: list[int]) -> None:
        """The profiler agreed on the costs (every rank, at the same step): the fitted split applies to the global
        batches not drawn yet."""
        self._cost_model = costs
        speeds = [b / max(c(b), 1e-12) for b, c in zip(batch_sizes, costs)]
        self._warn_useless_replicas(sum(batch_sizes), costs, batch_sizes)
        self.adopt_allocation(batch_sizes, speeds)
        assert self._profiler is not None
        for sampler in self._profiler.samplers:  # every training loader's batches not drawn yet
            total = sampler.global_batch_size
            floor = self._train_min_batch_size
            sampler.set_batch_sizes(
                batch_sizes if total == sum(batch_sizes) else allocate_batch_sizes(total, speeds, min_batch_size=floor)
            )
        self._profile_seconds = self._profiler.overhead_s
        cache, key = self._cache_entry
        if cache is not None and key is not None:
            cache.put(key, costs[self.global_rank])
        rank_zero_info(self.balance_table())

    @property
    def profiling(self) -> bool:
        """Whether the first training steps are still profiling (trial splits, costs not agreed yet)."""
        return self._profiler is not None and not self._profiler.done

    def _warn_useless_replicas(self, global_batch: int, costs: list[AffineCost], batch_sizes: list[int]) -> None:
        message = useless_replica_message(
            global_batch,
            costs,
            batch_sizes,
            device_labels(self),
            min_batch_size=self._train_min_batch_size,
            max_batch_sizes=self._max_batch_sizes,
        )
        if message is not None:
            rank_zero_warn(message)

    def _monitor_settings(self) -> MonitorSettings:
        """This replica's telemetry, emulation and rebalancing settings, and the batch bounds a rebalance keeps."""
        factors = self._emulate_slowdown
        return MonitorSettings(
            record=self._telemetry,
            slowdown=factors[self.global_rank] if factors else 1.0,
            profile=self._speeds_arg is None and self.world_size > 1,
            every_n_epochs=self._rebalance_every_n_epochs,
            threshold=self._rebalance_threshold,
            min_batch_size=self._train_min_batch_size,
            max_batch_sizes=tuple(self._max_batch_sizes) if self._max_batch_sizes is not None else None,
        )

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
        if costs is not None:  # a rebalancing check refreshed the cost model
            self._cost_model = [AffineCost.from_dict(c) for c in costs]
        self._batch_sizes = list(batch_sizes)
        self._speeds = list(speeds)
        self._global_batch_size = sum(batch_sizes)
        self._loss_scale = loss_scale(self._batch_sizes, self.global_rank)
        if self._comm_controller is not None:
            self._comm_controller.set_batch_sizes(self._batch_sizes)
            self._comm_sizes = list(self._batch_sizes)

    def _all_gather_floats(self, values: list[float]) -> list[list[float]]:
        gathered = torch.tensor(values, dtype=torch.float64, device=self.root_device)
        everyone = [torch.zeros_like(gathered) for _ in range(self.world_size)]
        dist.all_gather(everyone, gathered)
        return [t.tolist() for t in everyone]

    def _profiled_module(self) -> tuple[torch.nn.Module | None, str]:
        """The module whose steps are profiled (``None`` before there is one) and the precision's name: what the
        speed cache keys on besides the device and the data."""
        return getattr(self, "_lightning_module", None), type(self.precision_plugin).__name__

    def _profile_cache_entry(self, dataloader: DataLoader) -> tuple[ProfileCache | None, str | None]:
        """The speed cache (``profile_cache``) and this replica's key in it, or ``(None, None)`` when it is off."""
        module, precision = self._profiled_module()
        if self._profile_cache_arg in (None, False) or module is None:
            return None, None
        directory = ProfileCache.default_directory() if self._profile_cache_arg is True else self._profile_cache_arg
        cache = ProfileCache(directory)  # type: ignore[arg-type]
        try:
            sample = dataloader.dataset[0]
        except Exception:  # a dataset we cannot peek into is simply not cached
            return cache, None
        rank = self.global_rank
        key = cache_key(
            module,
            self.root_device,
            sample,
            precision=precision,
            slowdown=self._emulate_slowdown[rank] if self._emulate_slowdown else 1.0,
            replicas_on_node=self.num_processes,
        )
        return cache, key

    def _export_allocation(self) -> dict[str, Any]:
        return {
            "batch_sizes": self._batch_sizes,
            "speeds": self._speeds,
            "node_ids": self._node_ids,
            "profile_seconds": self._profile_seconds,
            "cost_model": [c.as_dict() for c in self._cost_model] if self._cost_model else None,
            "profile_cached": self._profile_cached,
            "telemetry": telemetry_section(self._monitor, self._telemetry_snapshot, include_series=True),  # (#6)
        }

    def _import_allocation(self, state: dict[str, Any]) -> None:
        if state.get("batch_sizes"):
            self._batch_sizes = list(state["batch_sizes"])
            self._speeds = list(state["speeds"])
            self._global_batch_size = sum(self._batch_sizes)
            self._loss_scale = loss_scale(self._batch_sizes, self.global_rank)
        self._node_ids = state.get("node_ids")
        self._profile_seconds = state.get("profile_seconds", 0.0)
        if state.get("cost_model"):
            self._cost_model = [AffineCost.from_dict(c) for c in state["cost_model"]]
        self._profile_cached = bool(state.get("profile_cached", False))
        self._telemetry_snapshot = state.get("telemetry")

    # ------------------------------------------------------------------ reporting
    def balance_report(self, include_series: bool = False) -> dict[str, Any]:
        """The allocation as plain data (for ``metrics.json`` and loggers).

        With telemetry on, ``"telemetry"`` holds the per-epoch, per-replica figures of the last ``fit``
        (``epochs``: compute / wait / step seconds, samples/s, imbalance; ``rebalances`` and ``checks``), and, with
        ``include_series=True``, the step-by-step ``series`` behind the balance plot. ``"profile_seconds"`` is the
        time this replica spent profiling.
        """
        sizes = self._batch_sizes or []
        return {
            "global_batch_size": self._global_batch_size,
            "batch_sizes": list(sizes),
            "speeds": list(self._speeds or []),
            "shares": sample_shares(sizes) if sizes else [],
            "node_ids": list(self._node_ids or []),
            "profiled": self._speeds_arg is None,
            "emulate_slowdown": list(self._emulate_slowdown) if self._emulate_slowdown else None,
            "devices": device_labels(self),
            "profile_seconds": self._profile_seconds,
            "profile_cached": self._profile_cached,
            "cost_model": [c.as_dict() for c in self._cost_model] if self._cost_model else None,
            "predicted_step_s": step_time(sizes, self._cost_model) if self._cost_model and sizes else None,
            "telemetry": telemetry_section(self._monitor, self._telemetry_snapshot, include_series=include_series),
        }

    def balance_table(self) -> str:
        """A human-readable table: rank, node, device, speed, batch size, share."""
        report = self.balance_report()
        if not report["batch_sizes"]:
            return "HeterogeneousStrategy: no allocation yet"
        devices = report["devices"]
        unit = "samples/s" if report["profiled"] else "(given)"
        costs = report["cost_model"]
        source = " (costs from the profile cache)" if report["profile_cached"] else ""
        lines = [
            f"HeterogeneousStrategy balance: global batch {report['global_batch_size']}{source}",
            f"{'rank':>4} {'node':>4} {'device':>8} {'speed ' + unit:>18} {'batch':>6} {'share':>7}"
            + (f" {'fixed ms':>9} {'ms/sample':>9} {'step ms':>8}" if costs else ""),
        ]
        for r, (b, s, sh) in enumerate(zip(report["batch_sizes"], report["speeds"], report["shares"])):
            node = report["node_ids"][r] if r < len(report["node_ids"]) else "?"
            device = devices[r] if r < len(devices) else "?"
            line = f"{r:>4} {node!s:>4} {device:>8} {s:>18.2f} {b:>6d} {sh:>7.1%}"
            if costs:
                a, c = costs[r]["fixed_s"], costs[r]["per_sample_s"]
                line += f" {a * 1e3:>9.2f} {c * 1e3:>9.3f} {(a + c * b) * 1e3:>8.2f}"
            lines.append(line)
        if report["predicted_step_s"] is not None:
            lines.append(f"predicted step (slowest replica's local compute): {report['predicted_step_s'] * 1e3:.2f} ms")
        return "\n".join(lines)

    # ------------------------------------------------------------------ training hooks
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        sizes = self._step_batch_sizes()
        if self._comm_controller is not None and sizes and sizes != self._comm_sizes:
            self._comm_controller.set_batch_sizes(sizes)  # the split of this step (trial, tail or allocation)
            self._comm_sizes = sizes
        clock = self._monitor.clock if self._monitor is not None else None  # telemetry / emulation (#6)
        if clock is None:
            return super().training_step(*args, **kwargs)
        clock.step_start(sizes[self.global_rank] if sizes else 0)
        output = super().training_step(*args, **kwargs)
        clock.forward_end()  # sleeps (f - 1) x the forward time under emulate_slowdown
        return output

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        clock = self._monitor.clock if self._monitor is not None else None  # (#6)
        if clock is not None:
            clock.before_backward(closure_loss)  # end of local backward compute vs gradient-sync wait
        scale = self._step_loss_scale()
        super().backward(closure_loss * scale if scale != 1.0 else closure_loss, optimizer, *args, **kwargs)
        if clock is not None:
            clock.after_backward()
        return closure_loss

    def _step_batch_sizes(self) -> list[int]:
        """Per-replica samples of the global batch being trained now: the allocation, a profiling trial split, or the
        tail batch's split on the last step of an epoch whose tail is trained (see
        :class:`ProportionalDistributedSampler`)."""
        sampler, sizes = self._train_sampler, list(self._batch_sizes or [])
        if sampler is None or list(sampler.batch_sizes) != sizes:
            return sizes
        if sampler.tail_batch_sizes is None and sampler.split_schedule is None:
            return sizes
        module = self._lightning_module
        trainer = attached_trainer(module)
        if trainer is None:
            return sizes
        return sampler.step_batch_sizes(trainer.fit_loop.epoch_loop.batch_idx)  # 0-based step within the epoch

    def _step_loss_scale(self) -> float:
        """``W * b_r / B`` for the global batch being trained now (the tail batch has its own)."""
        sizes = self._step_batch_sizes()
        if not sizes or sizes == self._batch_sizes:
            return self._loss_scale
        return loss_scale(sizes, self.global_rank)


class HeterogeneousStrategy(HeterogeneousStrategyBase, DDPStrategy):
    __doc__ = HeterogeneousStrategyBase.__doc__
    _trainer_loop = True


def _read_as_given(dataloader: DataLoader, trainer: pl.Trainer) -> bool:
    """``Trainer(use_distributed_sampler=False)``: every replica reads ``dataloader`` whole, as under DDP (the user
    shards inside the Dataset); a loader with a :class:`ProportionalDistributedSampler` of the user's own is still
    adopted (its batch sizes are the allocation)."""
    own_sampler = isinstance(dataloader.sampler, ProportionalDistributedSampler)
    return not own_sampler and not uses_distributed_sampler(trainer)


def _rendezvous_failed(err: BaseException, timeout: Any, rank: int, world_size: int) -> BaseException:
    """A rendezvous that timed out: one line naming the wait, then exit status 124 (a replica stalled at start-up);
    any other error is returned unchanged."""
    from lightning_het.reliability.verdicts import WATCHDOG_EXIT_CODE, JobEnded

    text = str(err).lower()
    if "timeout" not in text and "timed out" not in text:
        return err
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    print(
        f"[rank {rank}] lightning_het: not every one of the {world_size} replicas joined the rendezvous within"
        f" {seconds:g} s (startup_timeout); a replica hung or died while starting ({str(err).splitlines()[0][:200]})."
        f" Ending the job (exit status {WATCHDOG_EXIT_CODE}). HINT: look at the other replicas' output; raise"
        " `startup_timeout` if they only start slowly.",
        file=sys.stderr,
        flush=True,
    )
    return JobEnded(WATCHDOG_EXIT_CODE)
