"""Profiling on the real training steps: the first steps of a fit run under trial splits and are timed.

Every step applies the exact gradient of its global batch whatever the split (each replica's loss is scaled by
``W * b_r / B``), so the fit's first global batches can be *trained* under splits chosen to measure each replica's
cost ``t_r(b) = fixed + per_sample * b`` instead of being run twice (once to time, once to train). Nothing of the
user's code runs outside Lightning's loop, and every hook runs in Lightning's order.

The schedule (:func:`profile_plan`, pure), in steps counted from the first step of the fit:

1. ``warmup`` steps at the equal split (untimed: the first steps carry one-off costs, allocator, caches, compilation);
2. ``2 * steps`` trial steps alternating two splits, A and B (:func:`trial_splits`): in A the even ranks give up
   about half of their equal share to the odd ranks, in B the odd ranks to the even ones, so every replica runs two
   batch sizes about 3x apart (``steps`` times each, interleaved, so a later slowdown cannot pass for a fixed cost);
3. at the end of the last trial step (``gather_step``, Lightning's ``on_train_batch_end``, where every rank is
   aligned and no rank-0-only collective is pending) each replica fits its cost through the fastest step at each size
   (:func:`~lightning_het.balance.profiling.fit_stage_timings`), the costs are all-gathered and
   :func:`~lightning_het.balance.cost.allocate_affine` gives the split;
4. the loader has already drawn the index lists of the next steps (Lightning prefetches one batch, worker processes
   ``num_workers * prefetch_factor`` more): those ``lag`` steps keep the equal split, and the fitted split applies
   from ``switch_step = gather_step + 1 + lag`` on, the same step on every rank.

Each replica's compute time of a step is read from the training step clock
(:class:`~lightning_het.balance.telemetry.StepClock`: the local forward and backward, without the wait in the
gradient all-reduce). Global batch ``k`` is always the same set of samples as one process would draw; only its split
changes, and the sampler, the loss scale and the communication controller all follow the split of the step being
trained (:class:`~lightning_het.sampler.ProportionalDistributedSampler`'s ``split_schedule``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback

from lightning_het._compat import on_flavour
from lightning_het.balance.allocation import allocate_batch_sizes
from lightning_het.balance.cost import AffineCost, allocate_affine, step_time
from lightning_het.balance.profiling import StepTiming, fit_stage_timings

__all__ = [
    "InLoopProfiler",
    "ProfilePlan",
    "ProfilerCallback",
    "attach_profiler",
    "loader_prefetch_depth",
    "profile_plan",
    "trial_splits",
]


@dataclass(frozen=True)
class ProfilePlan:
    """The split of every step before the fitted allocation, counted from the fit's first profiled step.

    Attributes:
        splits: per-replica batch sizes of steps ``0 .. switch_step - 1``.
        timed: whether each of those steps is timed (the trial steps).
        gather_step: the step at whose end the costs are fitted and agreed on.
        switch_step: the first step split by the fitted allocation.
    """

    splits: tuple[tuple[int, ...], ...]
    timed: tuple[bool, ...]
    gather_step: int
    switch_step: int


def _spread(total: int, room: Sequence[int]) -> list[int]:
    """``total`` samples over slots of capacity ``room`` (``total <= sum(room)``), in proportion to ``room``, largest
    remainders first, ties to the lower index."""
    capacity = sum(room)
    if total <= 0 or capacity <= 0:
        return [0] * len(room)
    exact = [total * r / capacity for r in room]
    out = [min(int(e), r) for e, r in zip(exact, room)]
    order = sorted(range(len(room)), key=lambda i: (-(exact[i] - int(exact[i])), i))
    left = total - sum(out)
    while left > 0:
        for i in order:
            if left and out[i] < room[i]:
                out[i] += 1
                left -= 1
    return out


def trial_splits(
    global_batch_size: int,
    world_size: int,
    *,
    min_batch_size: int = 1,
    max_batch_sizes: Sequence[int] | None = None,
) -> tuple[list[int], list[int]]:
    """The two trial splits A and B of the global batch (each sums to it and respects the bounds).

    In A the even ranks give up to half of their equal share to the odd ranks (none of which more than doubles its
    share), in B the odd ranks give to the even ones: every replica runs a smaller and a larger size, about 3x apart,
    whenever the bounds leave room (a replica held at ``min_batch_size`` by an equal split too small to give from still
    grows in the other split).

    >>> trial_splits(48, 2)
    ([12, 36], [36, 12])
    >>> trial_splits(48, 3)
    ([8, 32, 8], [20, 8, 20])
    """
    floor = max(int(min_batch_size), 1)
    upper = list(max_batch_sizes) if max_batch_sizes is not None else [global_batch_size] * world_size
    base = allocate_batch_sizes(
        global_batch_size, [1.0] * world_size, min_batch_size=floor, max_batch_sizes=max_batch_sizes
    )
    splits = []
    for givers_parity in (0, 1):
        givers = [r for r in range(world_size) if r % 2 == givers_parity]
        takers = [r for r in range(world_size) if r % 2 != givers_parity]
        give = [max(base[r] - max(floor, base[r] // 2), 0) for r in givers]
        take = [max(min(upper[r], 2 * base[r] + 1) - base[r], 0) for r in takers]
        moved = min(sum(give), sum(take))
        sizes = list(base)
        for r, d in zip(givers, _spread(moved, give)):
            sizes[r] -= d
        for r, d in zip(takers, _spread(moved, take)):
            sizes[r] += d
        splits.append(sizes)
    return splits[0], splits[1]


def profile_plan(
    global_batch_size: int,
    world_size: int,
    *,
    warmup: int,
    steps: int,
    lag: int,
    min_batch_size: int = 1,
    max_batch_sizes: Sequence[int] | None = None,
) -> ProfilePlan:
    """The in-loop profiling schedule (pure; the same on every rank).

    Args:
        global_batch_size: samples per step.
        world_size: replicas (``>= 2``).
        warmup: untimed steps at the equal split first.
        steps: timed steps at each of the two trial splits (alternating).
        lag: steps whose index lists the loader draws ahead of the step being trained
            (:func:`loader_prefetch_depth`): they keep the equal split.
        min_batch_size: fewest samples per replica and step.
        max_batch_sizes: per-replica upper bounds.

    >>> plan = profile_plan(48, 2, warmup=1, steps=2, lag=1)
    >>> plan.splits
    ((24, 24), (12, 36), (36, 12), (12, 36), (36, 12), (24, 24))
    >>> plan.gather_step, plan.switch_step
    (4, 6)
    """
    if world_size < 2 or steps < 1 or warmup < 0 or lag < 0:
        raise ValueError(
            f"Expected world_size >= 2, steps >= 1, warmup >= 0 and lag >= 0, but got {world_size}, {steps}, {warmup}"
            f" and {lag}."
        )
    bounds = {"min_batch_size": max(min_batch_size, 1), "max_batch_sizes": max_batch_sizes}
    equal = tuple(allocate_batch_sizes(global_batch_size, [1.0] * world_size, **bounds))
    a, b = (tuple(s) for s in trial_splits(global_batch_size, world_size, **bounds))  # type: ignore[arg-type]
    trials = [a if i % 2 == 0 else b for i in range(2 * steps)]
    splits = [equal] * warmup + trials + [equal] * lag
    timed = [False] * warmup + [True] * len(trials) + [False] * lag
    gather = warmup + len(trials) - 1
    return ProfilePlan(tuple(splits), tuple(timed), gather, gather + 1 + lag)


def loader_prefetch_depth(dataloader: Any) -> int:
    """Steps whose index lists a training loader has drawn when a step ends: Lightning's one prefetched batch, plus
    ``num_workers * prefetch_factor`` with worker processes (the same on every rank)."""
    workers = int(getattr(dataloader, "num_workers", 0) or 0)
    factor = getattr(dataloader, "prefetch_factor", None)
    return 1 + (workers * int(factor if factor is not None else 2) if workers > 0 else 0)


class InLoopProfiler:
    """Runs one fit's :class:`ProfilePlan` on one replica: the split of each early step, the timings, the fit.

    Owned by the strategy. :meth:`split_for` is the training sampler's ``split_schedule``; :meth:`on_train_batch_end`
    is called at the end of every training step (:class:`ProfilerCallback`) and, at ``plan.gather_step``, fits this
    replica's cost, all-gathers every replica's (a collective: every rank reaches that step) and hands the costs and
    the allocation to ``adopt``.

    Args:
        plan: the schedule.
        global_batch_size: samples per step.
        rank: this replica's global rank.
        world_size: replicas.
        device: where the all-gather's tensors live (the backend's device).
        clock: returns the open step's compute seconds at the end of a step
            (:meth:`~lightning_het.balance.telemetry.StepClock.open_step`), or ``None`` when it has none.
        adopt: called once with ``(costs, batch_sizes)`` when the costs are agreed.
        bounds: ``min_batch_size`` / ``max_batch_sizes`` of the allocation.
    """

    def __init__(
        self,
        plan: ProfilePlan,
        global_batch_size: int,
        rank: int,
        world_size: int,
        device: torch.device,
        clock: Callable[[], tuple[int, float] | None],
        adopt: Callable[[list[AffineCost], list[int]], None],
        bounds: dict[str, Any],
    ) -> None:
        self.plan = plan
        self.global_batch_size = global_batch_size
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self._clock = clock
        self._adopt = adopt
        self._bounds = bounds
        self._origin: tuple[int, int, int] | None = None  # (epoch, step within it, steps per epoch) of step 0
        self.samplers: list[Any] = []  # the training samplers following the plan (one per training loader)
        self._compute: list[float] = []  # this replica's compute seconds of steps 0 .. gather_step
        self._started = 0.0
        self.done = False
        self.costs: list[AffineCost] | None = None
        #: estimated seconds the profiled steps cost beyond balanced steps (slowest replica's compute)
        self.overhead_s = 0.0

    def bind(self, sampler: Any) -> None:
        """Make ``sampler`` (a :class:`~lightning_het.sampler.ProportionalDistributedSampler` positioned for the epoch
        it starts) follow the plan. Step 0 of the plan is the global batch the first sampler bound starts from."""
        if self._origin is None:
            epoch, start = sampler.position
            self._origin = (int(epoch), int(start), int(sampler.num_steps))
        sampler.split_schedule = self.split_for
        self.samplers.append(sampler)

    def step_index(self, epoch: int, step: int) -> int:
        """Steps since the plan's step 0 (negative before it)."""
        if self._origin is None:
            return -1
        epoch0, start, per_epoch = self._origin
        return (epoch - epoch0) * per_epoch + step - start

    def split_for(self, epoch: int, step: int) -> list[int] | None:
        """The split of global batch ``step`` of ``epoch`` while the plan runs, ``None`` where the allocation applies.

        Raises:
            RuntimeError: a step from ``switch_step`` on is drawn before the costs are agreed (a loader that
                prefetches deeper than :func:`loader_prefetch_depth` says): its split cannot be known yet.
        """
        n = self.step_index(epoch, step)
        if n < 0 or (self.done and n >= self.plan.switch_step):
            return None
        if n < self.plan.switch_step:
            return list(self.plan.splits[n])
        raise RuntimeError(
            f"lightning_het: the training loader drew global batch {step} of epoch {epoch} before profiling ended"
            f" (step {self.plan.gather_step} of the plan; assumed {self.plan.switch_step - self.plan.gather_step - 1}"
            " batches drawn ahead). HINT: pass `speeds=[...]`, or lower `prefetch_factor`."
        )

    def on_train_batch_end(self, epoch: int, batch_idx: int) -> None:
        """Record this step's compute time; at ``gather_step``, fit, agree and adopt (collective there)."""
        if self.done:
            return
        n = self.step_index(epoch, batch_idx)
        if n < 0:
            return
        if n == 0:
            self._started = time.perf_counter()
        if n < len(self._compute):
            return  # the same step seen again (a cycling second loader)
        measured = self._clock()
        self._compute.append(measured[1] if measured is not None else float("nan"))
        if n == self.plan.gather_step:
            self._finish()

    def _finish(self) -> None:
        plan, rank = self.plan, self.rank
        stages: dict[int, list[StepTiming]] = {}
        for n, seconds in enumerate(self._compute):
            if plan.timed[n] and seconds == seconds and seconds > 0:  # not NaN
                stages.setdefault(plan.splits[n][rank], []).append(StepTiming(0.0, seconds))
        local = fit_stage_timings(sorted(stages.items())) if stages else AffineCost(0.0, 1.0)
        rows = _all_gather([local.fixed_s, local.per_sample_s, *self._compute], self.world_size, self.device)
        costs = [AffineCost(r[0], r[1]) for r in rows]
        sizes = allocate_affine(self.global_batch_size, costs, **self._bounds)
        balanced = step_time(sizes, costs)
        slowest = [max(r[2 + n] for r in rows) for n in range(len(self._compute))]
        equal = list(plan.splits[-1])
        gap = plan.switch_step - plan.gather_step - 1
        self.overhead_s = max(sum(s - balanced for s in slowest if s == s), 0.0) + gap * max(
            step_time(equal, costs) - balanced, 0.0
        )
        self.costs = costs
        self.done = True
        self._adopt(costs, sizes)


