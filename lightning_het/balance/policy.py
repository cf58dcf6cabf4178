"""The allocation (an immutable value) and the balancing policy that derives it from keywords, cache or profiling."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.utils.data import DataLoader

from lightning_het.allocation import allocate_batch_sizes, loss_scale
from lightning_het.balance import profiler as profiling
from lightning_het.balance.clock import StepClock
from lightning_het.balance.cost import AffineCost, useless_replica_message
from lightning_het.balance.memory import EmulatedMemoryCap, measure_cap
from lightning_het.balance.rebalance import DEFAULT_THRESHOLD, profiled_split
from lightning_het.balance.report import render_balance_table
from lightning_het.comm.allreduce import CommAlgorithm
from lightning_het.config import HeterogeneousConfig
from lightning_het.data.microbatch import MicroBatcher
from lightning_het.reliability.checkpointing import log_resumed_allocation, plan_allocation

#: while micro-batching, the replicas agree on their caps every this many steps of an epoch and at its last step
CAPS_AGREED_EVERY = 16
#: torch's batch norm layers (they share only a private base class)
_BATCH_NORMS = (*(getattr(nn, f"{lazy}BatchNorm{d}d") for lazy in ("", "Lazy") for d in (1, 2, 3)), nn.SyncBatchNorm)


class StepSplit(NamedTuple):
    """The split of the global batch being trained, computed once at the batch's start."""

    sizes: list[int]
    loss_scale: float  # ``W * b_r / B`` of this replica


@dataclass(frozen=True)
class Allocation:
    """Samples per step and speed (samples/s when measured) of every replica by global rank, the affine costs behind
    them, the micro-batch caps, and the profiling's cost; ``batch_sizes=None``: not allocated yet (plain DDP)."""

    batch_sizes: list[int] | None = None
    speeds: list[float] | None = None
    cost_model: list[AffineCost] | None = None
    micro_caps: list[int] | None = None  # most samples each replica runs at once (None: its whole share)
    profile_seconds: float = 0.0  # estimated seconds the profiling steps cost beyond balanced ones
    profile_cached: bool = False  # the costs came from the speed cache

    @property
    def global_batch_size(self) -> int | None:
        return sum(self.batch_sizes) if self.batch_sizes else None

    def adopt(self, batch_sizes: list[int], speeds: list[float], costs: list[dict[str, float]] | None = None) -> Any:
        """This allocation with ``batch_sizes`` and ``speeds`` (and refreshed ``costs``, ``AffineCost.as_dict()``)."""
        model = [AffineCost.from_dict(c) for c in costs] if costs is not None else self.cost_model
        return replace(self, batch_sizes=list(batch_sizes), speeds=list(speeds), cost_model=model)

    def with_caps(self, caps: list[int] | None) -> Allocation:
        """This allocation with micro-batch ``caps``, which its cost model follows (a share run in pieces)."""
        costs = self.cost_model
        if costs is not None and caps is not None:
            costs = [replace(c, micro_batch=m) for c, m in zip(costs, caps)]
        return replace(self, micro_caps=caps, cost_model=costs)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Allocation:
        known = {f.name: data[f.name] for f in fields(cls) if data.get(f.name) is not None}
        costs = known.pop("cost_model", None)
        return cls(**known, cost_model=[AffineCost.from_dict(c) for c in costs] if costs else None)


class FitContext(NamedTuple):
    """What allocating needs from the fit: its module and precision, step clock, device labels."""

    module: Callable[[], tuple[nn.Module | None, str]]
    clock: Callable[[], StepClock | None]
    labels: list[str]
    loop_prefetch: int = 1
    report: Callable[[], dict[str, Any]] = dict  # the balance report, for the table logged on a new allocation


def _shown(names: list[str]) -> str:
    return ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")


