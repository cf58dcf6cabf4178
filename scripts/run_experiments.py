#!/usr/bin/env python
"""The papers' comparison on an emulated heterogeneous platform, as one Hydra sweep of the app.

Methods (``strategy=`` options of the app), all with the same global batch, epochs, learning rate and data:

* ``equal_split``: plain data parallelism, every replica the same batch (the slowest replica sets the pace);
* ``unweighted``: speed-proportional batches, replicas' mean gradients averaged with equal weights (the 2020 code;
  biased toward the small batches of slow replicas);
* ``heterogeneous``: speed-proportional batches, gradients weighted by sample share (exact; ours);
* ``node_local``: speed-proportional batches, gradients exchanged inside each (emulated) node every step, parameters
  averaged across nodes every K steps (TNNLS 2023).

Not in the default sweep, for the inter-node bytes (``--methods``; docs/communication.md): ``allreduce`` (exact, DDP's
flat all-reduce on the emulated nodes: the bytes baseline), ``node_local_k16``, ``outer_sync`` (DiLoCo's outer
Nesterov step on the sample-weighted pseudo-gradient, int8 syncs once per epoch) and ``outer_sync_equal`` (the same
with every node weighted equally).

The platform is ``experiment=paper_comparison``: 3 CPU replicas, the second 2x and the third 4x slower
(``strategy.emulation.slowdown=[1,2,4]``); replicas 0-1 and 2 form two emulated nodes for ``node_local``. Each
(method, seed) is one job of ``lightning-het-train -m``, in its own directory with its own ``metrics.json``.

Run (about 12 jobs x 40-60 s on 2 cores)::

    python scripts/run_experiments.py                      # 4 methods x seeds 0,1,2 -> bench_results/paper_comparison
    python scripts/run_experiments.py --seeds 0 1 --methods equal_split heterogeneous -- trainer.max_epochs=4
    python scripts/run_experiments.py --collect bench_results/paper_comparison/runs   # tables/plots only

Everything after ``--`` is passed to the app as overrides (e.g. ``data=geotiff data.image=... data.labels=...`` or
``strategy.emulation.slowdown=[1,1,3]``). Writes into ``--out``: ``runs/<job>/`` (the sweep), ``results.csv`` (one row
per job), ``summary.csv`` and ``summary.md`` (mean and standard deviation per method), ``epoch_time.png``,
``accuracy.png`` and ``learning_curves.png``, and prints the command that produced them.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import shlex
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
METHODS = (
    "equal_split",
    "unweighted",
    "heterogeneous",
    "node_local",
    "allreduce",
    "node_local_k16",
    "outer_sync",
    "outer_sync_equal",
)
DEFAULT_METHODS = METHODS[:4]
LABELS = {
    "equal_split": "equal split (DDP)",
    "unweighted": "balanced, unweighted (2020)",
    "heterogeneous": "balanced, weighted (ours)",
    "node_local": "balanced, node-local",
    "allreduce": "balanced, weighted, flat all-reduce",
    "node_local_k16": "node-local K=16",
    "outer_sync": "node-local, outer Nesterov, int8, sample-weighted",
    "outer_sync_equal": "node-local, outer Nesterov, int8, equal node weights",
}
SCORES = ("test/oa", "test/aa", "test/kappa")
COLUMNS = (
    "method",
    "seed",
    "mean_epoch_time_s",
    "fit_time_s",
    "test/oa",
    "test/aa",
    "test/kappa",
    "inter_node_mb",
    "batch_sizes",
    "speeds",
    "job_dir",
)


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """Options of this script, and the overrides after ``--`` for the app."""
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), choices=METHODS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--experiment", default="paper_comparison", help="experiment config of the app")
    parser.add_argument("--out", type=Path, default=REPO / "bench_results" / "paper_comparison")
    parser.add_argument("--collect", type=Path, default=None, help="only tabulate an existing sweep directory")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--timeout", type=float, default=3 * 3600, help="seconds for the whole sweep")
    return parser.parse_args(argv), extra


def sweep_command(args: argparse.Namespace, extra: list[str], sweep_dir: Path) -> list[str]:
    """The app's multirun command line for the chosen methods and seeds."""
    return [
        sys.executable,
        "-m",
        "lightning_het.train",
        "-m",
        f"experiment={args.experiment}",
        f"strategy={','.join(args.methods)}",
        f"seed={','.join(str(s) for s in args.seeds)}",
        f"hydra.sweep.dir={sweep_dir}",
        *extra,
    ]


