"""``Fabric(strategy="heterogeneous")``: speed-proportional batch shares, exact gradients and node-aware communication
in a loop of your own (``docs/fabric.md``); glue over the same parts as the Trainer strategy."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.utilities.data import has_iterable_dataset
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from torch.utils.data import DataLoader, DistributedSampler
from typing_extensions import override

from lightning_het.balance.clock import StepClock
from lightning_het.balance.policy import BalancePolicy, BalanceView, FitContext, StepSplit
from lightning_het.balance.profiler import LoopSteps
from lightning_het.balance.report import balance_report, render_balance_table, telemetry_section
from lightning_het.cluster.accelerators import device_labels
from lightning_het.cluster.rendezvous import init_process_group, rendezvous_wait, started_elsewhere
from lightning_het.cluster.topology import gather_node_ids, validate_node_ids
from lightning_het.comm import CommAlgorithm
from lightning_het.comm.gather import all_gather_collection
from lightning_het.config import Profiling, Reliability, strategy_config
from lightning_het.data.microbatch import piece_collective
from lightning_het.data.sampler import (
    ProportionalBatchSampler,
    ProportionalDistributedSampler,
    UnpaddedDistributedSampler,
)
from lightning_het.data.splitting import rebuild_loader, training_order
from lightning_het.reliability.launch import ExitCleanup, ScriptLauncher, validate_launch_environment


class HeterogeneousParts(BalanceView):
    """What both strategies build from their keywords (the balance policy, the comm algorithm) and their shared
    glue: the process group's start, the replica's place, the step's split told to the comm algorithm."""

    _monitor: Any = None  # the Trainer's balance monitor (telemetry) of the fit
    _telemetry_snapshot: dict[str, Any] | None = None  # the workers' telemetry, in the parent after spawn

    def _configure(self, keywords: dict[str, Any], fabric: bool = False) -> dict[str, Any]:
        """The constructor's ``locals()`` validated into the policy and the comm algorithm; returns DDP's keywords."""
        config, rest = strategy_config(type(self), keywords, fabric)
        self.policy = BalancePolicy(config)
        self._comm_sizes: list[int] | None = None  # the split the comm algorithm was last given
        return rest

    @override
    def _configure_launcher(self) -> None:
        ExitCleanup.register()  # before the launcher's exit handlers, so it runs after them
        self.config.check_world(self.num_nodes, self.num_processes)  # before any worker starts
        super()._configure_launcher()  # wrapped: no orphans, end barrier, exit statuses (and the allocation sent back)
        if self._start_method == "popen":  # replicas that cannot outlive the launching process
            self._launcher = ScriptLauncher(self, self._launcher)

    @override
    def teardown(self) -> None:
        if self.comm_algorithm is not None:
            self.comm_algorithm.remove()  # its counters stay readable (`comm_stats`)
        super().teardown()

    @property
    def process_group_timeout(self) -> Any:
        """The collective timeout (``timeout``)."""
        return self._timeout

    def _start_process_group(self, joined: Callable[[], None], set_ranks: Callable[[], None]) -> None:
        """``set_ranks`` and start the process group, or (torchrun's agent hosts the store) wait and run ``joined``;
        a short ``timeout`` does not fail the rendezvous of replicas that start slowly."""
        wait = rendezvous_wait(self._timeout, self.config.reliability.startup_timeout)
        if started_elsewhere(wait):
            return joined()
        set_ranks()
        self._process_group_backend = self._get_process_group_backend()
        init_process_group(self, self._process_group_backend, self._timeout, wait)

    def _place(self) -> None:
        """This replica's rank, device and node (``setup_environment``)."""
        self.policy.place(self.global_rank, self.world_size, self.root_device, self.num_processes)
        ids = self.config.node_ids  # else one all-gather of (node rank, host name)
        self._node_ids = validate_node_ids(ids, self.world_size) if ids else gather_node_ids(self.cluster_environment)

    def _tell_comm(self, sizes: list[int] | None) -> None:
        """The comm algorithm is given the step's split when it changed."""
        if self.comm_algorithm is not None and sizes and sizes != self._comm_sizes:
            self.comm_algorithm.set_batch_sizes(sizes)
            self._comm_sizes = sizes

    def _fit_context(self, **fit: Any) -> FitContext:
        """What allocating needs from this fit (the module, the clock, the device labels, the report)."""
        return FitContext(
            self._profiled_module, self._step_clock, device_labels(self), report=self.balance_report, **fit
        )

    def balance_report(self, include_series: bool = False) -> dict[str, Any]:
        """The allocation and the last fit's telemetry (with ``include_series``: per step) as plain data."""
        telemetry = telemetry_section(self._monitor, self._telemetry_snapshot, include_series=include_series)
        return balance_report(self.policy.allocation, self.config, self._node_ids, device_labels(self), telemetry)

    def balance_table(self) -> str:
        """A human-readable table: rank, node, device, speed, batch size, share."""
        return render_balance_table(self.balance_report())

    def all_gather(self, tensor: Any, group: Any | None = None, sync_grads: bool = False) -> Any:
        """As DDP's, with per-sample tensors of uneven shares concatenated to ``[sum of n_r, *rest]``."""
        piece_collective(self.policy.micro, "all_gather")  # raises in an earlier micro-batch
        return all_gather_collection(tensor, group=group, sync_grads=sync_grads)