class BalancePolicy:
    """Profiling, allocation and the caps of one strategy on one replica, from its validated keywords."""

    def __init__(self, config: HeterogeneousConfig) -> None:
        self.config = config
        self.allocation = Allocation()
        self.profiler: profiling.InLoopProfiler | None = None
        self.batchnorm_layers: list[str] = []  # batch norm layers that normalise per replica
        self.rank, self.world_size, self.device, self.replicas_on_node = 0, 1, torch.device("cpu"), 1
        self.micro: MicroBatcher | None = None  # this replica's micro-batching (memory caps), when any is set
        self.memory_emulation: EmulatedMemoryCap | None = None  # emulate_memory_cap: this replica's emulated cap
        self._cache_loader: DataLoader | None = None  # the training loader the speed cache keys on
        self._fit: FitContext | None = None
        self._split: StepSplit | None = None  # the last step's split (handed out again while it holds)

    def place(self, rank: int, world_size: int, device: torch.device, replicas_on_node: int) -> None:
        """Where this replica runs (once the ranks are known)."""
        self.rank, self.world_size, self.device, self.replicas_on_node = rank, world_size, device, replicas_on_node
        self._split = None
        caps, emulated = self.config.max_micro_batch_sizes, self.config.emulate_memory_cap
        if caps is not None or emulated is not None:
            self.micro = MicroBatcher(rank, caps[rank] if isinstance(caps, list) else None)
        if emulated is not None:
            self.memory_emulation = EmulatedMemoryCap(rank, emulated[rank])

    def emulate(self, slowdown: list[float] | None, memory_cap: list[int] | None) -> None:
        """``EmulatedPlatform``'s settings, as if given as ``emulate_slowdown`` / ``emulate_memory_cap``."""
        given = {n: v for n, v in (("emulate_slowdown", slowdown), ("emulate_memory_cap", memory_cap)) if v is not None}
        for name, value in given.items():
            current = getattr(self.config, name)
            if current is not None and list(current) != list(value):
                raise ValueError(
                    f"The strategy was given `{name}={current}` and the EmulatedPlatform callback {value}."
                    f" HINT: drop `{name}` from the strategy (it is deprecated) and keep the callback."
                )
        if given:  # before the fit's setup: the replica is placed again with them
            self.config = replace(self.config, **given)
            self.config.check_world(1, self.world_size)
            self.place(self.rank, self.world_size, self.device, self.replicas_on_node)

    def check_normalisation(self, module: nn.Module) -> None:
        """Warn about per-replica batch norm (2 samples per share then), refuse it where micro-batches break it."""
        norms = {n: isinstance(m, nn.SyncBatchNorm) for n, m in module.named_modules() if isinstance(m, _BATCH_NORMS)}
        layers = self.batchnorm_layers = [name for name, synced in norms.items() if not synced]
        synced = [name for name, s in norms.items() if s] if self.micro is not None and self.world_size > 1 else []
        if layers and self.world_size > 1:
            rank_zero_warn(
                f"The model has {len(layers)} batch norm layer(s) ({_shown(layers)}) that normalise each replica's"
                " batch: with uneven batches the gradient is not exactly the global batch's, and every replica gets 2"
                " samples or more per step. HINT: `Trainer(sync_batchnorm=True)` (not with micro-batching)."
            )
        if synced:  # a collective in every forward: replicas running different numbers of pieces would mismatch
            raise ValueError(
                f"`max_micro_batch_sizes` (or `emulate_memory_cap`) runs a share as several forward passes, but the"
                f" model's SyncBatchNorm layer(s) ({_shown(synced)}) make each a collective every replica must run"
                " equally often. HINT: drop `Trainer(sync_batchnorm=True)`, or bound the shares by `max_batch_sizes`."
            )
        if self.micro is None:
            return
        self.micro.min_piece = 2 if layers else 1
        caps, least = self.config.max_micro_batch_sizes, self.micro.least_cap
        small = [(r, c) for r, c in enumerate(caps if isinstance(caps, list) else []) if c < least]
        if layers and small:  # a cap of 2 splits a share of 3 as [2, 1]: batch norm cannot train on 1 sample
            rank, cap = small[0]
            raise ValueError(
                f"`max_micro_batch_sizes[{rank}]` is {cap}, but the model's batch norm layer(s) ({_shown(layers)}) need"
                f" 2 samples or more per micro-batch, and pieces of {cap} can leave one of 1 (3 samples run as [2, 1])."
                f" HINT: set `max_micro_batch_sizes[{rank}]` to {least} or more, or bound the share: `max_batch_sizes`."
            )

    def emulate_memory(self, module: nn.Module | None) -> None:
        """``emulate_memory_cap``: put the emulated cap's hooks on ``module`` (``None``: take them off)."""
        if self.memory_emulation is not None:
            self.memory_emulation.install(module)

    def reset(self) -> None:
        """A new fit derives a new allocation (measured caps are kept)."""
        self.allocation = Allocation(micro_caps=self.allocation.micro_caps)
        self.profiler = self._fit = None

    @property
    def min_batch_size(self) -> int:
        """Fewest training samples per replica and step (2 where batch norm trains per replica)."""
        return max(self.config.min_batch_size, 2 if self.batchnorm_layers else 1)

    @property
    def bounds(self) -> dict[str, Any]:
        return {"min_batch_size": self.min_batch_size, "max_batch_sizes": self.config.max_batch_sizes}

    @property
    def profiling(self) -> bool:
        """Whether the first training steps are still profiling."""
        return self.profiler is not None and not self.profiler.done

    @property
    def cap_unknown(self) -> bool:
        """``max_micro_batch_sizes="auto"`` and the caps neither cached nor measured yet."""
        return self.config.max_micro_batch_sizes == "auto" and self.allocation.micro_caps is None

    def gather(self, values: list[float]) -> list[list[float]]:
        """Every replica's ``values`` (a collective)."""
        gathered = torch.tensor(values, dtype=torch.float64, device=self.device)
        everyone = [torch.zeros_like(gathered) for _ in range(self.world_size)]
        dist.all_gather(everyone, gathered)
        return [t.tolist() for t in everyone]

    def eval_weights(self) -> list[float]:
        """Each replica's share of an evaluation set: the allocation, else the given speeds, else equal."""
        return [float(w) for w in self.allocation.batch_sizes or self.config.speeds or [1.0] * self.world_size]

    def step_split(self, sampler: Any, step: int | None) -> StepSplit:
        """The split of global batch ``step``: the allocation, or its ``sampler``'s profiling split or tail."""
        sizes = self.allocation.batch_sizes or []  # not copied: once per step, read only
        if sampler is not None and step is not None and sampler.batch_sizes == sizes:
            sizes = sampler.step_batch_sizes(step)
        if self._split is None or self._split.sizes != sizes:  # else the last step's object (for the same rank)
            self._split = StepSplit(sizes, loss_scale(sizes, self.rank) if sizes else 1.0)
        return self._split

    def adopt(self, batch_sizes: list[int], speeds: list[float], costs: list[dict[str, float]] | None = None) -> None:
        """Make ``batch_sizes`` the allocation (every replica calls it with the same arguments)."""
        self.allocation = self.allocation.adopt(batch_sizes, speeds, costs)

    def table(self) -> str:
        assert self._fit is not None
        return render_balance_table(self._fit.report())

    def sizes_for(
        self, dataloader: DataLoader, global_batch: int, fit: FitContext, resume: dict | None = None
    ) -> list[int]:
        """The allocation's split of ``global_batch``; when there is none or it has another total, allocated first by
        the given or resumed speeds, the speed cache, or equally until the first training steps are profiled."""
        if self.allocation.global_batch_size == global_batch:
            return list(self.allocation.batch_sizes or ())
        self._fit, self._cache_loader = fit, dataloader
        world, bounds, given = self.world_size, self.bounds, self.config.max_micro_batch_sizes
        sizes = allocate_batch_sizes(global_batch, [1.0] * world, **bounds)  # checks the bounds before profiling
        plan = plan_allocation(resume, world_size=world, given_speeds=self.config.speeds)
        cache, key = self.cache_entry(memory=True)
        if self.cap_unknown and cache is not None and world > 1:  # "auto": the caps every replica has cached
            rows = self.gather([float((cache.get(key)["cap"] if key is not None else None) or 0)])
            if all(r[0] >= 1 for r in rows):
                self._set_caps([int(r[0]) for r in rows], "from the profile cache")
        caps = self.allocation.micro_caps or (given if isinstance(given, list) else None)
        speeds = plan.speeds if plan.speeds is not None else self.config.speeds
        costs, threshold = None, DEFAULT_THRESHOLD
        if speeds is None and world > 1 and cache is not None:  # the speed cache, when every replica has its cost
            record = cache.get(self.cache_entry()[1] or "")
            cost, cached = record["cost"], record["threshold"] or DEFAULT_THRESHOLD
            rows = self.gather([1.0, cost.fixed_s, cost.per_sample_s, cached] if cost else [0.0] * 4)
            if all(r[0] == 1.0 for r in rows):
                costs, threshold = [AffineCost(r[1], r[2]) for r in rows], max(r[3] for r in rows)
        self.allocation = Allocation(cost_model=costs, profile_cached=costs is not None).with_caps(caps)
        if self.allocation.cost_model is not None:
            sizes = profiled_split(global_batch, self.allocation.cost_model, threshold=threshold, **bounds)
            speeds = self.measured_speeds(self.allocation.cost_model, sizes)
        elif speeds is not None:
            sizes = allocate_batch_sizes(global_batch, speeds, **bounds)
        else:  # the equal split, profiled on the first training steps (one replica: nothing to balance)
            speeds = [1.0] * world
            if world > 1:  # the fit loop hands the profiler every step's end
                lag = profiling.loader_prefetch_depth(dataloader, fit.loop_prefetch)
                steps = {"warmup": self.config.profiling.warmup, "steps": self.config.profiling.steps, "lag": lag}
                schedule = profiling.ProfilePlan(global_batch, world, **steps, **bounds)
                clock = lambda: None if fit.clock() is None else fit.clock().open_step()  # noqa: E731
                self.profiler = profiling.InLoopProfiler(schedule, self.rank, self.gather, clock, self._profiled)
                self.profiler.micro_cap = lambda: self.micro.cap if self.micro is not None else None
                rank_zero_info(
                    f"HeterogeneousStrategy: profiling on the first {schedule.gather_step + 1} training steps (the"
                    f" equal, then the rough split); the fitted split applies from step {schedule.switch_step}"
                )
        self.adopt(sizes, speeds)
        log_resumed_allocation(plan, resume, sizes)  # re-balanced or reused on resume
        if self.profiler is None and world > 1:  # one replica: nothing is balanced, nothing to show
            rank_zero_info(self.table())
        return list(sizes)

    def measured_speeds(self, costs: list[AffineCost], sizes: list[int]) -> list[float]:
        """Samples/s of every replica at a profiled split, such that pinning them splits the same way again (the equal
        split: one speed, the mean; a split they would not give: their total shared in its proportions), with a warning
        naming the replicas that only slow the step down."""
        labels, total = self._fit.labels if self._fit else [], sum(sizes)
        if message := useless_replica_message(total, costs, sizes, labels, **self.bounds):
            rank_zero_warn(message)
        speeds = [b / max(c(b), 1e-12) for b, c in zip(sizes, costs)]
        if sizes == allocate_batch_sizes(total, [1.0] * len(sizes), **self.bounds):
            return [sum(speeds) / len(speeds)] * len(speeds)
        if allocate_batch_sizes(total, speeds, **self.bounds) != sizes:  # fixed costs make the split non-proportional
            return [b * sum(speeds) / total for b in sizes]
        return speeds

    def cache_entry(self, memory: bool = False) -> tuple[profiling.ProfileCache | None, str | None]:
        """This replica's speed cache and key in it (``memory``: its cap's); ``(None, None)``: off, or no key yet."""
        setting = self.config.profiling.cache
        module, precision = self._fit.module() if self._fit is not None else (None, "")
        if setting in (None, False) or module is None or self._cache_loader is None:
            return None, None
        cache = profiling.ProfileCache(None if setting is True else setting)  # type: ignore[arg-type]
        try:
            sample = self._cache_loader.dataset[0]
        except Exception:  # a dataset we cannot peek into is simply not cached
            return cache, None
        slowdown, emulated = self.config.emulate_slowdown, self.config.emulate_memory_cap
        extra = {"precision": precision, "slowdown": slowdown[self.rank] if slowdown else 1.0}
        key = profiling.cache_key(module, self.device, sample, **extra, replicas_on_node=self.replicas_on_node)
        return cache, f"{key}|emulated_memory={emulated[self.rank] if emulated else None}" if memory else key

    def _profiled(self, costs: list[AffineCost], batch_sizes: list[int]) -> None:
        """The profiler agreed on the costs: the fitted split applies to the global batches not drawn yet."""
        assert self.profiler is not None
        caps = self.allocation.micro_caps
        if caps is not None:  # the split that knows each share's micro-batches
            costs = [replace(c, micro_batch=m) for c, m in zip(costs, caps)]
            batch_sizes = profiled_split(sum(batch_sizes), costs, threshold=self.profiler.threshold, **self.bounds)
        speeds = self.measured_speeds(costs, batch_sizes)
        overhead = self.profiler.overhead_s
        self.allocation = replace(self.allocation, cost_model=costs, profile_seconds=overhead).adopt(
            batch_sizes, speeds
        )
        for sampler in self.profiler.samplers:
            total = sampler.global_batch_size
            other = allocate_batch_sizes(total, speeds, min_batch_size=self.min_batch_size)
            sampler.set_batch_sizes(batch_sizes if total == sum(batch_sizes) else other)
        cache, key = self.cache_entry()
        if cache is not None and key is not None:
            cache.put(key, cost=costs[self.rank], threshold=self.profiler.threshold)
        rank_zero_info(self.table())

    def measure_caps(self, step: Callable[[Any], Any], batch: Any, no_sync: Any, module: nn.Module) -> None:
        """``"auto"`` on the first training step: each replica's largest micro-batch that fits, agreed by an all-gather
        and stored in the profile cache (``micro.search_s``: the slowest replica's search time)."""
        micro, start = self.micro, time.perf_counter()
        assert micro is not None
        upper, cuda = self.allocation.global_batch_size or 1, self.device.type == "cuda"
        pieces = lambda: micro.earlier_piece(no_sync)  # noqa: E731
        cap, micro.search_steps = measure_cap(step, batch, upper, pieces, module, cuda, micro.least_cap)
        cache, key = self.cache_entry(memory=True)
        if cache is not None and key is not None and cap >= 1:
            cache.put(key, cap=cap)
        row = [float(cap), float(micro.search_steps), time.perf_counter() - start]
        rows = self.gather(row) if self.world_size > 1 else [row]
        micro.search_s = max(r[2] for r in rows)
        self._set_caps([int(r[0]) for r in rows], f"measured in {[int(r[1]) for r in rows]} trial steps")

    def _set_caps(self, caps: list[int], source: str) -> None:
        """``caps`` measured or cached: every replica's micro-batches, or (one too small) the same error everywhere."""
        assert self.micro is not None
        least = self.micro.least_cap
        small = [r for r, c in enumerate(caps) if c < least]
        if small:
            norm = " (the model's batch norm layers need micro-batches of 2 samples or more)" if least > 1 else ""
            raise RuntimeError(
                f"HeterogeneousStrategy: not even a training step of {least} sample(s){norm} fits in the memory"
                f" of rank(s) {small} (micro-batch caps {caps}, {source}). HINT: free memory on that device,"
                " shrink the model, or leave the device out of the job."
            )
        self.micro.cap = caps[self.rank]
        self.allocation = self.allocation.with_caps(caps)
        rank_zero_info(f"HeterogeneousStrategy: micro-batch caps {caps} ({source})")

    def agree_caps(self, batch_idx: int | None = None, batches: float | None = None) -> None:
        """While micro-batching, every :data:`CAPS_AGREED_EVERY` steps of an epoch and at its last: a cap that an
        out-of-memory error lowered becomes every replica's (one all-gather, the same step everywhere)."""
        micro, step = self.micro, None if batch_idx is None else batch_idx + 1
        between = step is not None and step % CAPS_AGREED_EVERY and step < (batches or math.inf)
        if micro is None or self.world_size == 1 or between:
            return
        rows = self.gather([float(micro.cap or 0), float(micro.pending)])
        if not any(r[1] for r in rows):
            return
        micro.pending = False
        caps = [int(r[0]) or self.allocation.global_batch_size or 1 for r in rows]
        rank_zero_warn(
            f"HeterogeneousStrategy: rank(s) {[r for r, row in enumerate(rows) if row[1]]} ran out of memory;"
            f" micro-batch caps now {caps} (the global batch and the exact gradient are unchanged). HINT: set"
            f" `max_micro_batch_sizes={caps}` for the next run."
        )
        self.allocation = self.allocation.with_caps(caps)
        if self._fit is not None:
            rank_zero_info(self.table())


