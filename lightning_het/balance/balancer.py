"""The balancer: one strategy's allocation, everything that sets it, and the split of each step.

Owned by the Trainer and the Fabric strategy alike (it takes values and callables, never a strategy);
:class:`~lightning_het.balance.view.BalanceView` is the public, read-only face both show their users.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader

from lightning_het.allocation import allocate_batch_sizes
from lightning_het.balance.clock import StepClock
from lightning_het.balance.cost import AffineCost
from lightning_het.balance.memory import EmulatedMemoryCap, measure_cap
from lightning_het.balance.normalisation import (
    per_replica_batchnorm,
    refuse_single_sample_pieces,
    refuse_synced_norm_in_pieces,
)
from lightning_het.balance.planner import (
    batch_bounds,
    cached_costs,
    measured_speeds,
    profile_cache_entry,
    split_global_batch,
    start_profiler,
    warn_useless_replicas,
)
from lightning_het.balance.profiler import InLoopProfiler
from lightning_het.balance.profiling import ProfileCache
from lightning_het.balance.rebalance import DEFAULT_THRESHOLD, profiled_split
from lightning_het.balance.state import Allocation, render_balance_table
from lightning_het.comm.allreduce import CommAlgorithm
from lightning_het.config import HeterogeneousConfig
from lightning_het.data.microbatch import MicroBatcher
from lightning_het.data.sampler import training_sampler
from lightning_het.data.splitting import TrainingSplit, eval_weights
from lightning_het.reliability.checkpointing import checkpoint_record, log_resumed_allocation, plan_allocation

#: while micro-batching, the replicas agree on their caps every this many steps of an epoch and at its last step
CAPS_AGREED_EVERY = 16


class FitContext:
    """What the balancer needs from the fit that allocates: module, precision, step clock, trainer, devices."""

    def __init__(
        self,
        module: Callable[[], tuple[torch.nn.Module | None, str]],
        clock: Callable[[], StepClock | None],
        labels: list[str],
        trainer: Any = None,
        loop_prefetch: int = 1,
    ) -> None:
        self.module = module
        self.clock = clock
        self.labels = labels
        self.trainer = trainer
        self.loop_prefetch = loop_prefetch


class Balancer:
    """The allocation of one strategy, from its validated keywords (``config``)."""

    def __init__(self, config: HeterogeneousConfig) -> None:
        self.config = config
        self.allocation = Allocation()
        self.node_ids: list[int] | None = None
        self.profiler: InLoopProfiler | None = None
        self.comm: CommAlgorithm | None = None  # the comm algorithm installed for the fit
        self.batchnorm_layers: list[str] = []  # batch norm layers that normalise per replica
        self.rank, self.world_size, self.device, self.replicas_on_node = 0, 1, torch.device("cpu"), 1
        self._comm_sizes: list[int] | None = None  # the split the comm algorithm was last given
        self._cache_loader: DataLoader | None = None  # the training loader the speed cache keys on
        self._fit: FitContext | None = None
        self.micro: MicroBatcher | None = None  # this replica's micro-batching (memory caps), when any is set
        self.memory_emulation: EmulatedMemoryCap | None = None  # emulate_memory_cap: this replica's emulated cap

    def place(self, rank: int, world_size: int, device: torch.device, replicas_on_node: int) -> None:
        """Where this replica runs (once the ranks are known)."""
        self.rank, self.world_size, self.device, self.replicas_on_node = rank, world_size, device, replicas_on_node
        caps, emulated = self.config.max_micro_batch_sizes, self.config.emulate_memory_cap
        if caps is not None or emulated is not None:
            self.micro = MicroBatcher(rank, caps[rank] if isinstance(caps, list) else None)
        if emulated is not None:
            self.memory_emulation = EmulatedMemoryCap(rank, emulated[rank])

    def emulate(self, slowdown: list[float] | None, memory_cap: list[int] | None) -> None:
        """Emulated heterogeneity handed over before the fit's setup (``EmulatedPlatform``): the settings as if given
        as ``emulate_slowdown`` / ``emulate_memory_cap`` (``None``: kept), checked against the world, then placed."""
        config = self.config
        for name, value in (("emulate_slowdown", slowdown), ("emulate_memory_cap", memory_cap)):
            current = getattr(config, name)
            if value is not None and current is not None and list(current) != list(value):
                raise ValueError(
                    f"The strategy was given `{name}={current}` and the EmulatedPlatform callback {value}."
                    f" HINT: drop `{name}` from the strategy (it is deprecated) and keep the callback."
                )
        changed = {
            name: value
            for name, value in (("emulate_slowdown", slowdown), ("emulate_memory_cap", memory_cap))
            if value is not None and getattr(config, name) is None
        }
        if not changed:
            return
        config = dataclasses.replace(config, **changed)
        config.check_world(1, self.world_size)
        self.config = config
        self.place(self.rank, self.world_size, self.device, self.replicas_on_node)

    def check_normalisation(self, module: torch.nn.Module) -> None:
        """The model's batch norm layers, once wrapped: warn about those that normalise per replica (their shares then
        hold 2 samples or more), refuse ``SyncBatchNorm`` with micro-batching, and with batch norm keep every
        micro-batch at 2 samples or more (a cap that cannot is refused)."""
        self.batchnorm_layers = per_replica_batchnorm(module, self.world_size)
        refuse_synced_norm_in_pieces(module, self.world_size, self.micro is not None)
        if self.micro is not None:
            self.micro.min_piece = 2 if self.batchnorm_layers else 1
            refuse_single_sample_pieces(self.batchnorm_layers, self.config.max_micro_batch_sizes, self.micro.least_cap)

    def emulate_memory(self, module: torch.nn.Module | None) -> None:
        """``emulate_memory_cap``: put the emulated cap's hooks on ``module`` (``None``: take them off)."""
        emulation = self.memory_emulation
        if emulation is not None and module is not None:
            emulation.install(module)
        elif emulation is not None:
            emulation.remove()

    @property
    def micro_caps(self) -> list[int] | None:
        """Every replica's micro-batch cap when they are known (given, measured, or agreed after a lowering)."""
        caps = self.config.max_micro_batch_sizes
        return self.allocation.micro_caps or (list(caps) if isinstance(caps, list) else None)

    @property
    def cap_unknown(self) -> bool:
        """``max_micro_batch_sizes="auto"`` and the caps neither cached nor measured yet in this fit."""
        return self.config.max_micro_batch_sizes == "auto" and self.allocation.micro_caps is None

    def _memory_key(self) -> tuple[ProfileCache | None, str | None]:
        cache, key = self.cache_entry()
        emulated = self.config.emulate_memory_cap
        return cache, None if key is None else f"{key}|emulated_memory={emulated[self.rank] if emulated else None}"

    def cached_caps(self) -> None:
        """``"auto"``: every replica's measured cap from the profile cache, when every replica has one (an
        all-gather)."""
        cache, key = self._memory_key()
        if not self.cap_unknown or cache is None or self.world_size == 1:
            return
        cap = cache.get_cap(key) if key is not None else None
        rows = self.all_gather_floats([float(cap or 0)])
        if all(r[0] >= 1 for r in rows):
            self._set_caps([int(r[0]) for r in rows], "from the profile cache")

    def measure_caps(
        self,
        step: Callable[[Any], Any],
        batch: Any,
        no_sync: Callable[[], Any],
        module: Any,
        retry: Callable[[], None] | None = None,
    ) -> None:
        """``"auto"`` on the first training step: each replica's largest micro-batch that fits (trial steps that
        leave the training state unchanged; ``retry()`` after one that ran out of memory), agreed by an all-gather and
        stored in the profile cache; the slowest replica's search time is kept (``micro.search_s``)."""
        micro = self.micro
        assert micro is not None
        upper = self.allocation.global_batch_size or 1
        accelerator = self.device.type == "cuda"
        start = time.perf_counter()
        cap, micro.search_steps = measure_cap(
            step,
            batch,
            upper=upper,
            no_sync=lambda: micro.earlier_piece(no_sync),
            module=module,
            accelerator=accelerator,
            retry=retry,
            least=micro.least_cap,
        )
        cache, key = self._memory_key()
        if cache is not None and key is not None and cap >= 1:
            cache.put_cap(key, cap)
        row = [float(cap), float(micro.search_steps), time.perf_counter() - start]
        rows = self.all_gather_floats(row) if self.world_size > 1 else [row]
        micro.search_s = max(r[2] for r in rows)
        steps = [int(r[1]) for r in rows]
        self._set_caps([int(r[0]) for r in rows], f"measured in {steps} trial steps")

    def _set_caps(self, caps: list[int], source: str) -> None:
        if self.micro is not None:
            least = self.micro.least_cap
            small = [r for r, c in enumerate(caps) if c < least]
            if small:  # every replica sees the same caps: all raise
                norm = " (the model's batch norm layers need micro-batches of 2 samples or more)" if least > 1 else ""
                raise RuntimeError(
                    f"HeterogeneousStrategy: not even a training step of {least} sample(s){norm} fits in the memory"
                    f" of rank(s) {small} (micro-batch caps {caps}, {source}). HINT: free memory on that device,"
                    " shrink the model, or leave the device out of the job."
                )
            self.micro.cap = caps[self.rank]
        self.allocation.micro_caps = caps
        if self.allocation.cost_model is not None:
            self.allocation.cost_model = self.with_caps(self.allocation.cost_model)
        rank_zero_info(f"HeterogeneousStrategy: micro-batch caps {caps} ({source})")

    def with_caps(self, costs: list[AffineCost] | None) -> list[AffineCost] | None:
        """``costs`` with every replica's micro-batch cap (the cost of a share run in pieces)."""
        caps = self.micro_caps
        if costs is None or caps is None:
            return costs
        return [c.with_micro_batch(m) for c, m in zip(costs, caps)]

    def reset(self) -> None:
        """A new fit derives a new allocation."""
        self.allocation.reset()
        self.profiler = None
        self._fit = None
        self._comm_sizes = None  # the next step's split goes to the fit's comm algorithm

    @property
    def min_batch_size(self) -> int:
        """Fewest training samples per replica and step (2 where batch norm trains per replica)."""
        return max(self.config.min_batch_size, 2 if self.batchnorm_layers else 1)

    @property
    def bounds(self) -> dict[str, Any]:
        return batch_bounds(self.min_batch_size, self.config.max_batch_sizes)

    @property
    def profiling(self) -> bool:
        """Whether the first training steps are still profiling (trial splits, costs not agreed yet)."""
        return self.profiler is not None and not self.profiler.done

    # ------------------------------------------------------------------ allocation
    def allocate(
        self,
        dataloader: DataLoader,
        global_batch: int,
        fit: FitContext,
        resume_record: dict[str, Any] | None = None,
    ) -> None:
        """Split ``global_batch`` by the given or resumed speeds, the speed cache, or equally until profiled."""
        self._fit = fit
        world, bounds = self.world_size, self.bounds
        allocate_batch_sizes(global_batch, [1.0] * world, **bounds)  # validates the bounds before any profiling
        resume = plan_allocation(resume_record, world_size=world, given_speeds=self.config.speeds)
        self._cache_loader = dataloader
        self.cached_caps()  # max_micro_batch_sizes="auto": measured in an earlier run
        costs, threshold = None, DEFAULT_THRESHOLD
        if resume.speeds is not None or self.config.speeds is not None:  # the one-number model, proportional split
            speeds = list(resume.speeds if resume.speeds is not None else self.config.speeds)  # type: ignore[arg-type]
        else:
            costs, threshold = self._known_costs(dataloader, global_batch)
            costs = self.with_caps(costs)
            speeds = [1.0] * world  # profiled on the first training steps (or one replica): the equal split till then
        self.allocation.cost_model = costs
        self.allocation.micro_caps = self.micro_caps
        batch_sizes, speeds = split_global_batch(global_batch, speeds, costs, bounds, threshold)
        if costs is not None:
            warn_useless_replicas(global_batch, costs, batch_sizes, fit.labels, bounds)
        self.adopt(batch_sizes, speeds)
        log_resumed_allocation(resume, resume_record, batch_sizes)  # re-balanced or reused on resume
        if self.profiler is None:
            if world > 1:  # one replica: nothing is balanced, nothing to show
                rank_zero_info(self.table(fit.labels))
        else:
            plan = self.profiler.plan
            rank_zero_info(
                f"HeterogeneousStrategy: profiling on the first {plan.gather_step + 1} training steps"
                f" (trial splits); the fitted split applies from step {plan.switch_step}"
            )

    def training_split(self, fit: Callable[[], tuple[FitContext, dict[str, Any] | None]]) -> TrainingSplit:
        """What the loader splitter needs to split a training loader."""
        return TrainingSplit(
            rank=self.rank,
            world_size=self.world_size,
            min_batch_size=self.min_batch_size,
            given_global_batch=self.config.global_batch_size,
            given_speeds=self.config.speeds,
            batch_sizes=lambda: self.allocation.batch_sizes,
            allocate=lambda loader, global_batch, order: self.allocate(loader, global_batch, *fit()),
            adopt=self.adopt,
            profiler=lambda: self.profiler if self.profiling else None,
        )

    def _known_costs(self, dataloader: DataLoader, global_batch: int) -> tuple[list[AffineCost] | None, float]:
        """Every replica's cost from the speed cache and the threshold their profiling split by, or ``None`` (and
        the default threshold) unless every replica has an entry; then the profiler starts."""
        self.allocation.profile_seconds = 0.0
        self.allocation.profile_cached = False
        if self.world_size == 1:
            return None, DEFAULT_THRESHOLD
        self._cache_loader = dataloader
        cached = cached_costs(*self.cache_entry(), self.all_gather_floats)
        if cached is not None:
            self.allocation.profile_cached = True
            return cached
        fit = self._fit
        assert fit is not None

        def clock() -> tuple[int, Any] | None:
            step_clock = fit.clock()
            return None if step_clock is None else step_clock.open_step()

        self.profiler = start_profiler(
            dataloader,
            global_batch,
            self.config,
            self.bounds,
            rank=self.rank,
            world_size=self.world_size,
            device=self.device,
            clock=clock,
            on_agreed=self._adopt_profiled,
            trainer=fit.trainer,
            loop_prefetch=fit.loop_prefetch,
        )
        micro = self.micro
        if micro is not None:
            self.profiler.micro_cap = lambda: micro.cap
        return None, DEFAULT_THRESHOLD

    def cache_entry(self) -> tuple[ProfileCache | None, str | None]:
        """This replica's speed cache and key in it, for the module set up by now (``(None, None)``: none)."""
        if self._cache_loader is None or self._fit is None:
            return None, None
        module, precision = self._fit.module()
        factors = self.config.emulate_slowdown
        return profile_cache_entry(
            self.config.profile_cache,
            module,
            self._cache_loader,
            precision=precision,
            device=self.device,
            slowdown=factors[self.rank] if factors else 1.0,
            replicas_on_node=self.replicas_on_node,
        )

    def _adopt_profiled(self, costs: list[AffineCost], batch_sizes: list[int]) -> None:
        """The profiler agreed on the costs: the fitted split applies to the global batches not drawn yet."""
        assert self.profiler is not None and self._fit is not None
        costs = self.with_caps(costs)  # type: ignore[assignment]
        if self.micro_caps is not None:  # the split that knows each share's micro-batches
            batch_sizes = profiled_split(sum(batch_sizes), costs, threshold=self.profiler.threshold, **self.bounds)
        self.allocation.cost_model = costs
        speeds = measured_speeds(batch_sizes, costs, self.bounds)
        warn_useless_replicas(sum(batch_sizes), costs, batch_sizes, self._fit.labels, self.bounds)
        self.adopt(batch_sizes, speeds)
        for sampler in self.profiler.samplers:
            total = sampler.global_batch_size
            sampler.set_batch_sizes(
                batch_sizes
                if total == sum(batch_sizes)
                else allocate_batch_sizes(total, speeds, min_batch_size=self.min_batch_size)
            )
        self.allocation.profile_seconds = self.profiler.overhead_s
        cache, key = self.cache_entry()
        if cache is not None and key is not None:
            cache.put(key, costs[self.rank], self.profiler.threshold)
        rank_zero_info(self.table(self._fit.labels))

    def adopt(self, batch_sizes: list[int], speeds: list[float], costs: list[dict[str, float]] | None = None) -> None:
        """Make ``batch_sizes`` the allocation (every replica calls it with the same arguments)."""
        self.allocation.adopt(batch_sizes, speeds, self.rank, costs)
        if self.comm is not None:
            self.comm.set_batch_sizes(self.allocation.batch_sizes)
            self._comm_sizes = list(self.allocation.batch_sizes)

    def agree_caps(self, batch_idx: int | None = None, batches: float | None = None) -> None:
        """While micro-batching, at the start of step ``batch_idx`` of an epoch of ``batches``: every
        :data:`CAPS_AGREED_EVERY` steps and at the epoch's last step (before a rebalancing check), a cap that an
        out-of-memory error lowered becomes every replica's view (one all-gather, at the same step on every
        replica), the cost model follows it, and rank 0 logs the new table. The lowered replica runs its new cap
        meanwhile. Without ``batch_idx``: at every call."""
        micro = self.micro
        if micro is None or self.world_size == 1:
            return
        if batch_idx is not None and (batch_idx + 1) % CAPS_AGREED_EVERY and batch_idx + 1 < (batches or math.inf):
            return
        rows = self.all_gather_floats([float(micro.cap or 0), float(micro.pending)])
        if not any(r[1] for r in rows):
            return
        micro.pending = False
        fallback = self.allocation.global_batch_size or 1
        self.allocation.micro_caps = [int(r[0]) or fallback for r in rows]
        if self.allocation.cost_model is not None:
            self.allocation.cost_model = self.with_caps(self.allocation.cost_model)
        lowered = [r for r, row in enumerate(rows) if row[1]]
        rank_zero_warn(
            f"HeterogeneousStrategy: rank(s) {lowered} ran out of memory; micro-batch caps now"
            f" {self.allocation.micro_caps} (the global batch and the exact gradient are unchanged)."
            f" HINT: set `max_micro_batch_sizes={self.allocation.micro_caps}` for the next run."
        )
        if self._fit is not None:
            rank_zero_info(self.table(self._fit.labels))

    def all_gather_floats(self, values: list[float]) -> list[list[float]]:
        gathered = torch.tensor(values, dtype=torch.float64, device=self.device)
        everyone = [torch.zeros_like(gathered) for _ in range(self.world_size)]
        dist.all_gather(everyone, gathered)
        return [t.tolist() for t in everyone]

    def eval_weights(self) -> list[float]:
        return eval_weights(self.allocation.batch_sizes, self.config.speeds, self.world_size)

    # ------------------------------------------------------------------ each step
    def step_split(self, sampler: Any, batch_idx: Callable[[], int | None]) -> list[int]:
        """The split of the global batch being trained now, which the comm algorithm follows."""
        sizes = self.allocation.step_batch_sizes(sampler, batch_idx)
        if self.comm is not None and sizes and sizes != self._comm_sizes:
            self.comm.set_batch_sizes(sizes)
            self._comm_sizes = sizes
        return sizes

    def loss_scale(self, sizes: list[int]) -> float:
        """``W * b_r / B`` for the global batch split as ``sizes``."""
        return self.allocation.step_loss_scale(sizes, self.rank)

    def checkpoint_record(self, trainer: Any) -> dict[str, Any]:
        """The ``checkpoint["lightning_het"]`` record now: the allocation (no speeds while profiling: a resumed fit
        profiles again), the training sampler's place in ``trainer``'s fit and the comm mode's state."""
        speeds = None if self.profiling else self.allocation.speeds
        comm = None if self.comm is None else self.comm.state_dict()
        profiled = self.config.speeds is None
        return checkpoint_record(
            trainer,
            self.allocation.batch_sizes,
            speeds,
            self.node_ids,
            profiled=profiled,
            find_sampler=training_sampler,
            comm=comm,
        )

    # ------------------------------------------------------------------ reporting
    def report(self, labels: list[str], telemetry: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.allocation.report(
            node_ids=self.node_ids,
            profiled=self.config.speeds is None,
            emulate_slowdown=self.config.emulate_slowdown,
            devices=labels,
            telemetry=telemetry,
        )

    def table(self, labels: list[str]) -> str:
        return render_balance_table(self.report(labels))
