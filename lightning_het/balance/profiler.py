"""One job, profiling: the first training steps timed (docs/balancing.md), their cost fit and the speed cache."""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback

from lightning_het._flavour import trainer_flavour
from lightning_het.allocation import allocate_batch_sizes
from lightning_het.balance.clock import StepClock
from lightning_het.balance.cost import AffineCost, fit_affine, slope_through_origin, step_time
from lightning_het.balance.rebalance import DEFAULT_THRESHOLD, profiled_split


def _spread(total: int, room: Sequence[int]) -> list[int]:
    """``total`` samples over slots of capacity ``room``, in proportion (the allocation's rounding)."""
    slots = [r for r, cap in enumerate(room) if cap > 0]
    out = [0] * len(room)
    if total > 0 and slots:
        caps = [room[r] for r in slots]
        for r, b in zip(slots, allocate_batch_sizes(total, caps, min_batch_size=0, max_batch_sizes=caps)):
            out[r] = b
    return out


def _halves(sizes: Sequence[int]) -> tuple[list[int], list[int]]:
    """Two groups of ranks holding about the same number of samples (largest first, each to the lighter group)."""
    groups: tuple[list[int], list[int]] = ([], [])
    totals = [0, 0]
    for r in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        g = 0 if totals[0] <= totals[1] else 1
        groups[g].append(r)
        totals[g] += sizes[r]
    return sorted(groups[0]), sorted(groups[1])


def trial_splits(
    around: Sequence[int],
    *,
    min_batch_size: int = 1,
    max_batch_sizes: Sequence[int] | None = None,
) -> tuple[list[int], list[int]]:
    """Trial splits A and B around ``around``: same total, within the bounds, each replica's sizes about 3x apart."""
    floor = max(int(min_batch_size), 1)
    base = [int(b) for b in around]
    total = sum(base)
    upper = list(max_batch_sizes) if max_batch_sizes is not None else [total] * len(base)
    first, second = _halves(base)
    splits = []
    for givers, takers in ((first, second), (second, first)):
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


@dataclass(frozen=True)
class ProfilePlan:
    """The in-loop profiling schedule, in steps from the fit's first profiled step (pure; fields as in
    :func:`profile_plan`, ``equal`` the equal split)."""

    equal: tuple[int, ...]
    warmup: int
    steps: int
    lag: int
    min_batch_size: int = 1
    max_batch_sizes: tuple[int, ...] | None = None

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
        """The step at whose end the costs are fitted and agreed on (``steps`` steps at the rough split after a warm-up,
        else ``steps`` at each of two trial splits)."""
        return self.first_trial + (self.steps if self.warmup else 2 * self.steps) - 1

    @property
    def switch_step(self) -> int:
        """The first step split by the fitted allocation (the first one drawn after ``gather_step`` ended)."""
        return self.gather_step + 1 + self.lag

    def trials(self, around: Sequence[int] | None) -> tuple[list[int], list[int]]:
        """Trial splits A and B around the rough split (``None``: the equal split)."""
        return trial_splits(
            list(around if around is not None else self.equal),
            min_batch_size=self.min_batch_size,
            max_batch_sizes=self.max_batch_sizes,
        )

    def split(self, n: int, around: Sequence[int] | None) -> list[int]:
        """The split of step ``n < switch_step``: equal, then the rough split ``around`` (without a warm-up: trials A
        and B around the equal split in turn)."""
        if n < self.first_trial:
            return list(self.equal)
        if around is None and n <= self.gather_step:
            return self.trials(None)[(n - self.first_trial) % 2]
        return list(around if around is not None else self.equal)


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
    """The in-loop profiling schedule (the same on every rank)."""
    if world_size < 2 or steps < 1 or warmup < 0 or lag < 0:
        raise ValueError(
            f"Expected world_size >= 2, steps >= 1, warmup >= 0 and lag >= 0, but got {world_size}, {steps}, {warmup}"
            f" and {lag}."
        )
    floor = max(min_batch_size, 1)
    equal = allocate_batch_sizes(
        global_batch_size, [1.0] * world_size, min_batch_size=floor, max_batch_sizes=max_batch_sizes
    )
    upper = tuple(max_batch_sizes) if max_batch_sizes is not None else None
    return ProfilePlan(tuple(equal), warmup, steps, lag, floor, upper)


def loader_prefetch_depth(dataloader: Any, loop_prefetch: int = 1) -> int:
    """Steps a training loader has drawn ahead when a step ends: ``loop_prefetch`` (1 in Lightning's fit loop, 0 in a
    plain loop) plus ``num_workers * prefetch_factor``."""
    workers = int(getattr(dataloader, "num_workers", 0) or 0)
    factor = getattr(dataloader, "prefetch_factor", None)
    return loop_prefetch + (workers * int(factor if factor is not None else 2) if workers > 0 else 0)


