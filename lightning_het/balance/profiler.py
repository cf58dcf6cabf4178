"""One job, profiling: the first training steps timed (docs/balancing.md), their cost fit and the speed cache."""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lightning_het.allocation import allocate_batch_sizes
from lightning_het.balance.clock import StepClock
from lightning_het.balance.cost import AffineCost, fit_affine, slope_through_origin, step_time
from lightning_het.balance.rebalance import DEFAULT_THRESHOLD, profiled_split

#: smallest imbalance of the warm-up step's speeds (max / min) for the trials to leave the equal split
_ROUGH_THRESHOLD = 1.5
#: smallest ratio of a replica's largest to smallest timed size for an affine fit (below: proportional)
_MIN_SIZE_SPREAD = 1.25
#: smallest fitted per-sample cost, as a fraction of the average cost per sample at the largest profiled batch size
_MIN_SLOPE_OF_AVERAGE = 0.1


def _spread(total: int, room: Sequence[int]) -> list[int]:
    """``total`` samples over slots of capacity ``room``, in proportion (the allocation's rounding)."""
    slots = [r for r, cap in enumerate(room) if cap > 0]
    out = [0] * len(room)
    if total > 0 and slots:
        caps = [room[r] for r in slots]
        for r, b in zip(slots, allocate_batch_sizes(total, caps, min_batch_size=0, max_batch_sizes=caps)):
            out[r] = b
    return out