def _job_overrides(job_dir: Path) -> dict[str, str]:
    path = job_dir / ".hydra" / "overrides.yaml"
    overrides: dict[str, str] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            item = line.strip().removeprefix("- ").strip().strip("'\"")
            if "=" in item:
                key, value = item.split("=", 1)
                overrides[key.lstrip("+~")] = value
    return overrides


def collect(sweep_dir: Path) -> list[dict[str, Any]]:
    """One row per finished job of ``sweep_dir`` (jobs without ``metrics.json`` are reported and skipped)."""
    rows = []
    job_dirs = [p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()]
    for job_dir in sorted(job_dirs, key=lambda p: int(p.name)):
        metrics_path = job_dir / "metrics.json"
        if not metrics_path.is_file():
            print(f"warning: {job_dir} has no metrics.json (the job failed or is still running); skipped")
            continue
        metrics = json.loads(metrics_path.read_text())
        overrides = _job_overrides(job_dir)
        balance = metrics.get("balance", {})
        row = {
            "method": overrides.get("strategy", "heterogeneous"),
            "seed": int(overrides.get("seed", 0)),
            "mean_epoch_time_s": metrics.get("mean_epoch_time_s"),
            "fit_time_s": metrics.get("fit_time_s"),
            **{key: metrics[key] for key in SCORES},
            "inter_node_mb": metrics.get("comm", {}).get("job_bytes_inter_total", math.nan) / 1e6,
            "batch_sizes": " ".join(str(b) for b in balance.get("batch_sizes", [])),
            "speeds": " ".join(f"{s:.0f}" for s in balance.get("speeds", [])),
            "job_dir": str(job_dir),
            "history": metrics.get("history", []),
        }
        rows.append(row)
    return rows