class HeterogeneousFabricStrategyMixin(HeterogeneousParts):
    """Fabric's DDP with per-replica batch shares proportional to speed and exact gradients. Keywords: the Trainer
    strategy's, less those that need its loop; the others go to Fabric's ``DDPStrategy``."""

    strategy_name = "heterogeneous"
    #: Fabric's sampler wrapper of this strategy's Lightning package (a loader it wraps is split for training)
    sampler_wrapper: type

    def __init__(
        self,
        *,
        global_batch_size: int | None = None,
        speeds: Sequence[float] | None = None,
        min_batch_size: int = 1,
        max_batch_sizes: Sequence[int] | None = None,
        node_ids: Sequence[int] | None = None,
        comm: Literal["auto", "allreduce", "hierarchical", "node_local"] | CommAlgorithm = "auto",
        profiling: Profiling | None = None,
        reliability: Reliability | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**self._configure(locals(), fabric=True))
        self._ddp_model: DistributedDataParallel | None = None  # the model `fabric.setup` wrapped (one per strategy)
        self._steps_per_epoch: int | None = None  # global batches per epoch of the training loader
        self._optimizer_steps = 0  # drives the node_local schedule
        self._steps = LoopSteps()  # the step being trained; its clock while your first steps profile

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        validate_launch_environment(self.num_nodes, self.cluster_environment)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._place()

    @override
    def _setup_distributed(self) -> None:
        self._start_process_group(super()._setup_distributed, self._set_world_ranks)

    @override
    def setup_module(self, module: Module) -> DistributedDataParallel:
        """Wrap ``module`` in DDP and install the ``comm`` algorithm on it (a collective: every rank)."""
        if self._ddp_model is not None:
            raise RuntimeError(
                "HeterogeneousFabricStrategy handles one model, but `fabric.setup` was called for a second one."
                " HINT: put the networks into one `nn.Module` and set that up once."
            )
        ddp_model = super().setup_module(module)
        ids, sizes = self._node_ids, self.policy.allocation.batch_sizes
        assert ids is not None
        self.comm_algorithm, self._comm_sizes = self.config.comm.resolve(ids), sizes
        self.comm_algorithm.install(ddp_model, [], ids, self.global_rank, sizes, position=self._position)
        self._ddp_model = ddp_model
        self._watch_steps()  # the training loader was set up first and profiling is planned
        return ddp_model

    def _position(self) -> tuple[int, bool]:
        """Optimizer steps done, and whether the one in progress ends an epoch (the comm schedule)."""
        steps, per_epoch = self._optimizer_steps, self._steps_per_epoch
        return steps, bool(per_epoch) and (steps + 1) % per_epoch == 0  # type: ignore[operator]

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        if self.comm_algorithm is not None:
            self.comm_algorithm.hook_optimizer(optimizer)  # the comm algorithm runs after each of its steps
        return super().setup_optimizer(optimizer)

    @override
    def backward(self, tensor: Tensor, module: Any, *args: Any, **kwargs: Any) -> Tensor:
        """Back-propagate ``tensor * loss_scale`` (the scale of the step's split); returns ``tensor`` unscaled."""
        split, clock = self._step_split(), self._step_clock()
        self._tell_comm(split.sizes)
        if clock is not None:
            clock.before_backward(tensor)  # end of local backward compute vs gradient-sync wait
        super().backward(tensor * split.loss_scale if split.loss_scale != 1.0 else tensor, module, *args, **kwargs)
        if clock is not None:
            clock.after_backward()
        return tensor

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, **kwargs)
        self._optimizer_steps += 1
        self._steps.step_ended(self.policy.profiler)
        return output

    def synchronize(self) -> bool:
        """``comm="node_local"``: average the replicas' parameters unless they agree (a collective); whether it ran."""
        return self.comm_algorithm is not None and self.comm_algorithm.sync()

    @override
    def process_dataloader(self, dataloader: DataLoader) -> DataLoader:
        sampler = getattr(dataloader, "sampler", None)
        if not isinstance(dataloader, DataLoader) or not isinstance(sampler, DistributedSampler):
            return dataloader  # `use_distributed_sampler=False`: every replica reads the whole loader
        if has_iterable_dataset(dataloader):
            rank_zero_warn(
                "The DataLoader wraps an IterableDataset, which HeterogeneousFabricStrategy cannot re-split: every"
                " replica reads it as in plain DDP. HINT: use a map-style Dataset for speed-proportional batches."
            )
            return dataloader
        if isinstance(sampler, ProportionalDistributedSampler):  # the user's own split: the allocation
            sizes, allocated = list(sampler.batch_sizes), self.policy.allocation.batch_sizes
            if allocated is not None and sizes != allocated:
                raise ValueError(
                    f"The DataLoader's ProportionalDistributedSampler has batch_sizes={sizes}, but the strategy"
                    f" allocated {allocated}. HINT: build it from `strategy.batch_sizes`."
                )
            if sampler.tail_batch_sizes is not None:
                raise ValueError(
                    f"The DataLoader's ProportionalDistributedSampler trains the tail as a last, smaller global batch"
                    f" ({sampler.tail_batch_sizes}), whose loss scale HeterogeneousFabricStrategy cannot know in your"
                    " loop. HINT: build it with `drop_last=True`."
                )
            self.adopt_allocation(sizes, self.config.speeds or [float(b) for b in sizes])
            self._steps_per_epoch, self._steps.sampler = sampler.num_steps, sampler
            return dataloader
        if type(sampler) is not DistributedSampler and not isinstance(sampler, self.sampler_wrapper):
            return dataloader  # the user's own distributed sampler, e.g. `eval_sampler`
        if self._steps_per_epoch is not None:
            # a second split could re-allocate, changing the loss scale under the first loader's batches
            raise ValueError(
                "HeterogeneousFabricStrategy has already split a training loader, and this loader would be split as"
                " a second one (its sampler is Fabric's distributed sampler). HINT: set evaluation loaders up with"
                " `sampler=strategy.eval_sampler(dataset)` (each sample on one replica) or with"
                " `fabric.setup_dataloaders(loader, use_distributed_sampler=False)` (every replica reads it all)."
            )
        order = training_order(dataloader)
        global_batch = self.config.global_batch_size or (dataloader.batch_size or 0) * self.world_size
        if not global_batch:
            raise ValueError(
                "The DataLoader has no `batch_size`, so the global batch cannot be inferred. HINT: pass"
                " `HeterogeneousFabricStrategy(global_batch_size=...)`."
            )
        sizes = self.policy.sizes_for(dataloader, global_batch, self._fit_context(loop_prefetch=0))
        # the tail is dropped: its step would need its own loss scale, and the strategy cannot tell which step it is
        sampler = order.split(dataloader.dataset, sizes, self.global_rank, drop_last=True)
        self._steps_per_epoch, self._steps.sampler = sampler.num_steps, sampler
        profiler, batches = self.policy.profiler, None
        if profiler is not None:  # trial splits on the first steps, each batch cut when the loop fetches it
            profiler.bind(sampler)
            self._watch_steps()
            batches = ProportionalBatchSampler(sampler)
        return rebuild_loader(dataloader, sampler, sizes[self.global_rank], batch_sampler=batches)

    def eval_sampler(self, dataset: Any) -> UnpaddedDistributedSampler:
        """For evaluation loaders: every sample on one replica, shares following the allocation."""
        return UnpaddedDistributedSampler(dataset, self.policy.eval_weights(), self.global_rank)

    def _profiled_module(self) -> tuple[Module | None, str]:
        return (None if self._ddp_model is None else self._ddp_model.module), type(self.precision).__name__

    def _step_clock(self) -> StepClock | None:
        return self._steps.clock if self.profiling else None

    def _step_split(self) -> StepSplit:
        return self.policy.step_split(self._steps.sampler, self._steps.position()[1])

    def _watch_steps(self) -> None:
        if self.profiling and self._ddp_model is not None:
            self._steps.watch(self._ddp_model, self.root_device, lambda: self._step_split().sizes[self.global_rank])

    @override
    def save_checkpoint(self, path: Any, state: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        comm = self.comm_algorithm
        if comm is not None:  # node_local: the checkpoint holds the consensus model, computed without a sync
            comm.show_consensus()
        try:
            super().save_checkpoint(path, state, *args, **kwargs)
        finally:
            if comm is not None:
                comm.hide_consensus()  # each replica goes on with its own model

    @override
    def teardown(self) -> None:
        self._steps.unwatch()
        self._ddp_model = self._steps.sampler = None
        super().teardown()


class HeterogeneousFabricStrategy(HeterogeneousFabricStrategyMixin, DDPStrategy):
    """The mixin on ``lightning.fabric`` (:mod:`lightning_het.pl`: ``lightning_fabric``)."""

    sampler_wrapper = DistributedSamplerWrapper