def trial_splits(
    around: Sequence[int], *, min_batch_size: int = 1, max_batch_sizes: Sequence[int] | None = None
) -> tuple[list[int], list[int]]:
    """Trial splits A and B around ``around``: same total, within the bounds, each replica's sizes about 3x apart."""
    floor, base = max(int(min_batch_size), 1), [int(b) for b in around]
    upper = list(max_batch_sizes) if max_batch_sizes is not None else [sum(base)] * len(base)
    halves: tuple[list[int], list[int]] = ([], [])  # about equal samples: largest first, each to the lighter half
    for r in sorted(range(len(base)), key=lambda i: (-base[i], i)):
        halves[0 if sum(base[i] for i in halves[0]) <= sum(base[i] for i in halves[1]) else 1].append(r)
    splits = []
    for givers, takers in (halves, halves[::-1]):
        give = [max(base[r] - max(floor, base[r] // 2), 0) for r in givers]
        take = [max(min(upper[r], 2 * base[r] + 1) - base[r], 0) for r in takers]
        moved, sizes = min(sum(give), sum(take)), list(base)
        for ranks, sign, room in ((givers, -1, give), (takers, 1, take)):
            for r, d in zip(ranks, _spread(moved, room)):
                sizes[r] += sign * d
        splits.append(sizes)
    return splits[0], splits[1]


def beyond(
    equal: Sequence[int],
    around: Sequence[int],
    *,
    min_batch_size: int = 1,
    max_batch_sizes: Sequence[int] | None = None,
) -> list[int]:
    """A split further from ``equal`` than ``around`` (the same total): each share moved towards twice or half itself,
    the way it left the equal one (a second size to time, near the optimum when fixed costs make it more uneven)."""
    floor, upper = max(int(min_batch_size), 1), list(max_batch_sizes or [sum(around)] * len(around))
    give = [max(a - max(floor, a // 2), 0) if a < e else 0 for a, e in zip(around, equal)]
    take = [max(min(upper[r], 2 * a) - a, 0) if a > e else 0 for r, (a, e) in enumerate(zip(around, equal))]
    moved, sizes = min(sum(give), sum(take)), list(around)
    for room, sign in ((give, -1), (take, 1)):
        for r, d in enumerate(_spread(moved, room)):
            sizes[r] += sign * d
    return sizes


@dataclass(frozen=True)
class ProfilePlan:
    """The in-loop profiling schedule (the same on every rank), in steps from the fit's first profiled step."""

    global_batch_size: int
    world_size: int
    warmup: int
    steps: int
    lag: int
    min_batch_size: int = 1
    max_batch_sizes: Sequence[int] | None = None
    equal: list[int] = field(init=False)  # the equal split

    def __post_init__(self) -> None:
        if self.world_size < 2 or self.steps < 1 or self.warmup < 0 or self.lag < 0:
            raise ValueError(
                f"Expected world_size >= 2, steps >= 1, warmup >= 0 and lag >= 0, but got {self.world_size},"
                f" {self.steps}, {self.warmup} and {self.lag}."
            )
        equal = allocate_batch_sizes(self.global_batch_size, [1.0] * self.world_size, **self.bounds)
        object.__setattr__(self, "equal", equal)

    @property
    def bounds(self) -> dict[str, Any]:
        return {"min_batch_size": max(self.min_batch_size, 1), "max_batch_sizes": self.max_batch_sizes}

    @property
    def rough_step(self) -> int | None:
        """The step at whose end the rough speeds are agreed on (``None`` without a warm-up)."""
        return self.warmup - 1 if self.warmup else None

    @property
    def first_trial(self) -> int:
        """The first trial step: the first step drawn after the rough speeds are known."""
        return self.warmup + self.lag if self.warmup else 0

    @property
    def gather_step(self) -> int:
        """The step at whose end the costs are fitted and agreed on (``steps`` pairs of trial steps)."""
        return self.first_trial + 2 * self.steps - 1

    @property
    def switch_step(self) -> int:
        """The first step split by the fitted allocation (the first one drawn after ``gather_step`` ended)."""
        return self.gather_step + 1 + self.lag

    def split(self, n: int, around: Sequence[int] | None) -> list[int]:
        """The split of step ``n < switch_step``: equal, then the rough split ``around`` and one :func:`beyond` it in
        turn (without a warm-up: trials A and B around the equal split), then ``around`` (or equal)."""
        if n < self.first_trial:
            return list(self.equal)
        second = n <= self.gather_step and (n - self.first_trial) % 2
        if around is None:
            return trial_splits(self.equal, **self.bounds)[second] if n <= self.gather_step else list(self.equal)
        return beyond(self.equal, around, **self.bounds) if second else list(around)


def loader_prefetch_depth(dataloader: Any, loop_prefetch: int = 1) -> int:
    """Steps a training loader has drawn ahead when a step ends: ``loop_prefetch`` (Lightning's fit loop: 1 for a
    loader without a length, else 0; a plain loop: 0) plus ``num_workers * prefetch_factor``."""
    workers = int(getattr(dataloader, "num_workers", 0) or 0)
    factor = getattr(dataloader, "prefetch_factor", None)
    return loop_prefetch + (workers * int(factor if factor is not None else 2) if workers > 0 else 0)


class InLoopProfiler:
    """Runs one fit's :class:`ProfilePlan` on one replica; ``gather`` (every replica's values, a collective) runs at the
    end of ``plan.rough_step`` and ``plan.gather_step`` on every rank, then ``adopt(costs, batch_sizes)`` once."""

    def __init__(
        self,
        plan: ProfilePlan,
        rank: int,
        gather: Callable[[list[float]], list[list[float]]],
        clock: Callable[[], tuple[int, float | Callable[[], float]] | None],
        adopt: Callable[[list[AffineCost], list[int]], None],
    ) -> None:
        self.plan, self.rank, self._gather, self._clock, self._adopt = plan, rank, gather, clock, adopt
        self._anchors: dict[int, tuple[int, int]] = {}  # per epoch: (plan step, global batch) of its first drawn batch
        self._trained = 0  # training steps ended since the plan started
        self.samplers: list[Any] = []  # the training samplers following the plan (one per training loader)
        #: this replica's compute seconds of steps 0 .. gather_step (a device timer's: a function, until read)
        self._compute: list[Any] = []
        self.rough: list[int] | None = None  # the rough split the trials centre on (after the warm-up)
        self.done = False
        self.costs: list[AffineCost] | None = None
        self.threshold = DEFAULT_THRESHOLD  # the imbalance (max / min) from which the fit leaves the equal split
        self.overhead_s = 0.0  # estimated seconds the profiled steps cost beyond balanced steps
        #: this replica's micro-batch cap when its costs are fitted (``None``: it runs its whole share at once)
        self.micro_cap: Callable[[], int | None] = lambda: None

    def bind(self, sampler: Any) -> None:
        """Make ``sampler`` follow the plan (scaled to its own global batch if that differs)."""
        total = sampler.global_batch_size

        def scaled(epoch: int, step: int) -> list[int] | None:
            split = self.split_for(epoch, step)
            return None if split is None else allocate_batch_sizes(total, split)

        sampler.split_schedule = self.split_for if total == self.plan.global_batch_size else scaled
        self.samplers.append(sampler)

    def step_index(self, epoch: int, step: int) -> int:
        """The plan step of global batch ``step`` of ``epoch`` (negative: none); epochs continue the steps trained."""
        anchor = self._anchors.setdefault(epoch, (self._trained, step))
        return anchor[0] + step - anchor[1]

    def split_for(self, epoch: int, step: int) -> list[int] | None:
        """The split of global batch ``step`` of ``epoch`` (``None``: the allocation); raises if drawn too early."""
        n, plan = self.step_index(epoch, step), self.plan
        if n < 0 or (self.done and n >= plan.switch_step):
            return None
        if n < plan.switch_step and (n < plan.first_trial or self.rough is not None or not plan.warmup):
            return plan.split(n, self.rough)
        raise RuntimeError(
            f"lightning_het: the training loader drew global batch {step} of epoch {epoch} before the profiling step"
            f" that decides its split had ended (assumed {plan.lag} batch(es) drawn ahead). HINT: pass"
            " `speeds=[...]`, or lower `prefetch_factor`."
        )

    def on_train_batch_end(self, epoch: int, batch_idx: int) -> None:
        """Record this step's compute time; agree on the rough speeds and then the costs at their steps."""
        if epoch not in self._anchors:
            return  # no batch of ours drawn in this epoch
        n = self.step_index(epoch, batch_idx)
        if n < self._trained:
            return  # the same step seen again (a cycling second loader)
        self._trained = n + 1
        if self.done:
            return
        measured = self._clock()
        self._compute.append(measured[1] if measured is not None else math.nan)  # read at the agreements
        if n == self.plan.rough_step:
            self._agree_rough()
        if n == self.plan.gather_step:
            self._finish()

    def _read(self) -> None:
        """Read the steps' compute seconds: a device timer's come as functions, called here, at an agreement (one wait
        for the last step's events, not one synchronisation per step)."""
        for i, value in enumerate(self._compute):
            seconds = value() if callable(value) else value
            self._compute[i] = seconds if math.isfinite(seconds) and seconds > 0 else math.nan

    def _agree_rough(self) -> None:
        self._read()
        warm = [t for t in self._compute[: self.plan.warmup] if math.isfinite(t)]
        speeds = [r[0] for r in self._gather([self.plan.equal[self.rank] / min(warm) if warm else 1.0])]
        if max(speeds) < _ROUGH_THRESHOLD * min(speeds):  # one step's times tell noise from a mild imbalance no better
            speeds = [1.0] * len(speeds)  # than the fit will: the trials stay at DDP's equal split
        self.rough = allocate_batch_sizes(self.plan.global_batch_size, speeds, **self.plan.bounds)

    def _finish(self) -> None:
        self._read()
        plan, rank = self.plan, self.rank
        stages: dict[float, list[float]] = {}  # by size: every step's time (the fastest of a stage enters the fit)
        warm: dict[float, list[float]] = {}  # the steps after the warm-up (their spread: the timing noise)
        cap = self.micro_cap()
        for n, seconds in enumerate(self._compute[: plan.gather_step + 1]):
            if math.isfinite(seconds):  # per micro-batch: a share of b in k pieces is k of b / k
                b = plan.split(n, self.rough)[rank]
                k = 1 if cap is None else max(math.ceil(b / cap), 1)
                stages.setdefault(b / k, []).append(seconds / k)
                if n >= plan.warmup:
                    warm.setdefault(b / k, []).append(seconds / k)
        spread = round(max(stage_ratios(list(warm.values())), default=1.0), 12)
        if warm and max(warm) >= _MIN_SIZE_SPREAD * min(warm):  # sizes far enough apart timed after the warm-up:
            stages = {b: stages[b] for b in warm}  # a size timed only by the (cold) warm-up is left out
        fastest = {b: min(timings) for b, timings in stages.items()}
        for b in [b for b, timings in stages.items() if len(timings) == 1]:
            if any(other > b and fastest[other] < fastest[b] for other in stages):  # slower than a larger size: a
                del stages[b]  # cold step timed once (right after the warm-up) would pull the line by its outlier
        local = fit_stage_timings(sorted(stages.items())) if stages else AffineCost(0.0, 1.0)
        rows = self._gather([local.fixed_s, local.per_sample_s, spread, *self._compute])
        self.costs = costs = [AffineCost(r[0], r[1]) for r in rows]
        # equal unless clearly imbalanced: beyond the default threshold and the spread of repeated steps' times
        self.threshold = max([DEFAULT_THRESHOLD] + [r[2] for r in rows])
        sizes = profiled_split(plan.global_batch_size, costs, threshold=self.threshold, **plan.bounds)
        balanced = step_time(sizes, costs)
        slowest = [max(r[3 + n] for r in rows) for n in range(len(self._compute))]
        gap = step_time(plan.split(plan.gather_step + 1, self.rough), costs) if plan.lag else balanced
        extra = sum(max(s - balanced, 0.0) for s in slowest if math.isfinite(s))
        self.overhead_s = extra + plan.lag * max(gap - balanced, 0.0)
        self.done = True
        self._adopt(costs, sizes)


class LoopSteps:
    """The steps of your own training loop (Fabric): the global batch being trained and, while profiling, a step clock
    opened by a forward pre-hook (:meth:`watch` installs it, :meth:`unwatch` removes it)."""

    def __init__(self) -> None:
        self.sampler: Any = None  # the training loader's ProportionalDistributedSampler
        self.clock: StepClock | None = None  # while profiling
        self._epoch_steps = (-1, 0)  # (sampler epoch, optimizer steps taken in it)
        self._hook: Any = None
        self._open = False
        self._batch_size: Callable[[], int] = lambda: 0

    def position(self) -> tuple[int, int]:
        """(epoch, step within the epoch) of the global batch being trained."""
        epoch = self.sampler.epoch if self.sampler is not None else 0
        return epoch, self._epoch_steps[1] if self._epoch_steps[0] == epoch else 0

    def watch(self, model: torch.nn.Module, device: torch.device, batch_size: Callable[[], int]) -> None:
        """Time ``model``'s training steps (``batch_size``: this replica's samples in the step being trained)."""
        if self._hook is None:
            self.clock, self._batch_size = StepClock(record=False, device=device), batch_size
            self._hook = model.register_forward_pre_hook(self._on_forward)

    def unwatch(self) -> None:
        if self._hook is not None:
            self._hook.remove()
        self._hook = self.clock = None

    def _on_forward(self, module: torch.nn.Module, args: Any) -> None:
        if self.clock is not None and not self._open and module.training and torch.is_grad_enabled():
            self._open = True
            self.clock.step_start(self._batch_size())

    def step_ended(self, profiler: InLoopProfiler | None) -> None:
        """An optimizer step ended: ``profiler`` reads its compute time (the clock goes once it is done)."""
        epoch, step = self.position()
        if profiler is not None and not profiler.done:
            profiler.on_train_batch_end(epoch, step)
            if profiler.done:
                self.unwatch()
        self._epoch_steps, self._open = (epoch, step + 1), False


def stage_ratios(stages: Sequence[Sequence[float]]) -> list[float]:
    """The slowest over the fastest of the steps of each stage timed more than once."""
    return [max(t) / min(t) for t in stages if len(t) > 1 and min(t) > 0]


def fit_stage_timings(stages: Sequence[tuple[float, Sequence[float]]]) -> AffineCost:
    """One replica's :class:`~lightning_het.balance.cost.AffineCost` from its stages' timed seconds, by size."""
    sizes = [b for b, timings in stages if timings]
    seconds = [max(min(timings), 1e-9) for _, timings in stages if timings]
    if not sizes:
        raise ValueError("Expected at least one timed profiling step, got none.")
    through_origin = slope_through_origin(sizes, seconds)
    if max(sizes) < _MIN_SIZE_SPREAD * min(sizes):  # sizes too close for a slope: the one-number model
        return AffineCost(0.0, through_origin)
    cost = fit_affine(sizes, seconds)
    # a fixed cost within the timing noise (the narrowest spread of a stage timed repeatedly): the line through 0
    noise = min(stage_ratios([ts for _, ts in stages]), default=1.0)
    if cost.fixed_s > 0 and max(abs(t - through_origin * b) / t for b, t in zip(sizes, seconds)) <= noise - 1.0:
        return AffineCost(0.0, through_origin)
    # a slope below 10 % of the largest stage's cost per sample is likely noise: that slope through the largest stage
    largest = max(range(len(sizes)), key=lambda i: sizes[i])
    floor = _MIN_SLOPE_OF_AVERAGE * seconds[largest] / sizes[largest]
    if cost.per_sample_s < floor:
        cost = AffineCost(max(seconds[largest] - floor * sizes[largest], 0.0), floor)
    return cost


def _describe(value: Any) -> Any:
    """Shapes and dtypes of the tensors in a (nested) sample: what its cost depends on, not its values."""
    if isinstance(value, torch.Tensor):
        return [list(value.shape), str(value.dtype)]
    if isinstance(value, dict):
        return {str(k): _describe(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_describe(v) for v in value]
    return type(value).__qualname__


def cache_key(module: torch.nn.Module, device: torch.device, sample: Any, **extra: Any) -> str:
    """A stable key for one replica's cost: module class, parameter count, device (its GPU model, or CPU model and
    thread count), one sample's tensor shapes."""
    cls, cpu = type(module), f"{platform.machine()}:{platform.processor() or 'cpu'}:threads={torch.get_num_threads()}"
    data = {
        "module": f"{cls.__module__}.{cls.__qualname__}",
        "parameters": sum(p.numel() for p in module.parameters()),
        "device": f"cuda:{torch.cuda.get_device_name(device)}" if device.type == "cuda" else f"{device.type}:{cpu}",
        "sample": _describe(sample),
        "torch": torch.__version__,
        **extra,
    }
    return json.dumps(data, sort_keys=True, default=str)


class ProfileCache:
    """Profiled records on disk, one small JSON file per key under ``directory`` (default:
    ``$XDG_CACHE_HOME/lightning_het/profiles``, else ``~/.cache/...``); atomic writes, safe for concurrent replicas."""

    def __init__(self, directory: str | os.PathLike[str] | None = None) -> None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        self.directory = Path(directory or Path(base) / "lightning_het" / "profiles").expanduser()

    def _path(self, key: str) -> Path:
        return self.directory / (hashlib.sha256(key.encode()).hexdigest()[:32] + ".json")

    def get(self, key: str) -> dict[str, Any]:
        """The record under ``key``: ``cost`` (an AffineCost), ``threshold`` and micro-batch ``cap``, each ``None``
        when not stored (all: missing, unreadable or another key's file)."""
        record: dict[str, Any] = {"cost": None, "threshold": None, "cap": None}
        try:
            data = json.loads(self._path(key).read_text())
            if data.get("key") == key:
                stored = {"cost": AffineCost.from_dict, "threshold": float, "cap": int}
                record.update({name: cast(data[name]) for name, cast in stored.items() if data.get(name) is not None})
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass
        return record

    def put(self, key: str, **record: Any) -> None:
        """Store ``record`` (``cost``, ``threshold``, ``cap``) under ``key`` (atomic replace; unwritable: ignored)."""
        path = self._path(key)
        record = {name: value.as_dict() if isinstance(value, AffineCost) else value for name, value in record.items()}
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"key": key, **record, "time": time.time()}))
            os.replace(tmp, path)
        except OSError:
            return
