"""``Fabric(strategy="heterogeneous")``: speed-proportional batches, exact gradients and node-aware communication in a
loop of your own.

:class:`HeterogeneousFabricStrategy` is the Trainer's :class:`~lightning_het.HeterogeneousStrategy` core (argument
checks, allocation, profiling schedule, loss scale, communication controller, balance report) on top of Lightning
Fabric's ``DDPStrategy``; only the points where Fabric and the Trainer differ are written here:

* ``fabric.setup_dataloaders(loader)`` re-splits a training loader into a
  :class:`~lightning_het.ProportionalDistributedSampler` (same guarantees as with the Trainer: equal step counts,
  the union of the replicas' batches at step ``k`` is the ``k``-th batch of one process);
* ``fabric.backward(loss)`` multiplies the loss by ``loss_scale = W * b_r / B`` (the inherited ``backward``), so the
  step applies exactly the gradient of the mean loss over the global batch;
* ``fabric.setup(model, optimizer)`` wraps the model in DDP and registers the ``comm`` mode's hook on any device;
  every optimizer step then drives the node-local parameter averaging;
* profiling times a step function you pass (``profile_step``), since Fabric has no ``training_step`` to call.

See ``docs/fabric.md`` for a complete example.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from lightning.fabric.utilities.data import has_iterable_dataset
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from torch.utils.data import DataLoader, DistributedSampler
from typing_extensions import override

from lightning_het._compat import flavour_private, inside_fabric_backward
from lightning_het.balance.allocation import allocate_batch_sizes
from lightning_het.balance.cost import AffineCost
from lightning_het.balance.profiling import (
    StepTiming,
    fit_stage_timings,
    preserved_training_state,
    stage_sizes,
    time_steps,
)
from lightning_het.comm.controller import resolve_comm_mode
from lightning_het.data.loaders import rebuild_loader, training_order
from lightning_het.data.sampler import ProportionalDistributedSampler, UnpaddedDistributedSampler
from lightning_het.strategy import HeterogeneousStrategyBase

__all__ = ["HeterogeneousFabricStrategy", "HeterogeneousFabricStrategyBase"]

log = logging.getLogger(__name__)

#: the ``HeterogeneousStrategy`` keywords that mean the same in a Fabric loop; its others (telemetry, rebalancing,
#: emulation, device maps, preemption checkpoints, ...) need the Trainer's loop and are refused
FABRIC_KEYWORDS = frozenset(
    {
        "global_batch_size",
        "speeds",
        "min_batch_size",
        "max_batch_sizes",
        "node_ids",
        "comm",
        "global_sync_every",
        "comm_warmup_steps",
        "comm_autotune_steps",
        "profile_steps",
        "profile_warmup",
        "profile_cache",
        "startup_timeout",
    }
)


def _trainer_only_keywords() -> frozenset[str]:
    parameters = inspect.signature(HeterogeneousStrategyBase.__init__).parameters.values()
    named = {p.name for p in parameters if p.kind is p.KEYWORD_ONLY or p.kind is p.POSITIONAL_OR_KEYWORD}
    return frozenset(named - FABRIC_KEYWORDS - {"self"})


#: ``profile_step(batch)``: forward pass of one training step on a device-ready batch; returns the loss
ProfileStep = Callable[[Any], Tensor]


class HeterogeneousFabricStrategyBase(HeterogeneousStrategyBase):
    """Lightning Fabric strategy: per-replica batch sizes proportional to speed, exact gradients, node-aware comm.

    ``import lightning_het`` registers it as ``"heterogeneous"`` in Fabric's strategy registry, so
    ``Fabric(strategy="heterogeneous", ...)`` works; pass an instance for keywords.

    What it does in your loop:

    * ``fabric.setup(model, optimizer)``: DDP, plus the ``comm`` mode's gradient hook (on CPU/gloo too).
    * ``fabric.setup_dataloaders(train_loader)``: the first time, allocates the global batch from ``speeds`` (or by
      profiling ``profile_step``), then rebuilds the loader around a
      :class:`~lightning_het.ProportionalDistributedSampler` with this replica's batch size. Every loader whose
      sampler Fabric would make distributed (the default ``use_distributed_sampler=True``) is split this way, so
      pass evaluation loaders with ``sampler=strategy.eval_sampler(dataset)`` (each sample on exactly one replica),
      or with ``use_distributed_sampler=False`` (every replica reads all of it).
    * ``fabric.backward(loss)``: back-propagates ``loss * loss_scale``; the loss you log stays unscaled.
    * ``optimizer.step()``: under ``comm="node_local"``, averages the parameters across all replicas every
      ``global_sync_every`` steps and after the last step of every epoch of the training loader (counting one
      optimizer step per batch; call :meth:`synchronize` yourself when you step less often). ``fabric.save`` saves
      the consensus model.

    Args:
        profile_step: ``profile_step(batch) -> loss``: the forward pass of your training step on a batch already on
            the device (for example ``lambda batch: loss_fn(model(batch[0]), batch[1])`` with the model that
            ``fabric.setup`` returned). Used to measure each replica's speed when ``speeds`` is not given: the strategy
            runs it and back-propagates its loss ``profile_warmup + profile_steps`` times on real batches, without
            gradient synchronisation, and restores the model, gradients, optimizer state and RNG streams afterwards.
            Set the model up with ``fabric.setup`` before the training loader.
        **kwargs: the keywords of :class:`~lightning_het.HeterogeneousStrategy`, with the same meaning:
            ``global_batch_size`` (default: the training loader's ``batch_size`` x world size), ``speeds``,
            ``min_batch_size``, ``max_batch_sizes``, ``node_ids``, ``comm``, ``global_sync_every``,
            ``comm_warmup_steps``, ``comm_autotune_steps``, ``profile_steps``, ``profile_warmup``,
            ``profile_cache`` (the speed cache: when every replica finds its cost there, ``profile_step`` is not run),
            ``startup_timeout``; everything else goes to Fabric's ``DDPStrategy`` (``timeout``, ``start_method``,
            ``process_group_backend``, DDP keywords such as ``find_unused_parameters``).

    Raises:
        ValueError: everything ``HeterogeneousStrategy`` checks, a non-callable ``profile_step``, and the
            ``HeterogeneousStrategy`` keywords outside :data:`FABRIC_KEYWORDS` (``emulate_slowdown``, ``device_map``,
            ``cpu_threads``, rebalancing, ``telemetry``, ``preemption_*``: they need the Trainer's loop).
    """

    #: set by the concrete class: the ``DDPStrategy`` of its Fabric package (``lightning.fabric`` and the standalone
    #: ``lightning_fabric`` have separate classes and registries); the package's other pieces (wrappers, samplers, the
    #: spawn launcher) are found from it
    _fabric_ddp_cls: type
    #: your own loop drives the strategy: no Trainer hooks to feed the watchdog; Fabric's own launcher, with the
    #: replicas started so that none outlives the launching process (``lifecycle.fabric_script_launcher``)
    _trainer_loop = False

    @property
    def _fabric(self) -> Any:
        """The next classes in the method order after the shared core: Fabric's ``DDPStrategy`` (of this class's
        package). The core's ``optimizer_step``, ``teardown`` and checkpoint methods serve the Trainer (its signatures
        and loops), so the Fabric overrides that replace them continue past it, through ``super()`` from the core."""
        return super(HeterogeneousStrategyBase, self)

    def _fabric_module(self, name: str) -> ModuleType:
        """``<the Fabric package>.<name>``, e.g. ``lightning.fabric.wrappers`` or ``lightning_fabric.wrappers``."""
        package = self._fabric_ddp_cls.__module__.split(".strategies")[0]
        return importlib.import_module(f"{package}.{name}")

    @property
    def _spawn_launcher_cls(self) -> type:  # type: ignore[override]
        package = self._fabric_ddp_cls.__module__.split(".strategies")[0]
        return flavour_private(package, "strategies.launchers.multiprocessing", "_MultiProcessingLauncher")

    @property
    def _sampler_wrapper_cls(self) -> type:
        return self._fabric_module("utilities.distributed").DistributedSamplerWrapper

    def __init__(self, profile_step: ProfileStep | None = None, **kwargs: Any) -> None:
        unsupported = sorted(_trainer_only_keywords().intersection(kwargs))
        if unsupported:
            raise ValueError(
                f"You passed {unsupported} to HeterogeneousFabricStrategy, but they need the Trainer's loop. HINT: use"
                " `lightning.Trainer(strategy=HeterogeneousStrategy(...))`, or emulate a slow replica inside your own"
                " step function."
            )
        if profile_step is not None and not callable(profile_step):
            raise ValueError(
                f"Expected argument `profile_step` to be a callable `profile_step(batch) -> loss`, but got"
                f" {profile_step!r}."
            )
        super().__init__(telemetry=False, **kwargs)  # the shared core validates and stores every other keyword
        self.profile_step = profile_step
        self._ddp_model: DistributedDataParallel | None = None  # the model `fabric.setup` wrapped (one per strategy)
        self._raw_optimizers: list[Optimizer] = []  # snapshotted and restored around profiling
        self._optimizer_steps = 0  # optimizer steps taken so far (drives the node_local schedule)
        self._steps_per_epoch: int | None = None  # global batches per epoch of the training loader

    # ------------------------------------------------------------------ launch / environment
    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if self._start_method == "popen":  # no orphans: see lightning_het.reliability.lifecycle.fabric_script_launcher
            from lightning_het.reliability.lifecycle import fabric_script_launcher

            self._launcher = fabric_script_launcher(self, self._launcher)

    @override
    def _setup_distributed(self) -> None:
        # a short `timeout` does not fail the rendezvous of replicas that start slowly
        with self._startup_timeout_scope():
            super()._setup_distributed()

    # ------------------------------------------------------------------ model and optimizers
    @override
    def setup_module(self, module: Module) -> DistributedDataParallel:
        """Wrap ``module`` in DDP and register the ``comm`` mode's gradient hook (a collective: every rank)."""
        if self._ddp_model is not None:
            raise RuntimeError(
                "HeterogeneousFabricStrategy handles one model, but `fabric.setup` was called for a second one."
                " HINT: put the networks into one `nn.Module` and set that up once."
            )
        ddp_model = super().setup_module(module)
        assert self._node_ids is not None
        self._comm_controller = self._new_comm_controller(resolve_comm_mode(self._config.comm, self._node_ids))
        self._comm_controller.register(ddp_model)
        self._ddp_model = ddp_model
        return ddp_model

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        self._raw_optimizers.append(optimizer)
        return super().setup_optimizer(optimizer)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        output = self._fabric.optimizer_step(optimizer, **kwargs)
        self._optimizer_steps += 1
        if self._comm_controller is not None and self._ddp_model is not None:
            epoch_steps = self._steps_per_epoch
            with torch.no_grad():
                self._comm_controller.after_optimizer_step(
                    self._ddp_model.module.parameters(),
                    self._optimizer_steps,
                    end_of_epoch=bool(epoch_steps) and self._optimizer_steps % epoch_steps == 0,
                )
        return output

    def synchronize(self) -> bool:
        """``comm="node_local"``: average the parameters across all replicas now, weighted by sample share, unless
        they already agree. Call it on every rank (a collective), e.g. before evaluating. No-op in exact modes.

        Returns:
            Whether an average ran.
        """
        if self._comm_controller is None or self._ddp_model is None:
            return False
        with torch.no_grad():
            return self._comm_controller.synchronize(self._ddp_model.module.parameters())

    # ------------------------------------------------------------------ data
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
        if isinstance(sampler, ProportionalDistributedSampler):
            return self._adopt_sampler(dataloader, sampler)
        if type(sampler) is not DistributedSampler and not isinstance(sampler, self._sampler_wrapper_cls):
            return dataloader  # the user's own distributed sampler, e.g. `eval_sampler`
        if self._steps_per_epoch is not None:
            # a second split could re-allocate, changing the loss scale under the first loader's batches
            raise ValueError(
                "HeterogeneousFabricStrategy has already split a training loader, and this loader would be split as"
                " a second one (its sampler is Fabric's distributed sampler). HINT: set evaluation loaders up with"
                " `sampler=strategy.eval_sampler(dataset)` (each sample on one replica) or with"
                " `fabric.setup_dataloaders(loader, use_distributed_sampler=False)` (every replica reads it all)."
            )
        return self._split_for_training(dataloader)

    def eval_sampler(self, dataset: Any) -> UnpaddedDistributedSampler:
        """A sampler for evaluation loaders: every sample on exactly one replica (no padding, no duplicates), shares
        proportional to the allocation (to ``speeds``, or equal, before it). Fabric leaves it in place."""
        return UnpaddedDistributedSampler(dataset, self._eval_weights(), self.global_rank)

    def _adopt_sampler(self, dataloader: DataLoader, sampler: ProportionalDistributedSampler) -> DataLoader:
        sizes = list(sampler.batch_sizes)
        if self._allocation.batch_sizes is not None and sizes != self._allocation.batch_sizes:
            raise ValueError(
                f"The DataLoader's ProportionalDistributedSampler has batch_sizes={sizes}, but the strategy allocated"
                f" {self._allocation.batch_sizes}. HINT: build it from `strategy.batch_sizes`."
            )
        if sampler.tail_batch_sizes is not None:
            raise ValueError(
                f"The DataLoader's ProportionalDistributedSampler trains the tail as a last, smaller global batch"
                f" ({sampler.tail_batch_sizes}), whose loss scale HeterogeneousFabricStrategy cannot know in your loop."
                " HINT: build it with `drop_last=True`."
            )
        self.adopt_allocation(sizes, self._config.speeds or [float(b) for b in sizes])
        self._steps_per_epoch = sampler.num_steps
        return dataloader

    def _split_for_training(self, dataloader: DataLoader) -> DataLoader:
        """Allocate (profiling when needed) and rebuild the loader around this replica's proportional sampler."""
        order = training_order(dataloader)
        global_batch = self._config.global_batch_size
        if global_batch is None:
            if dataloader.batch_size is None:
                raise ValueError(
                    "The DataLoader has no `batch_size`, so the global batch cannot be inferred. HINT: pass"
                    " `HeterogeneousFabricStrategy(global_batch_size=...)`."
                )
            global_batch = dataloader.batch_size * self.world_size
        if self._allocation.batch_sizes is None or sum(self._allocation.batch_sizes) != global_batch:
            self._allocate(dataloader, global_batch, order.shuffle, order.seed, order.sampler)
        assert self._allocation.batch_sizes is not None
        # the tail is dropped under Fabric: its step would need its own loss scale, and the strategy cannot tell
        # which of your steps it is
        sampler = ProportionalDistributedSampler(
            dataloader.dataset,
            self._allocation.batch_sizes,
            self.global_rank,
            shuffle=order.shuffle,
            seed=order.seed,
            drop_last=True,
            order_sampler=order.sampler,
        )
        self._steps_per_epoch = sampler.num_steps
        return rebuild_loader(dataloader, sampler, self._allocation.batch_sizes[self.global_rank])

    # ------------------------------------------------------------------ profiling
    @override
    def _measured_costs(
        self, dataloader: DataLoader, global_batch: int, shuffle: bool, seed: int, order_sampler: Any = None
    ) -> list[AffineCost] | None:
        """Every replica's :class:`~lightning_het.balance.cost.AffineCost`: from the speed cache when every replica
        has an entry, else profiled before the loop runs (Fabric has no loop of ours to profile in): a warm-up, then
        two timed stages of ``profile_step`` (see :mod:`lightning_het.balance.profiling`)."""
        start = time.perf_counter()
        self._allocation.profile_seconds = 0.0
        self._allocation.profile_cached = False
        cached = self._cached_costs(dataloader)
        if cached is not None:
            self._allocation.profile_seconds = time.perf_counter() - start
            return cached
        world, rank = self.world_size, self.global_rank
        bounds = {"min_batch_size": self._train_min_batch_size, "max_batch_sizes": self._config.max_batch_sizes}
        equal_split = allocate_batch_sizes(global_batch, [1.0] * world, **bounds)
        rough = [1.0] * world
        if self._config.profile_warmup:
            # a quarter of the equal split: the slowest replica's warm-up costs a quarter of a DDP step
            warm_sizes = [max(self._train_min_batch_size, 1, -(-b // 4)) for b in equal_split]
            warm = self._time_local_steps(
                dataloader, warm_sizes, shuffle, seed, steps=self._config.profile_warmup, order=order_sampler
            )
            local = warm_sizes[rank] / max(min(t.total_s for t in warm), 1e-9)
            rough = [r[0] for r in self._all_gather_floats([local])]
        small, large = stage_sizes(global_batch, rough, **bounds)
        if sum(large) > len(dataloader.dataset):  # a dataset barely above one global batch: one stage size only
            large = small
        stages = [
            (
                sizes[rank],
                self._time_local_steps(
                    dataloader, sizes, shuffle, seed, steps=self._config.profile_steps, order=order_sampler
                ),
            )
            for sizes in (small, large)
        ]
        cost = fit_stage_timings(stages)
        rows = self._all_gather_floats([cost.fixed_s, cost.per_sample_s])
        cache, key = self._cache_entry
        if cache is not None and key is not None:
            cache.put(key, cost)
        self._allocation.profile_seconds = time.perf_counter() - start
        return [AffineCost(r[0], r[1]) for r in rows]

    def _time_local_steps(
        self,
        dataloader: DataLoader,
        probe_sizes: list[int],
        shuffle: bool,
        seed: int,
        *,
        steps: int,
        order: Any = None,
    ) -> list[StepTiming]:
        """Time ``steps`` local steps of this replica at ``probe_sizes[rank]`` samples; ``order``: the user's sampler
        whose order the training batches are cut from."""
        rank = self.global_rank
        sampler = ProportionalDistributedSampler(
            dataloader.dataset, probe_sizes, rank, shuffle=shuffle, seed=seed, drop_last=True, order_sampler=order
        )
        # the main process loads the few probe batches: no worker start-up; the multiprocessing-only options go too
        single_process = (
            {"num_workers": 0, "persistent_workers": False, "prefetch_factor": None, "multiprocessing_context": None}
            if dataloader.num_workers > 0
            else {}
        )
        probe = rebuild_loader(dataloader, sampler, probe_sizes[rank], **single_process)
        return self._time_probe_steps(probe, steps)

    def _align_profiling_step(self) -> None:
        """Every replica starts its next profiling step together (see :func:`time_steps`)."""
        self.barrier("lightning_het.profiling_step")

    def _time_probe_steps(self, probe: DataLoader, steps: int) -> list[StepTiming]:
        """Time ``steps`` calls of ``profile_step`` (forward) plus the backward of its loss, without gradient sync."""
        if self.profile_step is None:
            raise ValueError(
                "HeterogeneousFabricStrategy has neither `speeds` nor a `profile_step` to measure them with. HINT: pass"
                " `profile_step=lambda batch: loss_fn(model(batch[0]), batch[1])` (after `fabric.setup`), or"
                " `speeds=[...]` with one entry per replica."
            )
        if self._ddp_model is None:
            raise RuntimeError(
                "Profiling needs the model: call `fabric.setup(model, optimizer)` before"
                " `fabric.setup_dataloaders(train_loader)`, or pass `speeds=[...]`."
            )
        model = self._ddp_model
        step = self.profile_step
        batches = (self.batch_to_device(batch) for batch in probe)
        with preserved_training_state(model.module, self._raw_optimizers), model.no_sync():
            model.train()
            return time_steps(
                batches,
                lambda batch, batch_idx: step(batch),
                self._local_backward,
                warmup=0,
                steps=steps,
                device=self.root_device,
                align=self._align_profiling_step if self.world_size > 1 else None,
            )

    def _local_backward(self, loss: Tensor) -> None:
        """``loss.backward()`` while Fabric believes it runs inside ``fabric.backward`` (profiling only): Fabric refuses
        a bare ``loss.backward()`` for strategies that override ``backward``, and profiling wants exactly that."""
        with inside_fabric_backward(self._fabric_module("wrappers")):
            loss.backward()

    @override
    def _profiled_module(self) -> tuple[torch.nn.Module | None, str]:
        return (None if self._ddp_model is None else self._ddp_model.module), type(self.precision).__name__

    # ------------------------------------------------------------------ checkpoints and teardown
    @override
    def save_checkpoint(
        self,
        path: Any,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        self.synchronize()  # comm="node_local": a checkpoint holds the consensus model
        self._fabric.save_checkpoint(path, state, storage_options=storage_options, filter=filter)

    @override
    def load_checkpoint(self, path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self._fabric.load_checkpoint(path, *args, **kwargs)

    @override
    def teardown(self) -> None:
        if self._comm_controller is not None:
            self._comm_controller.close()
        self._comm_controller = None
        self._ddp_model = None
        self._raw_optimizers = []
        self._fabric.teardown()


class HeterogeneousFabricStrategy(HeterogeneousFabricStrategyBase, FabricDDPStrategy):
    __doc__ = HeterogeneousFabricStrategyBase.__doc__
    _fabric_ddp_cls = FabricDDPStrategy
