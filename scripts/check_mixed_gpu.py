#!/usr/bin/env python
"""Mixed CPU/GPU replicas for real: exactness against one process, and throughput GPU-only vs GPU+CPU.

Run on a machine with at least one CUDA GPU, from the repository root, in the project's environment::

    python scripts/check_mixed_gpu.py                      # ~3-5 min; writes mixed_gpu_results/{results.json,.md}
    python scripts/check_mixed_gpu.py --cpu-replicas 2     # GPU + 2 CPU replicas (the host's cores split between them)
    python scripts/check_mixed_gpu.py --simulate-gpu-with-cpu --quick   # no GPU: exercise the script itself only

What it does, each job in its own process group (Lightning's ``popen`` launcher, gloo or NCCL on 127.0.0.1):

1. **exactness**: ``device_map=["cuda:0", "cpu", ...]``, profiled batch split, float64 (``precision="64-true"``), a
   small MLP, 2 epochs; the final weights of *every* rank are compared with one plain-torch process training on the
   whole global batch on the CPU (same initial weights, same sample order). Pass: max |difference| < ``--tolerance``.
2. **throughput**: a small CNN on synthetic 3x32x32 images, fixed global batch, the same timed steps for
   ``gpu_only`` (``["cuda:0"]``), ``cpu_only`` (the CPU replicas alone: what they add at best) and ``gpu+cpu``.
   Data lives on each replica's device (indices are loaded, images are gathered on the device), so the figures measure
   compute and gradient communication, not a data pipeline. Step time = wall time between consecutive batch ends on
   rank 0 (CUDA synchronised), median over the timed steps, after warm-up; the allocation comes from the strategy's
   profiler, as in real use.

4. **sync**: the GPU + CPU throughput job again, counting ``torch.cuda.synchronize`` calls (the function wrapped in
   the GPU replica) between batch ends: with telemetry on, the step clock times a GPU step with CUDA events and must
   not synchronise the device per step (pass: 0 per step); and the profiled split must give the GPU replica more
   samples than any CPU replica (a step timed with the gradient all-reduce's wait would make them look equally fast).

Exit status: 0 when every job ran and exactness passed, 1 when a job failed or exactness failed, 2 without a GPU.
Paste the printed Markdown table into ``docs/mixed_devices.md`` ("Measured speed-up"), with the machine line.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from _workers import REPO, Worker, run_workers, worker_env

if str(REPO) not in sys.path:  # runnable as `python scripts/check_mixed_gpu.py` without installing the package
    sys.path.insert(0, str(REPO))

import torch
from torch import nn

from lightning_het.cluster.rendezvous import free_port

EXACT_SAMPLES, EXACT_BATCH, EXACT_EPOCHS, EXACT_FEATURES, EXACT_LR = 192, 24, 2, 16, 0.05
IMAGE_POOL = 4096  # distinct synthetic images; the dataset indexes them modulo the pool
JOBS = ("exactness", "gpu_only", "cpu_only", "gpu+cpu", "memory", "sync")


# --------------------------------------------------------------------------- models and data (driver and workers)
def make_mlp(seed: int = 7) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(EXACT_FEATURES, 32), nn.Tanh(), nn.Linear(32, 1))


def make_cnn(seed: int = 7) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 64, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(64, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(128, 128, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(128, 10),
    )


def regression_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(123)
    x = torch.randn(EXACT_SAMPLES, EXACT_FEATURES, generator=g, dtype=torch.float64)
    w = torch.linspace(-1.0, 1.0, EXACT_FEATURES, dtype=torch.float64)
    y = (x @ w + 0.1 * torch.randn(EXACT_SAMPLES, generator=g, dtype=torch.float64)).unsqueeze(1)
    return x, y


def image_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(321)
    return torch.randn(IMAGE_POOL, 3, 32, 32, generator=g), torch.randint(0, 10, (IMAGE_POOL,), generator=g)


# --------------------------------------------------------------------------- worker: one Lightning job
def run_worker(cfg: dict[str, Any], out: Path) -> None:
    """One training job (Lightning re-runs this command line for local ranks >= 1)."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_het

    class Resident(pl.LightningModule):
        """Trains on data resident on the replica's device; batches carry sample indices only."""

        def __init__(self, kind: str) -> None:
            super().__init__()
            self.kind = kind
            self.net = make_mlp() if kind == "exact" else make_cnn()
            self._x, self._y = regression_data() if kind == "exact" else image_data()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (idx,) = batch
            if self._x.device != self.device:
                self._x, self._y = self._x.to(self.device), self._y.to(self.device)
            idx = idx.to(self.device) % len(self._x)
            out = self.net(self._x[idx])
            if self.kind == "exact":
                return nn.functional.mse_loss(out, self._y[idx])
            return nn.functional.cross_entropy(out, self._y[idx])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=EXACT_LR, momentum=0.9)

        def setup(self, stage: str) -> None:
            if cfg.get("gpu_memory_fraction") and self.device.type == "cuda":  # a small card: real OOM errors
                torch.cuda.set_per_process_memory_fraction(cfg["gpu_memory_fraction"], self.device)

    syncs: list[int] = [0]  # torch.cuda.synchronize calls so far (the sync job)
    if cfg.get("count_syncs"):
        real_synchronize = torch.cuda.synchronize

        def counting_synchronize(*args: Any, **kwargs: Any) -> None:
            syncs[0] += 1
            real_synchronize(*args, **kwargs)

        torch.cuda.synchronize = counting_synchronize

    class StepClock(pl.Callback):
        def __init__(self) -> None:
            self.ends: list[float] = []
            self.syncs: list[int] = []

        def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
            if module.device.type == "cuda" and not cfg.get("count_syncs"):  # counting: no synchronisation of ours
                torch.cuda.synchronize(module.device)
            self.ends.append(time.perf_counter())
            self.syncs.append(syncs[0])

    if cfg["kind"] == "exact":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    pl.seed_everything(0)
    clock = StepClock()
    strategy = lightning_het.HeterogeneousStrategy(
        device_map=cfg["device_map"],
        global_batch_size=cfg["global_batch"],
        timeout=cfg["timeout"],
        max_micro_batch_sizes=cfg.get("micro"),
    )
    trainer = pl.Trainer(
        strategy=strategy,  # accelerator and devices stay "auto": the device map decides
        precision="64-true" if cfg["kind"] == "exact" else "32-true",
        max_epochs=EXACT_EPOCHS if cfg["kind"] == "exact" else 1,
        max_steps=-1 if cfg["kind"] == "exact" else cfg["warmup"] + cfg["steps"] + 1,
        callbacks=[clock],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    n = EXACT_SAMPLES if cfg["kind"] == "exact" else cfg["global_batch"] * (cfg["warmup"] + cfg["steps"] + 2)
    loader = DataLoader(TensorDataset(torch.arange(n)), batch_size=8, shuffle=cfg["kind"] == "exact")
    model = Resident(cfg["kind"])
    trainer.fit(model, loader)
    s = trainer.strategy
    rank = trainer.global_rank
    record = {
        "rank": rank,
        "device": str(s.root_device),
        "threads": torch.get_num_threads(),
        "backend": s.process_group_backend,
        "batch_sizes": s.batch_sizes,
        "speeds": s.speeds,
        "devices": s.balance_report()["devices"],
        "micro_caps": s.balance_report().get("max_micro_batch_sizes"),
        "peak_gpu_mib": torch.cuda.max_memory_allocated(s.root_device) / 2**20 if s.root_device.type == "cuda" else 0,
        "profile_seconds": s.profile_seconds,
        "global_step": trainer.global_step,
        "step_ends": clock.ends,
        "syncs_at_batch_end": clock.syncs,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    torch.save({k: v.detach().cpu() for k, v in model.net.state_dict().items()}, out / f"rank{rank}.pt")


# --------------------------------------------------------------------------- driver
def launch(name: str, cfg: dict[str, Any], out: Path, timeout: float) -> list[dict[str, Any]]:
    """Run one job in its own session; kill the whole process group on timeout. Returns the per-rank records."""
    job_dir = out / name
    job_dir.mkdir(parents=True, exist_ok=True)
    for stale in job_dir.glob("rank*"):
        stale.unlink()
    env = worker_env("127.0.0.1", free_port())
    for launcher_set in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "GLOBAL_RANK"):  # the job sets these itself
        env.pop(launcher_set, None)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(cfg), str(job_dir)]
    print(f"[{name}] device_map={cfg['device_map']} global_batch={cfg['global_batch']} ...", flush=True)
    start = time.perf_counter()
    run_workers([Worker(cmd, env, job_dir / "log.txt")], timeout=timeout, name=f"[{name}]")
    world = len(cfg["device_map"])
    records = [json.loads(p.read_text()) for p in sorted(job_dir.glob("rank*.json"))]
    if len(records) != world:
        tail = (job_dir / "log.txt").read_text()[-3000:]
        raise RuntimeError(f"[{name}] only {len(records)}/{world} ranks reported:\n{tail}")
    print(f"[{name}] done in {time.perf_counter() - start:.0f}s", flush=True)
    return sorted(records, key=lambda r: r["rank"])