class InLoopProfiler:
    """Runs one fit's :class:`ProfilePlan` on one replica; its all-gathers run at the end of ``plan.rough_step`` and
    ``plan.gather_step`` on every rank, then ``adopt(costs, batch_sizes)`` is called once."""

    def __init__(
        self,
        plan: ProfilePlan,
        rank: int,
        world_size: int,
        device: torch.device,
        clock: Callable[[], tuple[int, float | Callable[[], float]] | None],
        adopt: Callable[[list[AffineCost], list[int]], None],
    ) -> None:
        self.plan = plan
        self.global_batch_size = sum(plan.equal)
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self._clock = clock
        self._adopt = adopt
        self._bounds = {"min_batch_size": plan.min_batch_size, "max_batch_sizes": plan.max_batch_sizes}
        #: per epoch: (plan step, global batch within the epoch) of the epoch's first drawn batch
        self._anchors: dict[int, tuple[int, int]] = {}
        self._trained = 0  # training steps ended since the plan started
        self.samplers: list[Any] = []  # the training samplers following the plan (one per training loader)
        #: this replica's compute seconds of steps 0 .. gather_step (a device timer's: a function, until read)
        self._compute: list[Any] = []
        self._sizes: list[int] = []  # and its batch sizes
        self.rough: list[int] | None = None  # the rough split the trials centre on (after the warm-up)
        self.done = False
        self.costs: list[AffineCost] | None = None
        #: the imbalance (max / min) from which the fitted costs moved the split away from equal
        self.threshold = DEFAULT_THRESHOLD
        #: estimated seconds the profiled steps cost beyond balanced steps (slowest replica's compute)
        self.overhead_s = 0.0
        #: this replica's micro-batch cap when its costs are fitted (``None``: it runs its whole share at once)
        self.micro_cap: Callable[[], int | None] = lambda: None

    def bind(self, sampler: Any) -> None:
        """Make ``sampler`` follow the plan (scaled to its own global batch if that differs)."""
        total = sampler.global_batch_size
        if total == self.global_batch_size:
            sampler.split_schedule = self.split_for
        else:

            def scaled(epoch: int, step: int) -> list[int] | None:
                split = self.split_for(epoch, step)
                return None if split is None else allocate_batch_sizes(total, split)

            sampler.split_schedule = scaled
        self.samplers.append(sampler)

    def step_index(self, epoch: int, step: int) -> int:
        """The plan step of global batch ``step`` of ``epoch`` (negative: none); epochs continue the steps trained."""
        anchor = self._anchors.get(epoch)
        if anchor is None:
            anchor = self._anchors[epoch] = (self._trained, step)
        return anchor[0] + step - anchor[1]

    def split_for(self, epoch: int, step: int) -> list[int] | None:
        """The split of global batch ``step`` of ``epoch`` (``None``: the allocation); raises if drawn too early."""
        n = self.step_index(epoch, step)
        plan = self.plan
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
        self._sizes.append(measured[0] if measured is not None else 0)
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
        local = self.plan.equal[self.rank] / min(warm) if warm else 1.0
        speeds = [r[0] for r in _all_gather([local], self.world_size, self.device)]
        if max(speeds) < _ROUGH_THRESHOLD * min(speeds):  # one step's times tell noise from a mild imbalance no better
            speeds = [1.0] * len(speeds)  # than the fit will: the trials stay at DDP's equal split
        self.rough = allocate_batch_sizes(self.global_batch_size, speeds, **self._bounds)

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
        fastest = {b: min(timings) for b, timings in stages.items()}
        for b in [b for b, timings in stages.items() if len(timings) == 1]:
            if any(other > b and fastest[other] < fastest[b] for other in stages):  # slower than a larger size: a
                del stages[b]  # cold step timed once (right after the warm-up) would pull the line by its outlier
        local = fit_stage_timings(sorted(stages.items())) if stages else AffineCost(0.0, 1.0)
        rows = _all_gather([local.fixed_s, local.per_sample_s, spread, *self._compute], self.world_size, self.device)
        costs = [AffineCost(r[0], r[1]) for r in rows]
        # equal unless clearly imbalanced: beyond the default threshold and the spread of repeated steps' times
        self.threshold = max([DEFAULT_THRESHOLD] + [r[2] for r in rows])
        sizes = profiled_split(self.global_batch_size, costs, threshold=self.threshold, **self._bounds)
        balanced = step_time(sizes, costs)
        slowest = [max(r[3 + n] for r in rows) for n in range(len(self._compute))]
        gap = step_time(plan.split(plan.gather_step + 1, self.rough), costs) if plan.lag else balanced
        self.overhead_s = sum(max(s - balanced, 0.0) for s in slowest if math.isfinite(s)) + plan.lag * max(
            gap - balanced, 0.0
        )
        self.costs = costs
        self.done = True
        self._adopt(costs, sizes)


def _all_gather(values: list[float], world_size: int, device: torch.device) -> list[list[float]]:
    local = torch.tensor(values, dtype=torch.float64, device=device)
    everyone = [torch.zeros_like(local) for _ in range(world_size)]
    dist.all_gather(everyone, local)
    return [t.tolist() for t in everyone]


class ProfilerCallbackMixin:
    """Forwards the end of every training step to an :class:`InLoopProfiler`."""

    def __init__(self, profiler: InLoopProfiler) -> None:
        self.profiler = profiler

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.profiler.on_train_batch_end(trainer.current_epoch, batch_idx)

    def __getstate__(self) -> dict[str, Any]:
        return {"profiler": None}  # per-process state: never travels


