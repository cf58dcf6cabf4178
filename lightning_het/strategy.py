"""``HeterogeneousStrategy``: Lightning's ``DDPStrategy`` with speed-proportional batch shares and exact gradients.
Trainer glue: each hook hands its job to a part the strategy owns (``docs/architecture.md``)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.data import has_len
from lightning.fabric.utilities.seed import reset_seed  # noqa: F401
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: F401
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn, TrainerStatus  # noqa: F401
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_het._compat import attached_trainer, record_loader_arguments
from lightning_het._flavour import FLAVOURS, trainer_flavour
from lightning_het.balance.clock import StepClock
from lightning_het.balance.monitor import (
    HeterogeneousBalanceCallback,  # noqa: F401
    attach_monitor,
)
from lightning_het.balance.policy import Allocation, StepSplit
from lightning_het.cluster.accelerators import (
    DeviceMapArg,
    DevicePlan,
    MixedAccelerator,  # noqa: F401
    MixedAcceleratorMixin,
    apply_local_settings,
    plan_devices,
    unbound_process_group,
)
from lightning_het.comm import CommAlgorithm
from lightning_het.comm.allreduce import register_user_hook
from lightning_het.comm.gather import reduce_counts
from lightning_het.config import Profiling, Reliability
from lightning_het.data.microbatch import piece_collective
from lightning_het.data.sampler import training_sampler
from lightning_het.data.splitting import LoaderSplitter
from lightning_het.fabric import HeterogeneousParts
from lightning_het.reliability.checkpointing import (
    CHECKPOINT_KEY,
    checkpoint_record,
    end_resume_quiet,
    job_identity,
    node_optimizer_checkpoint,
    read_record,
    trajectory_settings,
    with_node_states,
)
from lightning_het.reliability.emergency import Guards, restore_rng
from lightning_het.reliability.launch import (  # noqa: F401
    ExitCleanup,
    Preempted,
    PreemptionCallback,
    SpawnLauncher,
    shield_loader_workers,
)
from lightning_het.reliability.watchdog import Phase, Watchdog, WatchdogCallback  # noqa: F401


class HeterogeneousStrategyMixin(HeterogeneousParts):
    """DDP whose replicas' shares of each global batch follow their speeds, each loss scaled by its share (the exact
    gradient of the global batch). Keywords: ``docs/strategy.md``; the others go to ``DDPStrategy``."""

    strategy_name = "heterogeneous"

    def __init__(
        self,
        *,
        global_batch_size: int | None = None,
        speeds: Sequence[float] | None = None,
        min_batch_size: int = 1,
        max_batch_sizes: Sequence[int] | None = None,
        max_micro_batch_sizes: Sequence[int] | Literal["auto"] | None = None,
        node_ids: Sequence[int] | None = None,
        comm: Literal["auto", "allreduce", "hierarchical", "node_local"] | CommAlgorithm = "auto",
        profiling: Profiling | None = None,
        reliability: Reliability | None = None,
        device_map: DeviceMapArg | None = None,
        cpu_threads: int | Sequence[int] | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs = self._configure(locals())
        if device_map is not None:  # the accelerator places the replicas (the map's syntax checked now)
            for clash in ("accelerator", "parallel_devices"):
                if kwargs.get(clash) is not None:
                    raise ValueError(f"You set both `device_map` and `{clash}`={kwargs[clash]!r}; drop `{clash}`.")
            kwargs["accelerator"] = trainer_flavour(self).MixedAccelerator(device_map, cpu_threads=cpu_threads)
        elif cpu_threads is not None:
            raise ValueError(f"You set `cpu_threads`={cpu_threads!r} without a `device_map` (e.g. ['cpu', 'cpu']).")
        super().__init__(**kwargs)
        self._device_plan: DevicePlan | None = None  # resolved from the device map when the launcher is chosen
        self._loaders = LoaderSplitter()  # training sampler, resume record, evaluation weights
        self._split: StepSplit | None = None  # the split of the global batch being trained (set at its start)
        self._timing: StepClock | None = None  # the clock if it times the step being trained
        self._entry: dict[str, Any] = {}  # the emergency checkpoint's step record, and what it was built for
        self._entry_key: tuple[Any, ...] = ()
        self.guards = Guards()  # watchdog, preemption, emergency checkpoint

    @property
    def device_plan(self) -> DevicePlan | None:
        """Where every replica runs and with how many threads (``device_map``); ``None`` without one."""
        return self._device_plan

    @property
    def watchdog(self) -> Watchdog | None:
        """This replica's hung/dead-replica watchdog while one runs."""
        return self.guards.watchdog

    @override
    def _configure_launcher(self) -> None:
        accelerator, environment = self.accelerator, self.cluster_environment
        if isinstance(accelerator, MixedAcceleratorMixin):  # the device map resolved for this node and the job
            plan = self._device_plan = plan_devices(
                accelerator.device_map,
                node_rank=environment.node_rank() if environment is not None else 0,
                num_nodes=self.num_nodes,
                local_world_size=self.num_processes,
                cuda_device_count=torch.cuda.device_count(),  # NVML-based under Lightning: creates no CUDA context
                requested_backend=self.process_group_backend,
                cpu_threads=accelerator.cpu_threads,
            )
            if self.precision_plugin.precision == "16-mixed" and any(d.type == "cpu" for d in plan.global_devices):
                raise ValueError("You set `precision='16-mixed'` with CPU replicas (CUDA-only); use 'bf16-mixed'.")
            self.parallel_devices, self._process_group_backend = list(plan.local_devices), plan.backend
        super()._configure_launcher()
        if self._start_method != "popen":
            self._launcher = SpawnLauncher(self, self._launcher)

    @override
    def setup_environment(self) -> None:
        apply_local_settings(self)  # device map: this replica's intra-op threads
        super().setup_environment()
        self.guards.start(self, self._timeout, self._trainer())  # the watchdog: setup hooks to teardown
        self._place()

    @override
    def setup_distributed(self) -> None:
        seeded_ranks = lambda: (trainer_flavour(self).reset_seed(), self.set_world_ranks())  # noqa: E731
        with unbound_process_group(self):  # mixed CPU/GPU job: no rank binds a device to the default group
            self._start_process_group(super().setup_distributed, seeded_ranks)  # or a later Trainer call's

    @override
    def _register_ddp_hooks(self) -> None:
        """Nothing: Lightning's registers only on CUDA; :meth:`setup` installs the comm algorithm on any device."""

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        fitting = self._start_setup(trainer)
        super().setup(trainer)
        self._model_ready(trainer)  # after super(): `sync_batchnorm=True` has converted the layers by now
        if fitting:  # `comm` on the DDP model and the optimizers (a collective), with a resumed fit's comm state
            assert isinstance(self.model, DistributedDataParallel) and self._node_ids is not None
            comm = self.config.comm.resolve(self._node_ids)
            register_user_hook(self.model, comm, self._ddp_comm_hook, self._ddp_comm_state, self._ddp_comm_wrapper)
            loop = trainer.fit_loop  # the schedule follows the global step: a resumed fit keeps its phase
            position = lambda: (trainer.global_step, bool(loop.epoch_loop.batch_progress.is_last_batch))  # noqa: E731
            ids, sizes = self._node_ids, self.policy.allocation.batch_sizes
            comm.install(self.model, self.optimizers, ids, self.global_rank, sizes, position=position)
            comm.load_state_dict((self._loaders.resume_record or {}).get("comm"))  # the weights were restored before
            self.comm_algorithm, self._comm_sizes = comm, sizes
            if self._resume_fit(trainer, comm.mode):
                comm.load_state_dict((self._loaders.resume_record or {}).get("comm"))
        # the emergency checkpoint needs no collective: not under node_local
        self._attach_guards(trainer, fitting, saves=fitting and self.comm_algorithm.mode != "node_local")

    def _start_setup(self, trainer: pl.Trainer) -> bool:
        """Before the parent's setup: whether this is a fit (which derives a new allocation)."""
        fitting = trainer.state.fn == trainer_flavour(trainer).TrainerFn.FITTING
        if fitting:
            self.policy.reset()
            self._split = self._loaders.train_sampler = self._loaders.train_pass = None
        return fitting

    def _model_ready(self, trainer: pl.Trainer) -> None:
        """After the parent's setup: the Trainer kept, the loaders' arguments, the model's normalisation checked."""
        self._setup_trainer = trainer  # read every step (the module's `trainer` property costs microseconds)
        record_loader_arguments(trainer)  # a DataLoader subclass's own arguments survive Lightning's copy
        self.policy.check_normalisation(self.lightning_module)
        self.policy.emulate_memory(self.lightning_module)  # emulate_memory_cap: raised inside the model's forward

    def _resume_fit(self, trainer: pl.Trainer, mode: str) -> bool:
        """``resume="auto"``: once the optimizers exist (the job's identity), before their restore."""
        schedulers = [scheduler.scheduler for scheduler in self.lr_scheduler_configs]
        trajectory = trajectory_settings(self.config, mode, trainer)
        job = job_identity(self.lightning_module, self.optimizers, schedulers, trajectory)
        return self.guards.resume(trainer, self.config, job, self.broadcast)

    def _attach_guards(self, trainer: pl.Trainer, fitting: bool, saves: bool) -> None:
        """The watchdog's, preemption's and (``saves``) the emergency checkpoint's parts; a fit's balance monitor."""
        config = self.config
        self._entry_key = ()  # a new fit (a new job identity): the step record is rebuilt
        monitored = lambda trainer, i: self._monitor is not None and self._monitor.batch_ended(trainer, i)  # noqa: E731
        self.guards.attach(self, trainer, config, self._step_entry, saves, monitored)  # one batch-end dispatch
        if fitting:
            slowdown = config.emulate_slowdown[self.global_rank] if config.emulate_slowdown else 1.0
            self._monitor = attach_monitor(self, trainer, config.profiling, slowdown, **self.policy.bounds)

    @override
    def teardown(self) -> None:
        trainer = self._trainer()  # a popen launcher waits for every replica's end: the watchdog watches until then
        interrupted = trainer is not None and trainer.state.status == trainer_flavour(trainer).TrainerStatus.INTERRUPTED
        self.guards.end(trainer, interrupted, getattr(self._launcher, "finishes_runs", False))
        self._loaders.resume_record = self._loaders.train_sampler = None
        self.policy.emulate_memory(None)
        end_resume_quiet()  # Lightning's "not resumable" warning, silenced for this fit's mid-epoch resume
        ExitCleanup.clean = sys.exc_info()[0] is None  # Lightning tears down inside its `except` after a failure
        self._setup_trainer, self._entry, self._entry_key = None, {}, ()  # no loader kept past the run
        super().teardown()

    def _trainer(self) -> pl.Trainer | None:
        return getattr(self, "_setup_trainer", None) or attached_trainer(getattr(self, "_lightning_module", None))

    @override
    def process_dataloader(self, dataloader: object) -> object:
        # workers ignore SIGTERM/SIGUSR1 so that they do not die before their replica saves (docs/preemption.md)
        if isinstance(dataloader, DataLoader):
            fit = self._fit_context(loop_prefetch=0 if has_len(dataloader) else 1)  # Lightning's fetcher: sized, none
            dataloader = self._loaders.process(dataloader, self.lightning_module.trainer, self.policy, fit)
        return shield_loader_workers(dataloader, self.global_rank)

    def _profiled_module(self) -> tuple[torch.nn.Module | None, str]:
        """The module whose steps are profiled and the precision's name (what the speed cache keys on)."""
        return getattr(self, "_lightning_module", None), type(self.precision_plugin).__name__

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self.guards.mark(Phase.TRAINING_STEP, 1)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        policy, micro, batch_idx = self.policy, self.policy.micro, self._batch_idx()
        if micro is not None:  # a cap lowered by an out-of-memory error, agreed now and then
            policy.agree_caps(batch_idx, getattr(self._trainer(), "num_training_batches", None))
        # the split of this global batch, once: loss scaling, micro-batches, the comm algorithm and the clock read it
        self._split = split = policy.step_split(self._loaders.train_sampler, batch_idx)
        self._tell_comm(split.sizes)  # the same split object while it holds: a cheap comparison
        clock = self._step_clock()  # telemetry, emulation, profiling: every step, or every few once profiled
        if clock is not None and not clock.step_start(split.sizes[policy.rank] if split.sizes else 0):
            clock = None
        self._timing = clock
        step = super().training_step
        if micro is None:
            output = step(*args, **kwargs)
        else:  # the user's step as micro-batches: this replica's share exceeds its memory cap (``data/microbatch``)
            module = self.lightning_module
            self._broadcast_buffers()  # once per step, before any piece (DDP's own would repeat after a failure)
            no_sync = self.block_backward_sync
            measure = (lambda s, b: policy.measure_caps(s, b, no_sync, module)) if policy.cap_unknown else None
            output = micro.training_step(step, args, kwargs, module, self._backward_piece, no_sync, measure)
        if clock is not None:
            clock.forward_end()  # sleeps (f - 1) x the forward time under emulate_slowdown
        return output

    @override
    def _setup_model(self, model: torch.nn.Module) -> DistributedDataParallel:
        # micro-batches: the strategy broadcasts the buffers itself (``_broadcast_buffers``), not every DDP forward
        saved, micro = self._ddp_kwargs, self.policy.micro is not None
        self._own_buffer_sync = self._buffers_stale = micro and saved.get("broadcast_buffers", True)
        self._ddp_kwargs = {**saved, "broadcast_buffers": False} if self._own_buffer_sync else saved
        try:
            return super()._setup_model(model)
        finally:
            self._ddp_kwargs = saved

    def _broadcast_buffers(self) -> None:
        """Rank 0's module buffers to every replica before the first forward after an optimizer step, as DDP does."""
        if getattr(self, "_own_buffer_sync", False) and self._buffers_stale:
            self._buffers_stale = False
            for buffer in self.lightning_module.buffers():
                torch.distributed.broadcast(buffer, 0)

    def _step_split(self) -> StepSplit:
        """The split set at the batch's start (computed here for a backward outside ``training_step``)."""
        return self._split or self.policy.step_split(self._loaders.train_sampler, self._batch_idx())

    def _backward_piece(self, loss: Tensor) -> None:
        """Backward an earlier micro-batch's loss through Lightning (under ``no_sync``), scaled as the step's."""
        super().backward(
            loss * self._step_split().loss_scale / self.lightning_module.trainer.accumulate_grad_batches, None
        )

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        clock = self._timing
        self.guards.mark(Phase.BACKWARD)
        if clock is not None:
            clock.before_backward(closure_loss)  # end of local backward compute vs gradient-sync wait
        scale = self._step_split().loss_scale
        if self.policy.micro is not None:  # the step's earlier micro-batches: their gradients join this backward
            self.policy.micro.restore_grads(list(self.lightning_module.parameters()))
        super().backward(closure_loss * scale if scale != 1.0 else closure_loss, optimizer, *args, **kwargs)
        if clock is not None:
            clock.after_backward()
        self.guards.mark(Phase.OPTIMIZER_STEP)
        return closure_loss

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        step = super().optimizer_step  # the parameter update under the emergency checkpoint's lock
        output = self.guards.optimizer_step(lambda c: step(optimizer, c, model, **kwargs), closure, self._trainer())
        self._buffers_stale = True
        return output

    def _step_clock(self) -> StepClock | None:
        return self._monitor.clock if self._monitor is not None else None

    def _batch_idx(self) -> int | None:
        trainer = self._trainer()
        return None if trainer is None else trainer.fit_loop.epoch_loop.batch_idx

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        comm = self.comm_algorithm
        if comm is not None:
            comm.sync()  # node_local: a fit stopped mid-epoch (max_steps) still ends on one consensus model
        self.guards.finish(self.lightning_module.trainer)  # this job's earlier emergency checkpoint: the end now
        if comm is not None and self.world_size > 1:  # one replica communicates nothing
            rank_zero_info(comm.summary())

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        if self.model is not self._lightning_module:  # fitting (DDP): its first forward would broadcast the buffers
            self._broadcast_buffers()
        if self.comm_algorithm is not None:  # node_local: the consensus model, without a sync (a collective)
            self.comm_algorithm.show_consensus()

    @override
    def on_validation_end(self) -> None:
        if self.comm_algorithm is not None:
            self.comm_algorithm.hide_consensus()  # each replica's own model again
        super().on_validation_end()

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        """All-reduce (an integer mean exactly, in ``float64``); local in an earlier micro-batch's logging."""
        if piece_collective(self.policy.micro, "reduce"):
            return tensor
        return reduce_counts(super().reduce, tensor, group, reduce_op)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        state, comm = super().lightning_module_state_dict(), self.comm_algorithm
        # node_local: the consensus model, computed without a sync (a collective); each node's own in the record
        return state if comm is None else comm.consensus_state_dict(self.lightning_module, state)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if self.guards.captured(checkpoint):  # an emergency checkpoint: kept for the watchdog's thread to write
            return
        entry = self._checkpoint_entry()  # allocation, sampler position (the emergency record too: no collective)
        checkpoint[CHECKPOINT_KEY] = with_node_states(entry, checkpoint, self.comm_algorithm)  # node_local: collective
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not self.guards.capturing():  # building an emergency checkpoint: the other replicas are gone
            super().barrier(*args, **kwargs)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        super().load_optimizer_state_dict(node_optimizer_checkpoint(checkpoint, self.comm_algorithm))  # node_local

    def _checkpoint_entry(self) -> dict[str, Any]:
        """The allocation (no speeds while profiling), the sampler's place, the comm state and the job's identity."""
        allocation, comm = self.policy.allocation, self.comm_algorithm
        record = checkpoint_record(
            self._trainer(),
            allocation.batch_sizes,
            None if self.profiling else allocation.speeds,
            self._node_ids,
            profiled=self.config.speeds is None,
            find_sampler=training_sampler,
            comm=None if comm is None else comm.state_dict(),
        )
        return {**record, "job": self.guards.job}

    def _step_entry(self) -> dict[str, Any]:
        """:meth:`_checkpoint_entry` at the end of a step, rebuilt only when the epoch, the allocation or the training
        loader changed: the emergency checkpoint sets its sampler's place from the step's loop state."""
        trainer = self._setup_trainer
        key = (trainer.current_epoch, self.policy.allocation, self.profiling, trainer.train_dataloader)
        if key != self._entry_key:  # (a tuple compares its items by identity first: cheap while they stay the same)
            self._entry, self._entry_key = self._checkpoint_entry(), key
        return self._entry

    @override
    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        self._loaders.resume_record = read_record(checkpoint)  # used by the next training loader split
        restore_rng((self._loaders.resume_record or {}).get("rng"))  # an emergency checkpoint's RNG states
        return checkpoint

    def export_allocation(self) -> dict[str, Any]:
        """The allocation, costs and telemetry as plain data: what a spawned worker sends back to the parent."""
        telemetry = self.balance_report(include_series=True)["telemetry"]
        return {**asdict(self.policy.allocation), "node_ids": self._node_ids, "telemetry": telemetry}

    def import_allocation(self, state: dict[str, Any]) -> None:
        """Adopt what :meth:`export_allocation` returned in a worker (in the parent process, after spawn)."""
        self.policy.allocation = Allocation.from_dict(state)
        self._node_ids, self._telemetry_snapshot = state.get("node_ids"), state.get("telemetry")


class HeterogeneousStrategy(HeterogeneousStrategyMixin, DDPStrategy):
    """:class:`HeterogeneousStrategyMixin` on ``lightning.pytorch`` (:mod:`lightning_het.pl`: ``pytorch_lightning``)."""


FLAVOURS[False] = sys.modules[__name__]  # defines `_flavour.NAMES` (the imports marked F401)