def reference_weights() -> dict[str, torch.Tensor]:
    """One process, plain torch, CPU, float64, the whole global batch per step, the order the job draws."""
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_het import ProportionalDistributedSampler

    x, y = regression_data()
    net = make_mlp().double()
    opt = torch.optim.SGD(net.parameters(), lr=EXACT_LR, momentum=0.9)
    dataset = TensorDataset(torch.arange(EXACT_SAMPLES))
    sampler = ProportionalDistributedSampler(dataset, [EXACT_BATCH], 0, shuffle=True, seed=0)
    for epoch in range(EXACT_EPOCHS):
        sampler.set_epoch(epoch)
        for (idx,) in DataLoader(dataset, batch_size=EXACT_BATCH, sampler=sampler):
            nn.functional.mse_loss(net(x[idx]), y[idx]).backward()
            opt.step()
            opt.zero_grad()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def throughput(records: list[dict[str, Any]], warmup: int, global_batch: int) -> dict[str, Any]:
    ends = records[0]["step_ends"]
    steps = [b - a for a, b in itertools.pairwise(ends)][warmup:]
    if not steps:
        raise RuntimeError("no timed steps were recorded")
    median = statistics.median(steps)
    return {
        "samples_per_s": global_batch / median,
        "median_step_ms": 1000 * median,
        "mean_step_ms": 1000 * statistics.fmean(steps),
        "timed_steps": len(steps),
        "batch_sizes": records[0]["batch_sizes"],
        "devices": records[0]["devices"],
        "threads": [r["threads"] for r in records],
        "backend": records[0]["backend"],
        "profile_seconds": max(r["profile_seconds"] for r in records),
    }