class ProfilerCallback(ProfilerCallbackMixin, Callback):
    """Added by :class:`~lightning_het.HeterogeneousStrategy` to ``trainer.callbacks`` while it profiles."""


def attach_profiler(profiler: InLoopProfiler | None, trainer: Any) -> None:
    """Hook ``profiler`` into ``trainer`` (replacing a previous fit's), or remove the hook (``None``)."""
    callbacks = trainer.callbacks
    callbacks[:] = [cb for cb in callbacks if not isinstance(cb, ProfilerCallbackMixin)]
    if profiler is not None:
        callbacks.append(trainer_flavour(trainer).ProfilerCallback(profiler))  # the trainer's package's Callback


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


#: smallest imbalance of the warm-up step's speeds (max / min) for the trials to leave the equal split
_ROUGH_THRESHOLD = 1.5
#: appended to a replica's key for its measured memory cap
MEMORY_KEY = "|memory"

#: smallest ratio of a replica's largest to smallest timed size for an affine fit (below: proportional)
_MIN_SIZE_SPREAD = 1.25
#: smallest fitted per-sample cost, as a fraction of the average cost per sample at the largest profiled batch size
_MIN_SLOPE_OF_AVERAGE = 0.1


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
    # a fixed cost the stages cannot tell from their timing noise: the line through the origin, which extrapolates
    # to other sizes more safely than an intercept fitted to noise (the narrowest spread of a stage timed repeatedly)
    noise = min(stage_ratios([ts for _, ts in stages]), default=1.0)
    if cost.fixed_s > 0 and max(abs(t - through_origin * b) / t for b, t in zip(sizes, seconds)) <= noise - 1.0:
        return AffineCost(0.0, through_origin)
    # a slope below 10 % of the largest stage's cost per sample is more likely noise than a flat curve: keep the line
    # through the largest stage with that slope (a cautious estimate that rebalancing can correct)
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
    if isinstance(value, (int, float, bool, str)) or value is None:
        return type(value).__name__
    return type(value).__qualname__


def device_description(device: torch.device) -> str:
    """What identifies a device's speed: the GPU model, or the CPU model and the intra-op thread count."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return f"{device.type}:{platform.machine()}:{platform.processor() or 'cpu'}:threads={torch.get_num_threads()}"


def cache_key(module: torch.nn.Module, device: torch.device, sample: Any, **extra: Any) -> str:
    """A stable key for one replica's cost: module class, parameter count, device, one sample's tensor shapes."""
    cls = type(module)
    data = {
        "module": f"{cls.__module__}.{cls.__qualname__}",
        "parameters": sum(p.numel() for p in module.parameters()),
        "device": device_description(device),
        "sample": _describe(sample),
        "torch": torch.__version__,
        **{k: extra[k] for k in sorted(extra)},
    }
    return json.dumps(data, sort_keys=True, default=str)


class ProfileCache:
    """Fitted costs on disk: one small JSON file per key under ``directory`` (safe for concurrent replicas)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory).expanduser()

    @staticmethod
    def default_directory() -> Path:
        """``$XDG_CACHE_HOME/lightning_het/profiles``, else ``~/.cache/lightning_het/profiles``."""
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return Path(base) / "lightning_het" / "profiles"

    def _path(self, key: str) -> Path:
        return self.directory / (hashlib.sha256(key.encode()).hexdigest()[:32] + ".json")

    def get(self, key: str) -> AffineCost | None:
        """The cost stored under ``key``, or ``None`` (missing, unreadable or for another key)."""
        cost = self._field(key, "cost", AffineCost.from_dict)
        return cost if cost is not None and math.isfinite(cost.fixed_s) else None

    def put(self, key: str, cost: AffineCost, threshold: float | None = None) -> None:
        """Store ``cost`` under ``key`` (atomic replace; an unwritable directory is ignored), with the imbalance
        ``threshold`` its profiling split by."""
        self._write(key, {"cost": cost.as_dict(), "threshold": threshold})

    def get_threshold(self, key: str) -> float | None:
        return self._field(key, "threshold", float)

    def get_cap(self, key: str) -> int | None:
        """The measured micro-batch cap stored for ``key`` (the memory entry beside the cost), or ``None``."""
        cap = self._field(key + MEMORY_KEY, "micro_batch_cap", int)
        return cap if cap is not None and cap >= 1 else None

    def put_cap(self, key: str, cap: int) -> None:
        self._write(key + MEMORY_KEY, {"micro_batch_cap": int(cap)})

    def _field(self, key: str, name: str, cast: Callable[[Any], Any]) -> Any:
        try:
            return cast(self._read(key)[name])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _read(self, key: str) -> dict[str, Any]:
        data = json.loads(self._path(key).read_text())
        if data.get("key") != key:
            raise KeyError(key)
        return data

    def _write(self, key: str, payload: dict[str, Any]) -> None:
        path = self._path(key)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"key": key, **payload, "time": time.time()}))
            os.replace(tmp, path)
        except OSError:
            return