def _all_gather(values: list[float], world_size: int, device: torch.device) -> list[list[float]]:
    local = torch.tensor(values, dtype=torch.float64, device=device)
    everyone = [torch.zeros_like(local) for _ in range(world_size)]
    dist.all_gather(everyone, local)
    return [t.tolist() for t in everyone]


class _ProfilerCallbackMixin:
    """Forwards the end of every training step to an :class:`InLoopProfiler`."""

    def __init__(self, profiler: InLoopProfiler) -> None:
        self.profiler = profiler

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.profiler.on_train_batch_end(trainer.current_epoch, batch_idx)

    def __getstate__(self) -> dict[str, Any]:
        return {"profiler": None}  # per-process state: never travels


class ProfilerCallback(_ProfilerCallbackMixin, Callback):
    """Added by :class:`~lightning_het.HeterogeneousStrategy` to ``trainer.callbacks`` while it profiles."""


def attach_profiler(profiler: InLoopProfiler | None, trainer: Any) -> None:
    """Hook ``profiler`` into ``trainer`` (replacing a previous fit's), or remove the hook (``None``)."""
    callbacks = trainer.callbacks
    callbacks[:] = [cb for cb in callbacks if not isinstance(cb, _ProfilerCallbackMixin)]
    if profiler is not None:
        callbacks.append(on_flavour(ProfilerCallback, trainer)(profiler))
