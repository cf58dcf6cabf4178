#!/usr/bin/env python
"""Benchmark of load balancing on emulated heterogeneous platforms: Lightning DDP vs ``HeterogeneousStrategy``.

Platforms are emulated with *sleep-based compute*: the model's ``training_step`` runs a tiny linear layer and then
sleeps ``c0 / s_r`` seconds per sample, where ``s_r`` is replica ``r``'s relative speed (``1:2:4`` means speeds 1, 2
and 4). Sleeping replicas release the CPU, so three replicas on a two-core machine do not fight for cores and the
figures measure the scheduling (who waits for whom), not CPU contention. Every strategy sees the same platform
because the emulation lives in the model. One run also uses the strategy's own ``emulate_slowdown`` option
instead, as a cross-check: there the model *computes* (spins on the CPU) for its per-sample cost instead of sleeping,
because the strategy stretches CPU work, not time spent off the CPU.

Job ``platforms`` (3 replicas, global batch 48, ``--epochs`` epochs; ``--steps`` steps per epoch on the heterogeneous
platforms, half as many on ``1:1:1`` and in the ``emulate_slowdown`` run, three quarters in the slowdown runs):

* platforms ``1:1:1``, ``1:2:4``, ``1:1:8``: Lightning's ``DDPStrategy`` (equal split, 16 per replica) and
  ``HeterogeneousStrategy()`` with default arguments (profiled), timed over the whole ``fit`` (profiling included);
  the *ideal* step is ``B / sum(speeds)`` = ``48 c0 / sum(s)`` and the ideal speedup over DDP ``sum(s) / (3 min(s))``;
* ``1:2:4`` again with ``HeterogeneousStrategy(emulate_slowdown=[4, 2, 1])`` on a homogeneous model;
* ``affine`` (2 replicas, its own job): step cost ``a_r + c_r * b`` with rank 0 like a GPU on a small model (40 ms
  fixed, 0.5 ms per sample) and rank 1 like a CPU (2 ms, 6 ms per sample): DDP, the profiled affine split, and the
  proportional split a one-number profile would give; ``--only affine`` runs just this job;
* ``memory`` (2 replicas, its own job): rank 0 four times faster (2 ms + 1 ms per sample against 2 ms + 4 ms) but
  holding only 8 samples at once (``emulate_memory_cap``): DDP (for the per-step overhead), the cap-bounded split
  ``max_batch_sizes=[8, 64]``, and micro-batches with measured caps (``max_micro_batch_sizes="auto"``); ``--only
  memory`` runs just this job;
* ``slowdown``: the ``1:2:4`` platform where the fastest replica becomes 2x slower from epoch 3 on, without and with
  ``rebalance_every_n_epochs=1``.

Job ``overhead`` (2 replicas, real compute, no sleeping): an MLP trained with ``DDPStrategy`` and with
``HeterogeneousStrategy`` (profiled), in ``--repeats`` alternated pairs; the per-step overhead is the median over the
pairs of the ratio of 10th-percentile step times (and of the medians; the few profiling steps move neither), in
wall-clock and CPU time. The
telemetry clock's own cost per step is also timed in a tight loop.

``BENCH_NICE=-10`` in the environment runs the workers at that priority (if allowed), to reduce interference from
other jobs on a shared machine.

Full run (~10-11 min on 2 CPU cores; writes ``docs/img/bench_balance_*.png`` and the results section of
``docs/benchmarks.md``)::

    python scripts/bench_balance.py --docs

CI-sized run (tiny settings, < 1 min of compute; used as a test; the ``overhead`` and ``affine`` runs share one job
and the clock is timed over fewer steps)::

    python scripts/bench_balance.py --tiny --out /tmp/bench_balance

Workers are started by this script (one process per replica, ``LOCAL_RANK``/``WORLD_SIZE`` set, so Lightning does not
re-launch) and run every fit of a job in sequence; they are killed, with their process group, on failure or timeout.
Results go to ``--out`` (default ``bench_results/balance``): ``results.json``, ``results.md``, plots, worker logs.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from _workers import REPO, Worker, run_workers, worker_env

if str(REPO) not in sys.path:  # the package without installing it (workers get it through PYTHONPATH)
    sys.path.insert(0, str(REPO))
PLATFORMS: dict[str, list[float]] = {"1:1:1": [1.0, 1.0, 1.0], "1:2:4": [1.0, 2.0, 4.0], "1:1:8": [1.0, 1.0, 8.0]}
GLOBAL_BATCH = 48
SLOWDOWN = {"platform": "1:2:4", "rank": 2, "factor": 2.0, "epoch": 3}
#: 2 replicas whose step costs ``fixed_s + per_sample_s * b`` (sleeps): rank 0 like a GPU on a small model, rank 1
#: like a CPU; the one-number model mis-splits it
AFFINE: dict[str, list[float]] = {"fixed_s": [0.040, 0.002], "per_sample_s": [0.0005, 0.006]}
#: 2 replicas, rank 0 four times faster but holding 8 samples at once (``caps``, emulated): the cap-bounded split
#: wastes it, micro-batches keep its share (each micro-batch pays the fixed cost again)
MEMORY: dict[str, list[Any]] = {"fixed_s": [0.002, 0.002], "per_sample_s": [0.001, 0.004], "caps": [8, 64]}
AFFINE_RUNS = ("affine ddp", "affine het proportional", "affine het")
MEMORY_RUNS = ("memory ddp", "memory het capped", "memory het micro")
#: fit lengths of the profiling-cost job: a profiled fit against the same fit at the best split (no profiling)
PROFILING_STEPS = (30, 90)
DOC_BEGIN, DOC_END = "<!-- bench_balance:begin -->", "<!-- bench_balance:end -->"


# ====================================================================== worker side (one process per replica)
def _worker(spec_path: str) -> None:
    if os.environ.get("BENCH_NICE"):
        with contextlib.suppress(OSError):  # needs privileges; without them the run is simply not prioritised
            os.nice(int(os.environ["BENCH_NICE"]))
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_het
    from lightning_het.balance.report import balance_report_paths
    from lightning_het.config import typed_keywords

    spec = json.loads(Path(spec_path).read_text())
    rank = int(os.environ["LOCAL_RANK"])
    world = int(os.environ["WORLD_SIZE"])
    out = Path(spec["out"])
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= world:  # one core per replica, as one device each: the scheduler's migrations add no noise
        os.sched_setaffinity(0, {cores[rank]})

    def burn(seconds: float) -> None:
        """Spin until the process has used ``seconds`` of CPU time (work the strategy's emulation stretches)."""
        start = time.process_time()
        while time.process_time() - start < seconds:
            pass

    class SleepModel(pl.LightningModule):
        """Tiny compute plus ``per_sample_s[rank] x batch`` seconds of sleep (x ``factor`` after ``change``); with
        ``busy=True`` those seconds are spent computing (CPU time) instead of sleeping."""

        def __init__(
            self,
            per_sample_s: list[float],
            change: dict[str, Any] | None,
            fixed_s: list[float] | None = None,
            busy: bool = False,
        ) -> None:
            super().__init__()
            self.net = nn.Linear(16, 1)
            self.per_sample_s = per_sample_s
            self.fixed_s = fixed_s or [0.0] * len(per_sample_s)
            self.change = change
            self.wait = burn if busy else time.sleep

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            cost = self.per_sample_s[self.global_rank]
            ch = self.change
            if ch and self.global_rank == ch["rank"] and self.current_epoch >= ch["epoch"]:
                cost *= ch["factor"]
            self.wait(self.fixed_s[self.global_rank] + cost * x.shape[0])
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def configure_model(self) -> None:  # the sharded rows: the same FSDP2 sharding for both strategies
            if isinstance(self.trainer.strategy, ModelParallelStrategy):
                from torch.distributed.fsdp import fully_shard

                fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    class MLP(pl.LightningModule):
        """Real compute (no sleeping), for the homogeneous overhead."""

        def __init__(self, width: int) -> None:
            super().__init__()
            self.net = nn.Sequential(
                nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1)
            )

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Timer(pl.Callback):
        """Start time (wall and this process's CPU) of every training batch and wall time of every epoch."""

        def __init__(self) -> None:
            self.batch_starts: list[list[float]] = []
            self.batch_cpu: list[list[float]] = []
            self.epoch_s: list[float] = []
            self._epoch_start = 0.0

        def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
            self.batch_starts.append([])
            self.batch_cpu.append([])
            self._epoch_start = time.perf_counter()

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.batch_starts[-1].append(time.perf_counter())
            self.batch_cpu[-1].append(time.process_time())

        def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
            self.epoch_s.append(time.perf_counter() - self._epoch_start)

        def step_times(self, skip_epochs: int = 0, cpu: bool = False) -> list[float]:
            marks = self.batch_cpu if cpu else self.batch_starts
            return [b - a for starts in marks[skip_epochs:] for a, b in itertools.pairwise(starts)]

    def run(cfg: dict[str, Any]) -> dict[str, Any]:
        pl.seed_everything(0, workers=True)
        steps, epochs = cfg["steps"], cfg["epochs"]
        if cfg["model"] == "mlp":
            g = torch.Generator().manual_seed(1)
            n = cfg["batch"] * world * steps
            data = TensorDataset(torch.randn(n, 64, generator=g), torch.randn(n, 1, generator=g))
            model: pl.LightningModule = MLP(cfg["width"])
            batch = cfg["batch"]
        else:
            g = torch.Generator().manual_seed(1)
            n = GLOBAL_BATCH * steps
            data = TensorDataset(torch.randn(n, 16, generator=g), torch.randn(n, 1, generator=g))
            if cfg["model"] in ("affine", "memory"):
                costs = AFFINE if cfg["model"] == "affine" else MEMORY
                model = SleepModel(costs["per_sample_s"], None, costs["fixed_s"])
            else:
                model = SleepModel(
                    [spec["c0"] / s for s in cfg["speeds"]], cfg.get("change"), busy=cfg.get("busy", False)
                )
            batch = GLOBAL_BATCH // world
        kwargs = dict(cfg.get("het_kwargs") or {})
        logger: Any = False
        callbacks: list[Any] = []
        if cfg["strategy"] == "ddp":
            strategy: Any = DDPStrategy(process_group_backend="gloo")
        elif cfg["strategy"] == "mp":  # Lightning's FSDP2 (equal split): the sharded row's reference
            strategy = ModelParallelStrategy(world, 1, process_group_backend="gloo")  # data-parallel over all
        elif cfg["strategy"] == "fsdp":
            strategy = lightning_het.HeterogeneousFSDPStrategy(process_group_backend="gloo", **kwargs)
        else:
            # the rows' flat settings in the typed form: comm / profiling objects, the emulation as a callback
            keywords, emulation = typed_keywords(kwargs)
            strategy = lightning_het.HeterogeneousStrategy(process_group_backend="gloo", **keywords)
            callbacks = [lightning_het.EmulatedPlatform(**emulation)] if emulation else []
            if cfg.get("report"):
                logger = CSVLogger(out / "reports", name=cfg["name"].replace(" ", "_").replace(":", ""), version=0)
        timer = Timer()
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=world,
            strategy=strategy,
            max_epochs=epochs,
            logger=logger,
            callbacks=[timer, *callbacks],
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            log_every_n_steps=max(1, steps),
        )
        loader = DataLoader(data, batch_size=batch, shuffle=True)
        start = time.perf_counter()
        trainer.fit(model, loader)
        fit_s = time.perf_counter() - start
        result: dict[str, Any] = {
            **{k: v for k, v in cfg.items() if k != "het_kwargs"},
            "het_kwargs": kwargs,
            "fit_s": fit_s,
            "epoch_s": timer.epoch_s,
            "step_s_median": statistics.median(timer.step_times()),
            "step_s_mean": statistics.fmean(timer.step_times()),
            "step_s_median_after_epoch0": statistics.median(timer.step_times(1) or timer.step_times()),
            "step_s_mean_after_epoch0": statistics.fmean(timer.step_times(1) or timer.step_times()),
            "step_cpu_s_median": statistics.median(timer.step_times(cpu=True)),
            "step_s_p10": _quantile(timer.step_times(), 0.1),
            "step_cpu_s_p10": _quantile(timer.step_times(cpu=True), 0.1),
            "global_step": trainer.global_step,
        }
        if cfg["strategy"] not in ("ddp", "mp"):
            report = trainer.strategy.balance_report()
            result["batch_sizes"] = report["batch_sizes"]
            result["speeds"] = report["speeds"]
            result["profile_s"] = report["profile_seconds"]
            result["cost_model"] = report.get("cost_model")
            result["telemetry"] = report["telemetry"]
            micro = trainer.strategy.micro_batcher
            result["search_s"] = micro.search_s if micro is not None else 0.0
            paths = balance_report_paths(trainer.log_dir) if logger and trainer.log_dir else {}
            if paths and paths["table"].exists():  # written by rank 0 at the end of the fit
                result["report_paths"] = {k: str(v) for k, v in paths.items()}
        return result

    results = []
    for cfg in spec["runs"]:
        results.append(run(cfg))
        if rank == 0:
            print(f"[bench] {cfg['name']}: fit {results[-1]['fit_s']:.2f} s", flush=True)
    if rank == 0:
        (out / f"{spec['job']}.json").write_text(json.dumps(results, indent=1))
    if torch.distributed.is_initialized():  # a clean end: no backend threads left to interpreter shutdown
        torch.distributed.destroy_process_group()