def _mean_std(values: list[float]) -> tuple[float, float]:
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def _mean_batch_sizes(runs: list[str]) -> str:
    """Per-replica batch sizes averaged over runs (profiled allocations differ a little between runs)."""
    parsed = [[int(b) for b in run.split()] for run in runs if run]
    if not parsed or len({len(p) for p in parsed}) != 1:
        return runs[0] if runs else ""
    return " ".join(f"{statistics.fmean(column):.0f}" for column in zip(*parsed))


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean and standard deviation per method over seeds, in the order of :data:`METHODS`."""
    by_method: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        by_method[row["method"]].append(row)
    summary = []
    baseline = None
    for method in sorted(by_method, key=lambda m: METHODS.index(m) if m in METHODS else len(METHODS)):
        group = by_method[method]
        entry: dict[str, Any] = {"method": method, "runs": len(group)}
        for key in ("mean_epoch_time_s", "inter_node_mb", *SCORES):
            entry[key], entry[f"{key}_std"] = _mean_std([r[key] for r in group])
        entry["batch_sizes"] = _mean_batch_sizes([r["batch_sizes"] for r in group])
        if method == "equal_split":
            baseline = entry["mean_epoch_time_s"]
        summary.append(entry)
    ddp_bytes = next((e["inter_node_mb"] for e in summary if e["method"] == "allreduce"), math.nan)
    for entry in summary:
        entry["speedup_vs_equal_split"] = (
            baseline / entry["mean_epoch_time_s"] if baseline and entry["mean_epoch_time_s"] else math.nan
        )
        entry["fewer_inter_node_bytes"] = ddp_bytes / entry["inter_node_mb"] if entry["inter_node_mb"] else math.nan
    return summary


def write_tables(rows: list[dict[str, Any]], summary: list[dict[str, Any]], out: Path, command: str) -> None:
    """``results.csv``, ``summary.csv`` and ``summary.md``."""
    out.mkdir(parents=True, exist_ok=True)
    with (out / "results.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    keys = list(summary[0]) if summary else []
    with (out / "summary.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(summary)

    def cell(entry: dict[str, Any], key: str, digits: int) -> str:
        mean, std = entry[key], entry[f"{key}_std"]
        return "n/a" if math.isnan(mean) else f"{mean:.{digits}f} ± {std:.{digits}f}"

    lines = [
        "| method | runs | mean batch sizes | epoch time (s) | speed-up | inter-node MB | fewer bytes vs all-reduce"
        " | OA | AA | kappa |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for e in summary:
        speedup = "n/a" if math.isnan(e["speedup_vs_equal_split"]) else f"{e['speedup_vs_equal_split']:.2f}x"
        fewer = "n/a" if math.isnan(e["fewer_inter_node_bytes"]) else f"{e['fewer_inter_node_bytes']:.1f}x"
        mb = "n/a" if math.isnan(e["inter_node_mb"]) else f"{e['inter_node_mb']:.2f}"
        lines.append(
            f"| {LABELS.get(e['method'], e['method'])} | {e['runs']} | {e['batch_sizes']} |"
            f" {cell(e, 'mean_epoch_time_s', 2)} | {speedup} | {mb} | {fewer} | {cell(e, 'test/oa', 4)} |"
            f" {cell(e, 'test/aa', 4)} | {cell(e, 'test/kappa', 4)} |"
        )
    lines += ["", "Mean ± standard deviation over seeds; epoch time excludes the first epoch.", f"Command: `{command}`"]
    (out / "summary.md").write_text("\n".join(lines) + "\n")


def write_plots(rows: list[dict[str, Any]], summary: list[dict[str, Any]], out: Path) -> list[Path]:
    """Epoch time and accuracy bar charts, and validation-OA learning curves (mean over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    names = [LABELS.get(e["method"], e["method"]).replace(", ", ",\n") for e in summary]
    x = range(len(summary))

    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    ax.bar(
        x,
        [e["mean_epoch_time_s"] for e in summary],
        yerr=[e["mean_epoch_time_s_std"] for e in summary],
        color="tab:blue",
        capsize=4,
    )
    ax.set_xticks(list(x), names, fontsize="small")
    ax.set_ylabel("epoch time (s)")
    ax.set_title("Training time per epoch (emulated heterogeneous platform)")
    fig.tight_layout()
    paths.append(out / "epoch_time.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    width = 0.8 / len(SCORES)
    for i, key in enumerate(SCORES):
        ax.bar(
            [j + (i - 1) * width for j in x],
            [e[key] for e in summary],
            width,
            yerr=[e[f"{key}_std"] for e in summary],
            capsize=3,
            label=key.split("/")[1].upper(),
        )
    low = min((e[k] - e[f"{k}_std"] for e in summary for k in SCORES if not math.isnan(e[k])), default=0.0)
    ax.set_ylim(max(0.0, low - 0.05), 1.0)
    ax.set_xticks(list(x), names, fontsize="small")
    ax.legend(ncol=3, fontsize="small")
    ax.set_title("Test accuracy (mean ± std over seeds)")
    fig.tight_layout()
    paths.append(out / "accuracy.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    by_method: dict[str, list[list[float]]] = defaultdict(list)
    for row in rows:
        curve = [h.get("val/oa") for h in row["history"] if h.get("val/oa") is not None]
        if curve:
            by_method[row["method"]].append(curve)
    for method, curves in by_method.items():
        length = min(len(c) for c in curves)
        mean = [statistics.fmean(c[i] for c in curves) for i in range(length)]
        ax.plot(range(1, length + 1), mean, marker="o", label=LABELS.get(method, method))
    ax.set_xlabel("epoch")
    ax.set_ylabel("validation OA")
    ax.legend(fontsize="small")
    ax.set_title("Learning curves (mean over seeds)")
    fig.tight_layout()
    paths.append(out / "learning_curves.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths


def main(argv: list[str] | None = None) -> int:
    """Run the sweep (unless ``--collect``), then write the tables and plots. Returns the exit status."""
    args, extra = parse_args(argv)
    out: Path = args.out
    command = "python scripts/run_experiments.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    if args.collect is not None:
        sweep_dir = args.collect
    else:
        sweep_dir = out / "runs"
        if sweep_dir.exists() and any(sweep_dir.iterdir()):
            print(
                f"error: {sweep_dir} is not empty. HINT: choose another --out, or tabulate it with --collect.",
                file=sys.stderr,
            )
            return 2
        command_line = sweep_command(args, extra, sweep_dir)
        print("running:", shlex.join(command_line), flush=True)
        try:
            status = subprocess.run(command_line, cwd=REPO, timeout=args.timeout, check=False).returncode
        except subprocess.TimeoutExpired:
            print(f"error: the sweep did not finish within {args.timeout:.0f} s", file=sys.stderr)
            return 1
        if status != 0:
            print(f"warning: the sweep exited with status {status}; tabulating the jobs that finished", file=sys.stderr)
    if not sweep_dir.is_dir():
        print(f"error: {sweep_dir} does not exist", file=sys.stderr)
        return 2
    rows = collect(sweep_dir)
    if not rows:
        print(f"error: no finished job in {sweep_dir}", file=sys.stderr)
        return 1
    summary = summarize(rows)
    write_tables(rows, summary, out, command)
    written = [out / "results.csv", out / "summary.csv", out / "summary.md"]
    if not args.no_plots:
        written += write_plots(rows, summary, out)
    print((out / "summary.md").read_text())
    print("wrote:", ", ".join(str(p) for p in written))
    print("command:", command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