def _read(read: Callable[[BalanceView], Any], doc: str | None = None) -> Any:
    """A read-only attribute of the strategy: ``read(strategy)`` (a list copied)."""

    def get(strategy: BalanceView) -> Any:
        value = read(strategy)
        return list(value) if isinstance(value, list) else value

    return property(get, doc=doc)


class BalanceView:
    """The public, read-only balancing state of a heterogeneous strategy (``None`` before the allocation is known)."""

    policy: BalancePolicy
    comm_algorithm: CommAlgorithm | None = None  # the comm algorithm installed for this replica's fit
    _node_ids: list[int] | None = None

    config = _read(lambda s: s.policy.config, "The validated keywords of this strategy (frozen).")
    batch_sizes = _read(lambda s: s.policy.allocation.batch_sizes, "Samples per step of every replica, by global rank.")
    local_batch_size = _read(lambda s: s.batch_sizes[s.policy.rank] if s.batch_sizes else None)
    global_batch_size = _read(lambda s: s.policy.allocation.global_batch_size)
    speeds = _read(lambda s: s.policy.allocation.speeds, "Relative throughput (samples/s when profiled) by rank.")
    speeds_given = _read(lambda s: s.policy.config.speeds is not None)
    loss_scale = _read(lambda s: s.policy.step_split(None, None).loss_scale, "Factor ``W * b_r / B`` of this loss.")
    cost_model = _read(lambda s: s.policy.allocation.cost_model, "Every replica's fitted cost ``t_r(b)`` in seconds.")
    micro_batcher = _read(lambda s: s.policy.micro)
    profile_seconds = _read(lambda s: s.policy.allocation.profile_seconds)
    profiling = _read(lambda s: s.policy.profiling, "Whether the first training steps are still profiling.")
    comm_mode = _read(lambda s: None if s.comm_algorithm is None else s.comm_algorithm.mode, "``comm`` resolved.")
    comm_reduction = _read(lambda s: None if s.comm_algorithm is None else s.comm_algorithm.reduction)
    comm_stats = _read(lambda s: {} if s.comm_algorithm is None else s.comm_algorithm.stats, "Bytes sent, by kind.")

    @property
    def node_ids(self) -> list[int] | None:
        return None if self._node_ids is None else list(self._node_ids)

    def adopt_allocation(
        self, batch_sizes: list[int], speeds: list[float], costs: list[dict[str, float]] | None = None
    ) -> None:
        """Make ``batch_sizes`` the allocation (every replica, the same arguments; the training loader is rebuilt before
        the next step); ``costs``: refreshed ``AffineCost.as_dict()`` costs, ``None`` keeps the model."""
        self.policy.adopt(batch_sizes, speeds, costs)