# ====================================================================== driver side
def _launch(job: str, world: int, runs: list[dict[str, Any]], out: Path, c0: float, timeout: float) -> list[dict]:
    """Run one job (``world`` worker processes running ``runs`` in sequence); returns rank 0's results."""
    spec = {"job": job, "runs": runs, "out": str(out), "c0": c0}
    spec_path = out / f"{job}.spec.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    from lightning_het.cluster.rendezvous import free_port  # torch is imported only when a job starts

    port = free_port()
    extra = {"WORLD_SIZE": str(world), "NODE_RANK": "0", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    workers = [
        Worker(
            [sys.executable, __file__, "--worker", str(spec_path)],
            worker_env("127.0.0.1", port, LOCAL_RANK=str(rank), **extra),
            out / f"{job}.rank{rank}.log",
        )
        for rank in range(world)
    ]
    run_workers(workers, timeout=timeout, name=f"bench job {job!r}")
    return json.loads((out / f"{job}.json").read_text())


def _plan(args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    base = {"steps": args.steps, "epochs": args.epochs, "model": "sleep"}
    warm = {
        **base,
        "name": "warm-up",
        "platform": "1:1:1",
        "speeds": PLATFORMS["1:1:1"],
        "strategy": "ddp",
        "epochs": 1,
    }
    warm["steps"] = 2
    platforms: list[dict] = [warm]
    for name, speeds in PLATFORMS.items():
        steps = args.steps if len(set(speeds)) > 1 else max(2, args.steps // 2)  # homogeneous: shorter
        for strategy in ("ddp", "het"):
            platforms.append(
                {
                    **base,
                    "steps": steps,
                    "name": f"{name} {strategy}",
                    "platform": name,
                    "speeds": speeds,
                    "strategy": strategy,
                }
            )
    for strategy in ("mp", "het"):  # sharded (FSDP2): ModelParallelStrategy, HeterogeneousFSDPStrategy
        sharded = {**base, "platform": "1:2:4", "speeds": PLATFORMS["1:2:4"], "strategy": strategy}
        platforms.append({**sharded, "name": f"1:2:4 sharded {strategy}", "strategy": strategy.replace("het", "fsdp")})
    fastest = max(PLATFORMS["1:2:4"])
    platforms.append(
        {
            **base,
            "steps": max(2, args.steps // 2),
            "name": "1:2:4 het emulate_slowdown",
            "platform": "1:2:4",
            "speeds": [fastest] * 3,
            "strategy": "het",
            "het_kwargs": {"emulate_slowdown": [fastest / s for s in PLATFORMS["1:2:4"]]},
            "busy": True,
        }
    )
    change = {k: SLOWDOWN[k] for k in ("rank", "factor", "epoch")}
    slow_epochs = max(args.epochs, SLOWDOWN["epoch"] + 2)
    for label, kwargs in (("static", {}), ("rebalanced", {"rebalance_every_n_epochs": 1})):
        platforms.append(
            {
                **base,
                "epochs": slow_epochs,
                "steps": max(2, 3 * args.steps // 4),
                "name": f"slowdown {label}",
                "platform": SLOWDOWN["platform"],
                "speeds": PLATFORMS[SLOWDOWN["platform"]],
                "strategy": "het",
                "het_kwargs": kwargs,
                "change": change,
                "report": label == "rebalanced",
            }
        )
    ov = {
        "model": "mlp",
        "steps": args.overhead_steps,
        "epochs": args.overhead_epochs,
        "batch": args.overhead_batch,
        "width": args.overhead_width,
    }
    overhead = [{**ov, "name": "overhead warm-up", "strategy": "ddp", "epochs": 1}]
    for i in range(args.repeats):
        for strategy in ("ddp", "het") if i % 2 == 0 else ("het", "ddp"):
            overhead.append({**ov, "name": f"overhead {strategy} #{i}", "strategy": strategy})
    return platforms, overhead


def _affine_plan(args: argparse.Namespace) -> list[dict]:
    """The affine platform: DDP, the profiled affine split, and the proportional split a one-number profile at the
    equal split would give (speeds ``b / t(b)`` at ``b = B / 2``), each for ``--epochs`` x ``--steps``."""
    base = {"steps": args.steps, "epochs": args.epochs, "model": "affine", "platform": "affine"}
    equal = GLOBAL_BATCH // 2
    proportional = [equal / (a + c * equal) for a, c in zip(AFFINE["fixed_s"], AFFINE["per_sample_s"])]
    return [
        {**base, "name": "affine warm-up", "strategy": "ddp", "epochs": 1, "steps": 2},
        {**base, "name": "affine ddp", "strategy": "ddp"},
        {**base, "name": "affine het", "strategy": "het"},
        {**base, "name": "affine het proportional", "strategy": "het", "het_kwargs": {"speeds": proportional}},
    ]


def _memory_plan(args: argparse.Namespace) -> list[dict]:
    """The memory platform: DDP (for the overhead; it ignores memory), the cap-bounded split (``max_batch_sizes``) and
    the micro-batched one (``max_micro_batch_sizes="auto"`` under ``emulate_memory_cap``), both profiled."""
    base = {"steps": args.steps, "epochs": args.epochs, "model": "memory", "platform": "memory"}
    caps = MEMORY["caps"]
    return [
        {**base, "name": "memory warm-up", "strategy": "ddp", "epochs": 1, "steps": 2},
        {**base, "name": "memory ddp", "strategy": "ddp"},
        {**base, "name": "memory het capped", "strategy": "het", "het_kwargs": {"max_batch_sizes": caps}},
        {
            **base,
            "name": "memory het micro",
            "strategy": "het",
            "het_kwargs": {"max_micro_batch_sizes": "auto", "emulate_memory_cap": caps},
        },
    ]


def _profiling_plan(args: argparse.Namespace, platform: str) -> list[dict]:
    """Profiling's cost on ``platform`` (``1:2:4`` or ``affine``): a profiled fit of each of :data:`PROFILING_STEPS`
    steps against the same fit given the best split as ``speeds`` (no profiling), ``--repeats`` alternated pairs."""
    sys.path.insert(0, str(REPO))
    from lightning_het import allocate_batch_sizes
    from lightning_het.balance.cost import AffineCost, allocate_affine

    if platform == "affine":
        base: dict[str, Any] = {"model": "affine", "platform": "affine"}
        best = allocate_affine(
            GLOBAL_BATCH, [AffineCost(a, c) for a, c in zip(AFFINE["fixed_s"], AFFINE["per_sample_s"])]
        )
    else:
        base = {"model": "sleep", "platform": platform, "speeds": PLATFORMS[platform]}
        best = allocate_batch_sizes(GLOBAL_BATCH, PLATFORMS[platform])
    runs = [{**base, "name": f"profiling {platform} warm-up", "strategy": "ddp", "epochs": 1, "steps": 2}]
    for steps in PROFILING_STEPS:
        for i in range(max(args.repeats // 4, 1)):
            pair = [("het", {}), ("best", {"speeds": [float(b) for b in best]})]
            for label, kwargs in pair if i % 2 == 0 else pair[::-1]:
                name = f"profiling {platform} {steps} {label} #{i}"
                runs.append(
                    {**base, "name": name, "strategy": "het", "epochs": 1, "steps": steps, "het_kwargs": kwargs}
                )
    return runs


def _profiling_markdown(runs: list[dict]) -> str:
    """Profiling's cost per platform and fit length: the profiled fit's time over the best split's, less one."""
    lines = [
        "| platform | steps | profiled fit (s) | best-split fit (s) | fit time over the best (-1) | % of the best |"
        " profiling's own estimate (s, % of the best fit) | profiled split | pairs |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    keys = sorted({tuple(r["name"].split()[1:3]) for r in runs if "#" in r["name"]}, key=lambda k: (k[0], int(k[1])))
    for platform, steps in keys:
        het = [r for r in runs if r["name"].startswith(f"profiling {platform} {steps} het")]
        best = [r for r in runs if r["name"].startswith(f"profiling {platform} {steps} best")]
        ratios = [h["fit_s"] / b["fit_s"] for h, b in zip(het, best)]
        cost, best_s = statistics.median(ratios) - 1.0, statistics.median(r["fit_s"] for r in best)
        profile_s = statistics.median(r.get("profile_s", 0.0) for r in het)
        lines.append(
            f"| {platform} | {steps} | {statistics.median(r['fit_s'] for r in het):.2f} | {best_s:.2f} |"
            f" {cost:+.1%} | {1 / (1 + cost):.1%} | **{profile_s:.2f} ({profile_s / best_s:.1%})** |"
            f" {het[-1].get('batch_sizes')} | {len(ratios)} |"
        )
    return "\n".join(lines) + "\n"


def _affine_summary(
    runs: list[dict], spec: dict[str, list[Any]] = AFFINE, names: tuple[str, ...] = AFFINE_RUNS, steady: bool = False
) -> dict[str, Any]:
    """Mean step of each run against the best split's compute plus the per-step overhead measured on DDP (the first
    of ``names``; the best split knows ``spec``'s micro-batch caps, DDP runs its shares whole). ``steady``: the steps
    after the first epoch (which holds the cap search and the profiling, reported apart), for every run and *o*."""
    sys.path.insert(0, str(REPO))
    from lightning_het.balance.cost import AffineCost, allocate_affine, step_time

    whole = [AffineCost(a, c) for a, c in zip(spec["fixed_s"], spec["per_sample_s"])]
    costs = [AffineCost(c.fixed_s, c.per_sample_s, m) for c, m in zip(whole, spec.get("caps", [None, None]))]
    by_name = {r["name"]: r for r in runs}
    best_sizes = allocate_affine(GLOBAL_BATCH, costs)
    best = step_time(best_sizes, costs)
    equal = [GLOBAL_BATCH // 2] * 2
    mean, median = (
        ("step_s_mean_after_epoch0", "step_s_median_after_epoch0") if steady else ("step_s_mean", "step_s_median")
    )
    overhead = max(by_name[names[0]][mean] - step_time(equal, whole), 0.0)
    rows = []
    for name in names:
        r = by_name[name]
        sizes = r.get("batch_sizes") or equal
        rows.append(
            {
                "run": name,
                "batch_sizes": sizes,
                "step_ms": r[mean] * 1e3,
                "step_median_ms": r[median] * 1e3,
                "whole_fit_mean_ms": r["step_s_mean"] * 1e3,
                "compute_ms": step_time(sizes, whole if name == names[0] else costs) * 1e3,
                "vs_best_plus_overhead": r[mean] / (best + overhead),
                "profile_s": r.get("profile_s", 0.0),
                "search_s": r.get("search_s", 0.0),
                "cost_model": r.get("cost_model"),
            }
        )
    return {
        "best_sizes": best_sizes,
        "best_ms": best * 1e3,
        "overhead_ms": overhead * 1e3,
        "rows": rows,
        "steady": steady,
    }


def _affine_markdown(summary: dict[str, Any], spec: dict[str, list[Any]] = AFFINE, title: str = "Affine") -> str:
    caps = ""
    if "caps" in spec:
        caps = f", rank 0 holding {spec['caps'][0]} samples at once (micro-batches pay the fixed cost each)"
    steady = summary.get("steady", False)
    steps = (
        "Steps after the first epoch (which holds the cap search and the profiling, reported apart; the mean over the"
        " whole fit in its own column):"
        if steady
        else "Mean step over the whole training loop, the profiling steps included (their cost beyond balanced steps"
        " is also reported apart):"
    )
    lines = [
        f"**{title} platform** (2 replicas, global batch {GLOBAL_BATCH}; rank 0 sleeps"
        f" {spec['fixed_s'][0] * 1e3:g} ms + {spec['per_sample_s'][0] * 1e3:g} ms/sample per step, rank 1"
        f" {spec['fixed_s'][1] * 1e3:g} ms + {spec['per_sample_s'][1] * 1e3:g} ms/sample{caps})."
        f" Best split {summary['best_sizes']} = {summary['best_ms']:.1f} ms of compute; per-step overhead *o* measured"
        f" on DDP (its mean step minus its compute): {summary['overhead_ms']:.1f} ms. {steps}",
        "",
    ]
    if steady:
        lines += [
            "| run | batch sizes | compute (ms) | median step (ms) | mean step (ms) | / (best + o)"
            " | whole-fit mean (ms) | profiling (s) | cap search (s) |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
    else:
        lines += [
            "| run | batch sizes | compute (ms) | median step (ms) | mean step (ms) | / (best + o) | profiling (s) |",
            "|---|---|---:|---:|---:|---:|---:|",
        ]
    for r in summary["rows"]:
        row = (
            f"| {r['run']} | {r['batch_sizes']} | {r['compute_ms']:.1f} | {r['step_median_ms']:.1f} |"
            f" {r['step_ms']:.1f} | **{r['vs_best_plus_overhead']:.3f}** |"
        )
        if steady:
            row += f" {r['whole_fit_mean_ms']:.1f} |"
        row += f" {r['profile_s']:.2f} |" + (f" {r['search_s']:.2f} |" if steady else "")
        lines.append(row)
    return "\n".join(lines) + "\n"


def _ideal_step_s(speeds: list[float], c0: float) -> float:
    return GLOBAL_BATCH * c0 / sum(speeds)


def _ideal_speedup(speeds: list[float]) -> float:
    """Best speedup of any split over DDP's equal split: ``sum(v) / (W * min(v))``."""
    return sum(speeds) / (len(speeds) * min(speeds))


def _slowed_ideal_samples_per_s(c0: float) -> float:
    """Ideal throughput (samples/s) of the slowdown platform once ``SLOWDOWN["rank"]`` has slowed down."""
    speeds = list(PLATFORMS[SLOWDOWN["platform"]])
    speeds[SLOWDOWN["rank"]] /= SLOWDOWN["factor"]
    return GLOBAL_BATCH / _ideal_step_s(speeds, c0)


def _quantile(values: list[float], q: float) -> float:
    """The ``q``-quantile (nearest rank) of ``values``."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _pairs(runs: list[dict], key: str) -> list[float]:
    """``het / ddp - 1`` of ``key`` for each alternated pair of overhead runs."""
    ddp = [r[key] for r in runs if r["name"].startswith("overhead ddp")]
    het = [r[key] for r in runs if r["name"].startswith("overhead het")]
    return [h / d - 1.0 for d, h in zip(ddp, het)]


def _summarise(platforms: list[dict], overhead: list[dict], c0: float) -> dict[str, Any]:
    by_name = {r["name"]: r for r in platforms}
    rows = []
    for name, speeds in PLATFORMS.items():
        ddp, het = by_name[f"{name} ddp"], by_name[f"{name} het"]
        steps = ddp["global_step"]
        ideal_step = _ideal_step_s(speeds, c0)
        ddp_compute = (GLOBAL_BATCH // len(speeds)) * c0 / min(speeds)
        # per-step cost that is not compute (Lightning loop, data, optimizer, all-reduce), paid by every strategy
        overhead_s = max(ddp["step_s_median"] - ddp_compute, 0.0)
        sizes = het.get("batch_sizes") or []
        row = {
            "platform": name,
            "steps": steps,
            "ddp_fit_s": ddp["fit_s"],
            "het_fit_s": het["fit_s"],
            "ideal_fit_s": steps * ideal_step,
            "ddp_step_ms": ddp["step_s_median"] * 1e3,
            "het_step_ms": het["step_s_median"] * 1e3,
            "ideal_step_ms": ideal_step * 1e3,
            "split_step_ms": max((b * c0 / v for b, v in zip(sizes, speeds)), default=float("nan")) * 1e3,
            "overhead_ms": overhead_s * 1e3,
            "speedup": ddp["fit_s"] / het["fit_s"],
            "ideal_speedup": _ideal_speedup(speeds),
            "ideal_speedup_with_overhead": (ddp_compute + overhead_s) / (ideal_step + overhead_s),
            "profile_s": het.get("profile_s", 0.0),
            "batch_sizes": sizes,
        }
        row["fraction_of_ideal_speedup"] = row["speedup"] / row["ideal_speedup"]
        row["fraction_of_ideal_speedup_with_overhead"] = row["speedup"] / row["ideal_speedup_with_overhead"]
        row["profile_share"] = row["profile_s"] / het["fit_s"]
        rows.append(row)
    emu = by_name["1:2:4 het emulate_slowdown"]
    ref = by_name["1:2:4 ddp"]
    emulation = {
        "fit_s": emu["fit_s"],
        "steps": emu["global_step"],
        "step_ms": emu["step_s_median"] * 1e3,
        "batch_sizes": emu.get("batch_sizes"),
        # fit time per optimizer step (this run is shorter than the platform rows)
        "speedup": (ref["fit_s"] / ref["global_step"]) / (emu["fit_s"] / emu["global_step"]),
    }
    new_ideal = _slowed_ideal_samples_per_s(c0)
    slowdown: dict[str, Any] = {
        "new_ideal_samples_per_s": new_ideal,
        "old_ideal_samples_per_s": GLOBAL_BATCH / _ideal_step_s(PLATFORMS[SLOWDOWN["platform"]], c0),
    }
    for label in ("static", "rebalanced"):
        r = by_name[f"slowdown {label}"]
        per_epoch = [GLOBAL_BATCH * r["steps"] / s for s in r["epoch_s"]]
        slowdown[label] = {
            "steps_per_epoch": r["steps"],
            "samples_per_s": per_epoch,
            "fraction_of_new_ideal": [x / new_ideal for x in per_epoch],
            "fit_s": r["fit_s"],
            "rebalances": [
                {k: e[k] for k in ("epoch", "from", "batch_sizes", "reason")}
                for e in (r.get("telemetry") or {}).get("rebalances", [])
            ],
            "report_paths": r.get("report_paths"),
        }
    over = _overhead_summary(overhead)
    sharded = _sharded_line(by_name) if "1:2:4 sharded het" in by_name else None
    return {"platforms": rows, "emulation": emulation, "slowdown": slowdown, "overhead": over, "sharded": sharded}


def _overhead_summary(overhead: list[dict]) -> dict[str, Any]:
    """The homogeneous-overhead pairs: step and CPU times of each strategy and the overhead per alternated pair."""
    runs = [r for r in overhead if r["name"].startswith(("overhead ddp", "overhead het"))]
    over = {
        "ddp_step_ms": [r["step_s_median"] * 1e3 for r in runs if r["strategy"] == "ddp"],
        "het_step_ms": [r["step_s_median"] * 1e3 for r in runs if r["strategy"] == "het"],
        "ddp_cpu_ms": [r["step_cpu_s_median"] * 1e3 for r in runs if r["strategy"] == "ddp"],
        "het_cpu_ms": [r["step_cpu_s_median"] * 1e3 for r in runs if r["strategy"] == "het"],
        "ddp_step_p10_ms": [r["step_s_p10"] * 1e3 for r in runs if r["strategy"] == "ddp"],
        "het_step_p10_ms": [r["step_s_p10"] * 1e3 for r in runs if r["strategy"] == "het"],
        "overhead_per_pair": _pairs(runs, "step_s_p10"),
        "cpu_overhead_per_pair": _pairs(runs, "step_cpu_s_p10"),
        "median_overhead_per_pair": _pairs(runs, "step_s_median"),
        "het_profile_s": [r.get("profile_s", 0.0) for r in runs if r["strategy"] == "het"],
    }
    over["overhead"] = statistics.median(over["overhead_per_pair"])
    over["cpu_overhead"] = statistics.median(over["cpu_overhead_per_pair"])
    return over


def _overhead_line(o: dict[str, Any]) -> str:
    pairs = ", ".join(f"{p:+.1%}" for p in o["overhead_per_pair"])
    return (
        f"step time (10th percentile) DDP {statistics.median(o['ddp_step_p10_ms']):.2f} ms, heterogeneous"
        f" {statistics.median(o['het_step_p10_ms']):.2f} ms; overhead per step, median over the pairs:"
        f" {o['overhead']:+.2%} wall clock ({pairs}), {o['cpu_overhead']:+.2%} CPU time of rank 0"
    )


def _clock_cost_us(iterations: int = 3000, repeats: int = 5) -> float:
    """Extra microseconds per step that :class:`~lightning_het.balance.clock.StepClock` adds to a tiny autograd step
    (best of ``repeats``, single process, no DDP): the telemetry's own per-step cost."""
    import torch

    from lightning_het.balance.clock import StepClock

    w = torch.ones(4, requires_grad=True)

    def steps(clock: Any) -> float:
        start = time.perf_counter()
        for _ in range(iterations):
            if clock is not None:
                clock.step_start(4)
            loss = (w * 2.0).sum()
            if clock is not None:
                clock.forward_end()
                clock.before_backward(loss)
            loss.backward()
            if clock is not None:
                clock.after_backward()
        if clock is not None:
            clock.flush()
        return (time.perf_counter() - start) / iterations

    plain = min(steps(None) for _ in range(repeats))
    timed = min(steps(StepClock()) for _ in range(repeats))
    return max(timed - plain, 0.0) * 1e6


def _markdown(summary: dict[str, Any], args: argparse.Namespace, command: str, elapsed: float) -> str:
    lines = [
        f"Command: `{command}` ({elapsed / 60:.1f} min on {os.cpu_count()} CPU cores; load average"
        f" {args.load_before:.1f} before and {args.load_after:.1f} after the run, other jobs sharing the machine)."
        f" Sleep-based compute, c0 = {args.c0 * 1e3:g} ms per sample at speed 1, global batch {GLOBAL_BATCH},"
        f" {args.epochs} epochs; `HeterogeneousStrategy()` with default arguments.",
        "",
        "**Whole `fit` (profiling included), 3 replicas.** Step times are medians. *o* is the per-step cost that is not"
        " compute (Lightning's loop, data, optimizer, all-reduce), measured on DDP as its step minus its compute; the"
        " last column is the best speedup any split could reach when every step also pays *o*.",
        "",
        "| platform | steps | DDP fit (s) | heterogeneous fit (s) | speedup vs DDP | ideal speedup | % of ideal |"
        " batch sizes | het step (ms) | ideal step, best split (ms) | o (ms) | profiling (s, % of fit) |"
        " % of ideal with o |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in summary["platforms"]:
        lines.append(
            f"| {r['platform']} | {r['steps']} | {r['ddp_fit_s']:.2f} | {r['het_fit_s']:.2f} | {r['speedup']:.3f}x |"
            f" {r['ideal_speedup']:.3f}x | **{r['fraction_of_ideal_speedup']:.1%}** | {r['batch_sizes']} |"
            f" {r['het_step_ms']:.1f} | {r['ideal_step_ms']:.1f}, {r['split_step_ms']:.1f} | {r['overhead_ms']:.1f} |"
            f" {r['profile_s']:.2f} ({r['profile_share']:.1%}) | {r['fraction_of_ideal_speedup_with_overhead']:.1%} |"
        )
    e = summary["emulation"]
    s = summary["slowdown"]
    lines += [
        "",
        f"`EmulatedPlatform(slowdown=[4, 2, 1])` on a homogeneous model (the 1:2:4 platform through the strategy's own"
        f" emulation, {e['steps']} steps): fit {e['fit_s']:.2f} s, step {e['step_ms']:.1f} ms, batch sizes"
        f" {e['batch_sizes']}, speedup vs DDP on 1:2:4 (fit time per step) {e['speedup']:.3f}x.",
        "",
        f"**Mid-run slowdown.** Platform {SLOWDOWN['platform']}, {s['static']['steps_per_epoch']} steps per epoch;"
        f" rank {SLOWDOWN['rank']} becomes {SLOWDOWN['factor']:g}x slower from epoch {SLOWDOWN['epoch']}. Throughput"
        f" per epoch as a fraction of the new ideal ({s['new_ideal_samples_per_s']:.1f} samples/s; before epoch"
        f" {SLOWDOWN['epoch']} the ideal was {s['old_ideal_samples_per_s']:.1f}):",
        "",
    ]
    n = len(s["static"]["samples_per_s"])
    lines.append("| run | " + " | ".join(f"epoch {i}" for i in range(n)) + " | fit (s) |")
    lines.append("|---|" + "---:|" * (n + 1))
    for label in ("static", "rebalanced"):
        fr = s[label]["fraction_of_new_ideal"]
        lines.append(f"| {label} | " + " | ".join(f"{x:.0%}" for x in fr) + f" | {s[label]['fit_s']:.2f} |")
    for e in s["rebalanced"]["rebalances"]:
        lines += [
            "",
            f"Rebalanced at the end of epoch {e['epoch']}: {e['from']} -> {e['batch_sizes']} ({e['reason']}).",
        ]
    lines += [summary["sharded"]] if summary.get("sharded") else []
    o = summary["overhead"]
    pairs = ", ".join(f"{p:+.1%}" for p in o["overhead_per_pair"])
    cpu_pairs = ", ".join(f"{p:+.1%}" for p in o["cpu_overhead_per_pair"])
    lines += [
        "",
        f"**Homogeneous overhead** (2 replicas, real compute: MLP width {args.overhead_width}, batch"
        f" {args.overhead_batch} per replica, {args.overhead_epochs} epochs x {args.overhead_steps} steps,"
        f" {args.repeats} alternated DDP / heterogeneous pairs): step time DDP"
        f" {statistics.median(o['ddp_step_p10_ms']):.2f} ms, heterogeneous"
        f" {statistics.median(o['het_step_p10_ms']):.2f} ms (10th percentile of each run's steps, which other jobs"
        " on the machine can only lengthen; medians"
        f" {statistics.median(o['ddp_step_ms']):.2f} and {statistics.median(o['het_step_ms']):.2f} ms). Overhead per"
        f" step, median over the pairs: **{o['overhead']:+.2%}** wall clock ({pairs}), {o['cpu_overhead']:+.2%} CPU"
        f" time of rank 0 ({cpu_pairs}). Profiling adds"
        f" {statistics.median(o['het_profile_s']):.2f} s once per fit. The telemetry clock alone costs"
        f" {summary['clock_cost_us']:.1f} us per step (tight loop, best of 5).",
    ]
    return "\n".join(lines) + "\n"


def _plots(summary: dict[str, Any], img_dir: Path) -> dict[str, Path]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    img_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    rows = summary["platforms"]
    fig = Figure(figsize=(8, 3.6))
    ax = fig.subplots()
    width = 0.27
    xs = range(len(rows))
    for i, (key, label) in enumerate(
        (
            ("ddp_fit_s", "Lightning DDP (equal split)"),
            ("het_fit_s", "heterogeneous (profiled)"),
            ("ideal_fit_s", "ideal"),
        )
    ):
        ax.bar([x + (i - 1) * width for x in xs], [r[key] for r in rows], width, label=label)
    ax.set_xticks(list(xs), [r["platform"] for r in rows])
    ax.set_ylabel("whole fit (s)")
    ax.set_title("Training time on emulated platforms (3 replicas, global batch 48)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    paths["platforms"] = img_dir / "bench_balance_platforms.png"
    FigureCanvasAgg(fig).print_png(str(paths["platforms"]))

    s = summary["slowdown"]
    fig = Figure(figsize=(8, 3.6))
    ax = fig.subplots()
    for label in ("static", "rebalanced"):
        ys = s[label]["samples_per_s"]
        ax.plot(range(len(ys)), ys, marker="o", label=label)
    n = len(s["static"]["samples_per_s"])
    ideal = [s["old_ideal_samples_per_s"] if i < SLOWDOWN["epoch"] else s["new_ideal_samples_per_s"] for i in range(n)]
    ax.step(range(n), ideal, where="mid", color="k", ls="--", lw=1, label="ideal")
    ax.axvline(SLOWDOWN["epoch"] - 0.5, color="grey", lw=0.8)
    ax.set_xlabel("epoch")
    ax.set_ylabel("samples / s")
    ax.set_title(f"Rank {SLOWDOWN['rank']} becomes {SLOWDOWN['factor']:g}x slower at epoch {SLOWDOWN['epoch']}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    paths["slowdown"] = img_dir / "bench_balance_slowdown.png"
    FigureCanvasAgg(fig).print_png(str(paths["slowdown"]))
    report_png = (s["rebalanced"].get("report_paths") or {}).get("plot")
    if report_png and Path(report_png).exists():
        paths["report"] = img_dir / "bench_balance_report.png"
        paths["report"].write_bytes(Path(report_png).read_bytes())
    return paths


def _brief(runs: list[dict], c0: float, command: str, elapsed: float) -> str:
    """A short Markdown report of a ``--only`` subset: every run, and the ratios its pairs allow."""
    by_name = {r["name"]: r for r in runs}
    lines = [
        f"Command: `{command}` ({elapsed / 60:.1f} min; c0 = {c0 * 1e3:g} ms per sample at speed 1, global batch"
        f" {GLOBAL_BATCH})",
        "",
        "| run | steps | fit (s) | step median (ms) | batch sizes | profiling (s) |",
        "|---|---:|---:|---:|---|---:|",
    ]
    for r in runs:
        lines.append(
            f"| {r['name']} | {r['global_step']} | {r['fit_s']:.2f} | {r['step_s_median'] * 1e3:.1f}"
            f" | {r.get('batch_sizes')} | {r.get('profile_s', 0.0):.2f} |"
        )
    for name, speeds in PLATFORMS.items():
        ddp, het = by_name.get(f"{name} ddp"), by_name.get(f"{name} het")
        if ddp and het:
            speedup = ddp["fit_s"] / het["fit_s"]
            ideal = _ideal_speedup(speeds)
            lines.append(
                f"\n{name}: speedup of the whole fit {speedup:.3f}x of the ideal {ideal:.3f}x ="
                f" **{speedup / ideal:.1%}**; profiling {het.get('profile_s', 0.0) / het['fit_s']:.1%} of the fit"
            )
    lines += [_sharded_line(by_name)] if "1:2:4 sharded het" in by_name else []
    new_ideal = _slowed_ideal_samples_per_s(c0)
    for label in ("static", "rebalanced"):
        r = by_name.get(f"slowdown {label}")
        if r:
            fractions = [GLOBAL_BATCH * r["steps"] / s / new_ideal for s in r["epoch_s"]]
            lines.append(
                f"\nslowdown {label}: throughput per epoch as a fraction of the new ideal:"
                f" {', '.join(f'{f:.0%}' for f in fractions)}"
            )
    return "\n".join(lines) + "\n"


def _sharded_line(by_name: dict[str, dict]) -> str:
    """The sharded 1:2:4 row: HeterogeneousFSDPStrategy's whole fit against ModelParallelStrategy's (equal split)."""
    mp, het = by_name["1:2:4 sharded mp"], by_name["1:2:4 sharded het"]
    speedup, ideal = mp["fit_s"] / het["fit_s"], _ideal_speedup(PLATFORMS["1:2:4"])
    return (
        f"\n**Sharded (FSDP2), 1:2:4:** `ModelParallelStrategy` fit {mp['fit_s']:.2f} s, `HeterogeneousFSDPStrategy`"
        f" {het['fit_s']:.2f} s (batch sizes {het.get('batch_sizes')}): {speedup:.3f}x of the ideal {ideal:.3f}x ="
        f" **{speedup / ideal:.1%}**."
    )


def _update_docs(doc: Path, section: str) -> None:
    text = doc.read_text()
    if DOC_BEGIN not in text or DOC_END not in text:
        raise RuntimeError(f"{doc} has no {DOC_BEGIN} ... {DOC_END} section to fill")
    head, rest = text.split(DOC_BEGIN, 1)
    _, tail = rest.split(DOC_END, 1)
    doc.write_text(f"{head}{DOC_BEGIN}\n{section}{DOC_END}{tail}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        _worker(argv[1])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="CI-sized settings (seconds)")
    parser.add_argument("--docs", action="store_true", help="write plots to docs/img and fill docs/benchmarks.md")
    parser.add_argument("--out", type=Path, default=REPO / "bench_results" / "balance")
    parser.add_argument("--c0", type=float, default=None, help="seconds per sample at speed 1")
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None, help="steps per epoch")
    parser.add_argument("--repeats", type=int, default=None, help="alternated DDP/heterogeneous overhead runs")
    parser.add_argument(
        "--only",
        nargs="+",
        default=None,
        metavar="PREFIX",
        help="run only the platform jobs whose name starts with one of these (e.g. '1:2:4 ddp' '1:2:4 het' slowdown;"
        " 'overhead': the homogeneous-overhead pairs; 'profiling': profiling's cost on 30- and 90-step fits);"
        " skips the overhead runs and prints a short table instead of the full report",
    )
    args = parser.parse_args(argv)
    tiny = args.tiny
    args.c0 = args.c0 if args.c0 is not None else (0.002 if tiny else 0.016)
    args.epochs = args.epochs if args.epochs is not None else (2 if tiny else 10)
    args.steps = args.steps if args.steps is not None else (4 if tiny else 36)
    args.repeats = args.repeats if args.repeats is not None else (1 if tiny else 8)
    args.overhead_steps = 5 if tiny else 100
    args.overhead_epochs = 1
    args.overhead_batch = 16 if tiny else 128
    args.overhead_width = 32 if tiny else 512
    args.load_before = os.getloadavg()[0]
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    command = "python scripts/bench_balance.py " + " ".join(argv)
    platforms_plan, overhead_plan = _plan(args)
    start = time.perf_counter()
    timeout = 120 if tiny else 1200
    if args.only:
        keep = [p for p in platforms_plan[1:] if p["name"].startswith(tuple(args.only))]
        affine, memory = "affine" in args.only, "memory" in args.only
        if "profiling" in args.only:  # profiling's cost on short fits (1:2:4 and affine)
            runs = _launch("profiling3", 3, _profiling_plan(args, "1:2:4"), out, args.c0, timeout)[1:]
            runs += _launch("profiling2", 2, _profiling_plan(args, "affine"), out, args.c0, timeout)[1:]
            table = (
                f"{command.strip()} (load average {args.load_before:.1f} before, {os.getloadavg()[0]:.1f} after)\n\n"
            )
            table += _profiling_markdown(runs)
            (out / "profiling.json").write_text(json.dumps(runs, indent=1))
            (out / "profiling.md").write_text(table)
            print(table)
            if not keep and not affine and not memory and "overhead" not in args.only:
                return 0
        if "overhead" in args.only:  # the homogeneous-overhead pairs alone
            over = _overhead_summary(_launch("overhead", 2, overhead_plan, out, args.c0, timeout))
            (out / "overhead.json").write_text(json.dumps(over, indent=1))
            print(f"{command.strip()}\n{_overhead_line(over)}")
            if not keep and not affine and not memory:
                return 0
        if "profiling" in args.only and not keep and not affine and not memory:
            return 0
        if not keep and not affine and not memory:
            names = [p["name"] for p in platforms_plan[1:]]
            parser.error(f"--only {args.only} matches none of {names} (or 'affine', 'memory')")
        runs = _launch("platforms", 3, platforms_plan[:1] + keep, out, args.c0, timeout)[1:] if keep else []
        brief = _brief(runs, args.c0, command.strip(), time.perf_counter() - start) if runs else ""
        if affine:
            affine_runs = _launch("affine", 2, _affine_plan(args), out, args.c0, timeout)[1:]
            runs += affine_runs
            brief += (
                f"\nload average {args.load_before:.1f} before, {os.getloadavg()[0]:.1f} after\n\n"
                + _affine_markdown(_affine_summary(affine_runs))
            )
        if memory:
            memory_runs = _launch("memory", 2, _memory_plan(args), out, args.c0, timeout)[1:]
            runs += memory_runs
            brief += (
                f"\nload average {args.load_before:.1f} before, {os.getloadavg()[0]:.1f} after\n\n"
                + _affine_markdown(_affine_summary(memory_runs, MEMORY, MEMORY_RUNS, steady=True), MEMORY, "Memory")
            )
        (out / "results.json").write_text(json.dumps(runs, indent=1))
        (out / "results.md").write_text(brief)
        print(brief)
        return 0
    platforms = _launch("platforms", 3, platforms_plan, out, args.c0, timeout)
    affine_plan, memory_plan = _affine_plan(args), _memory_plan(args)
    if tiny:  # one 2-replica job for all: starting the workers costs more than these fits
        both = _launch("overhead", 2, overhead_plan + affine_plan + memory_plan, out, args.c0, timeout)
        overhead, rest = both[: len(overhead_plan)], both[len(overhead_plan) :]
        affine_runs, memory_runs = rest[1 : len(affine_plan)], rest[len(affine_plan) + 1 :]
    else:
        overhead = _launch("overhead", 2, overhead_plan, out, args.c0, timeout)
        affine_runs = _launch("affine", 2, affine_plan, out, args.c0, timeout)[1:]
        memory_runs = _launch("memory", 2, memory_plan, out, args.c0, timeout)[1:]
    elapsed = time.perf_counter() - start
    args.load_after = os.getloadavg()[0]
    summary = _summarise([r for r in platforms if r["name"] != "warm-up"], overhead[1:], args.c0)
    summary["affine"] = _affine_summary(affine_runs)
    summary["memory"] = _affine_summary(memory_runs, MEMORY, MEMORY_RUNS, steady=True)
    summary["clock_cost_us"] = _clock_cost_us(300, 2) if tiny else _clock_cost_us()
    summary["settings"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    summary["command"] = command
    summary["elapsed_s"] = elapsed
    table = _markdown(summary, args, command.strip(), elapsed) + "\n" + _affine_markdown(summary["affine"])
    table += "\n" + _affine_markdown(summary["memory"], MEMORY, "Memory")
    img_dir = REPO / "docs" / "img" if args.docs else out
    paths = _plots(summary, img_dir)
    summary["plots"] = {k: str(v) for k, v in paths.items()}
    (out / "results.json").write_text(json.dumps(summary, indent=1))
    (out / "results.md").write_text(table)
    if args.docs:
        _update_docs(REPO / "docs" / "benchmarks.md", table)
    print(table)
    print(f"results: {out / 'results.json'}; plots: {', '.join(str(p) for p in paths.values())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