def sync_check(records: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """Synchronisations per step of rank 0 (the GPU replica) after the warm-up, and its share of the profiled split
    against the CPU replicas'."""
    counts = records[0]["syncs_at_batch_end"][warmup:]
    if len(counts) < 2:
        raise RuntimeError("no timed steps were recorded")
    per_step = (counts[-1] - counts[0]) / (len(counts) - 1)
    sizes = records[0]["batch_sizes"]
    return {
        "syncs_per_step": per_step,
        "timed_steps": len(counts) - 1,
        "batch_sizes": sizes,
        "devices": records[0]["devices"],
        "passed": per_step == 0 and sizes[0] > max(sizes[1:]),
    }


def machine_line(simulated: bool) -> str:
    gpu = "simulated (CPU stands in for cuda:0)" if simulated else torch.cuda.get_device_name(0)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count()
    import lightning

    return (
        f"GPU: {gpu}; CPU: {platform.processor() or platform.machine()}, {cores} cores available; torch"
        f" {torch.__version__} (CUDA {torch.version.cuda}); lightning {lightning.__version__}; {platform.platform()}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("mixed_gpu_results"), help="results directory")
    parser.add_argument("--cpu-replicas", type=int, default=1, help="CPU replicas next to the GPU (default 1)")
    parser.add_argument("--global-batch", type=int, default=1024, help="images per step in the throughput jobs")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per throughput job")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps before them")
    parser.add_argument("--tolerance", type=float, default=1e-9, help="max |weight difference| (float64 jobs)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per job before it is killed")
    parser.add_argument(
        "--only",
        default=",".join(JOBS),
        help=f"comma-separated subset of the jobs {','.join(JOBS)} (default: all)",
    )
    parser.add_argument(
        "--memory-fraction", type=float, default=0.004, help="share of the GPU's memory in the memory job"
    )
    parser.add_argument("--quick", action="store_true", help="few small steps: a smoke test of the script")
    parser.add_argument(
        "--simulate-gpu-with-cpu", action="store_true", help="map cuda:0 to cpu (no GPU needed; figures meaningless)"
    )
    parser.add_argument("--worker", nargs=2, metavar=("CONFIG", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        run_worker(json.loads(args.worker[0]), Path(args.worker[1]))
        return 0

    simulated = args.simulate_gpu_with_cpu
    if not simulated and not torch.cuda.is_available():
        print(
            f"No CUDA GPU is visible (torch {torch.__version__}, CUDA build: {torch.version.cuda}). Run this on a GPU"
            " machine, or pass --simulate-gpu-with-cpu to test the script itself.",
            file=sys.stderr,
        )
        return 2
    if args.cpu_replicas < 1:
        parser.error("--cpu-replicas must be >= 1")
    wanted = [name.strip() for name in args.only.split(",") if name.strip()]
    if not wanted or any(name not in JOBS for name in wanted):
        parser.error(f"--only takes names among {','.join(JOBS)}, got {args.only!r}")
    if args.quick:
        args.global_batch, args.steps, args.warmup = min(args.global_batch, 64), min(args.steps, 4), min(args.warmup, 1)
    gpu = "cpu" if simulated else "cuda:0"
    cpus = ["cpu"] * args.cpu_replicas
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    machine = machine_line(simulated)
    print(machine, flush=True)
    results: dict[str, Any] = {"machine": machine, "command": " ".join([sys.executable, *sys.argv]), "ok": False}

    failures: dict[str, str] = {}

    def attempt(name: str, cfg: dict[str, Any]) -> list[dict[str, Any]] | None:
        """Run one job; a failure is recorded (with its log tail) and the remaining jobs still run."""
        try:
            return launch(name, cfg, out, args.timeout)
        except RuntimeError as error:
            print(error, file=sys.stderr, flush=True)
            failures[name] = str(error)[-3000:]
            return None

    # 1. exactness of the mixed job against one process
    common = {"timeout": args.timeout, "warmup": args.warmup, "steps": args.steps}
    exact_cfg = {**common, "kind": "exact", "device_map": [gpu, *cpus], "global_batch": EXACT_BATCH}
    records = attempt("exactness", exact_cfg) if "exactness" in wanted else None
    exact_ok = False
    if "exactness" not in wanted:
        results["exactness"] = {"skipped": True}
        exact_line = "Exactness: skipped (--only)"
    elif records is not None:
        reference = reference_weights()
        diffs = []
        for r in records:
            weights = torch.load(out / "exactness" / f"rank{r['rank']}.pt")
            diffs.append(max((weights[k].double() - reference[k]).abs().max().item() for k in reference))
        exact_ok = max(diffs) < args.tolerance
        results["exactness"] = {
            "device_map": exact_cfg["device_map"],
            "devices": records[0]["devices"],
            "backend": records[0]["backend"],
            "batch_sizes": records[0]["batch_sizes"],
            "speeds": records[0]["speeds"],
            "threads": [r["threads"] for r in records],
            "max_abs_diff_per_rank": diffs,
            "tolerance": args.tolerance,
            "passed": exact_ok,
        }
        verdict = "PASS" if exact_ok else "FAIL"
        print(f"exactness: max |w - w_ref| per rank {[f'{d:.2e}' for d in diffs]} -> {verdict}", flush=True)
        exact_line = (
            f"Exactness ({' + '.join(exact_cfg['device_map'])}, float64, profiled split {records[0]['batch_sizes']},"
            f" threads {[r['threads'] for r in records]}, {records[0]['backend']}): max |w - w_ref| ="
            f" {max(diffs):.2e} ({'pass' if exact_ok else 'FAIL'}, tolerance {args.tolerance:g})"
        )
    else:
        results["exactness"] = {"device_map": exact_cfg["device_map"], "passed": False, "error": failures["exactness"]}
        exact_line = f"Exactness ({' + '.join(exact_cfg['device_map'])}): the job FAILED (see results.json)"

    # 2. throughput: GPU alone, CPU replicas alone, GPU + CPU replicas
    jobs = {"gpu_only": [gpu], "cpu_only": cpus, "gpu+cpu": [gpu, *cpus]}
    jobs = {name: device_map for name, device_map in jobs.items() if name in wanted}
    measured: dict[str, Any] = {}
    for name, device_map in jobs.items():
        cfg = {**common, "kind": "throughput", "device_map": device_map, "global_batch": args.global_batch}
        job_records = attempt(name, cfg)
        if job_records is None:
            continue
        try:
            measured[name] = {"device_map": device_map, **throughput(job_records, args.warmup, args.global_batch)}
        except RuntimeError as error:
            failures[name] = str(error)
    # 3. memory: the GPU replica limited to a small share of its memory; max_micro_batch_sizes="auto" measures the cap
    # (real out-of-memory errors) and runs its share in micro-batches
    memory_line = "Memory: skipped (--only)"
    if "memory" in wanted:
        cfg = {**common, "kind": "throughput", "device_map": [gpu, *cpus], "global_batch": args.global_batch}
        cfg.update(micro="auto", gpu_memory_fraction=args.memory_fraction)
        job_records = attempt("memory", cfg)
        memory_line = "Memory: the job FAILED (see results.json)"
        if job_records is not None:
            row = {"device_map": cfg["device_map"], **throughput(job_records, args.warmup, args.global_batch)}
            row.update(micro_caps=job_records[0]["micro_caps"], peak_gpu_mib=job_records[0]["peak_gpu_mib"])
            results["memory"] = row
            memory_line = (
                f'Memory (GPU limited to {args.memory_fraction:g} of its memory, `max_micro_batch_sizes="auto"`):'
                f" measured caps {row['micro_caps']}, split {row['batch_sizes']}, peak GPU memory"
                f" {row['peak_gpu_mib']:.0f} MiB, {row['samples_per_s']:.0f} samples/s,"
                f" median step {row['median_step_ms']:.1f} ms"
            )
            print(memory_line, flush=True)
    # 4. sync: device synchronisations per step of the GPU replica, and its profiled share beside the CPU replicas
    sync_line = "Synchronisations: skipped (--only)"
    if "sync" in wanted:
        cfg = {**common, "kind": "throughput", "device_map": [gpu, *cpus], "global_batch": args.global_batch}
        cfg["count_syncs"] = True
        job_records = attempt("sync", cfg)
        sync_line = "Synchronisations: the job FAILED (see results.json)"
        if job_records is not None:
            results["sync"] = row = sync_check(job_records, args.warmup)
            sync_line = (
                f"Synchronisations (GPU + CPU, telemetry on): {row['syncs_per_step']:.2f} torch.cuda.synchronize per"
                f" step on the GPU replica over {row['timed_steps']} steps; profiled split {row['batch_sizes']}"
                f" ({'pass' if row['passed'] else 'FAIL'})"
            )
            print(sync_line, flush=True)
            if not row["passed"]:
                failures["sync"] = sync_line
    base = measured["gpu_only"]["samples_per_s"] if "gpu_only" in measured else None
    for row in measured.values():
        row["speedup_vs_gpu_only"] = row["samples_per_s"] / base if base else None
    if base and "cpu_only" in measured and "gpu+cpu" in measured:
        measured["gpu+cpu"]["ideal_speedup"] = (base + measured["cpu_only"]["samples_per_s"]) / base
    results["throughput"] = measured
    results["failures"] = failures
    results["ok"] = (exact_ok or "exactness" not in wanted) and not failures

    lines = [
        f"Machine: {machine}",
        f"Command: `{results['command']}`",
        "",
        exact_line,
        "",
        f"Throughput (CNN, 3x32x32, global batch {args.global_batch}, median of {args.steps} steps after"
        f" {args.warmup} warm-up steps):",
        "",
        "| job | device map | batch split | threads | backend | samples/s | step (ms) | speed-up vs GPU |",
        "|---|---|---|---|---|---:|---:|---:|",
    ]
    for name, device_map in jobs.items():
        row = measured.get(name)
        if row is None:
            lines.append(f"| {name} | {', '.join(device_map)} | FAILED (see results.json) | | | | | |")
            continue
        speedup = f"{row['speedup_vs_gpu_only']:.3f}" if row["speedup_vs_gpu_only"] is not None else "-"
        lines.append(
            f"| {name} | {', '.join(row['device_map'])} | {row['batch_sizes']} | {row['threads']} | {row['backend']}"
            f" | {row['samples_per_s']:.0f} | {row['median_step_ms']:.1f} | {speedup} |"
        )
    lines += ["", memory_line, "", sync_line]
    if "ideal_speedup" in measured.get("gpu+cpu", {}):
        lines += ["", f"Ideal GPU+CPU speed-up (sum of the two alone): {measured['gpu+cpu']['ideal_speedup']:.3f}"]
    if simulated:
        lines += ["", "SIMULATED: cuda:0 was replaced by a CPU replica; these figures say nothing about GPUs."]
    table = "\n".join(lines)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "results.md").write_text(table + "\n")
    print("\n" + table + f"\n\nwritten: {out / 'results.json'}, {out / 'results.md'}")
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
