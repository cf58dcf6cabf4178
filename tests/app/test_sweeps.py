"""Hydra multirun (``-m``) with multi-process training: one directory and one ``metrics.json`` per job, no duplicates.

Lightning's popen launcher re-executes the command line for every extra replica; re-executing a multirun command line
would start the whole sweep again inside every replica (Lightning issue #11300, PR #18175). The app runs each sweep
job as its own single run instead (``lightning_het.train.sweep_job_command``); this test is the regression test.
"""

from __future__ import annotations

import csv
import json
import re

import pytest
from test_cli import check_metrics, run_app


@pytest.mark.slow
def test_two_point_sweep_on_two_replicas(tmp_path):
    sweep_dir = tmp_path / "sweep"
    result = run_app(
        ["-m", "experiment=quick", "trainer.devices=2", "seed=0,1", f"hydra.sweep.dir={sweep_dir}"],
        cwd=tmp_path,
        timeout=400,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]

    # exactly one directory per job, each with its own metrics.json and its own overrides
    jobs = sorted(p for p in sweep_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
    assert [p.name for p in jobs] == ["0", "1"]
    for job, seed in zip(jobs, (0, 1)):
        metrics = check_metrics(job / "metrics.json", world_size=2)
        assert metrics["output_dir"] == str(job)
        overrides = (job / ".hydra" / "overrides.yaml").read_text()
        assert f"seed={seed}" in overrides
        assert (job / "prediction_map.tif").is_file()
        # the job's replicas ran inside the job: rank 1 logged into this directory
        assert (job / "train_ddp_process_1.log").is_file()

    # no duplicate sweep in the replicas: the sweep announced two jobs, two runs reported, nothing else was created
    assert len(re.findall(r"^\[sweep job \d+\]", result.stdout, flags=re.M)) == 2, result.stdout
    assert result.stdout.count("test: OA") == 2, result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep"]
    assert (sweep_dir / "multirun.yaml").is_file()
    seeds = {json.loads((job / "metrics.json").read_text())["history"][0]["train/loss"] for job in jobs}
    assert len(seeds) == 2  # different seeds, different runs


def _load_script():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "run_experiments.py"
    spec = importlib.util.spec_from_file_location("run_experiments", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_experiment_script_tabulates_a_sweep(tmp_path):
    """scripts/run_experiments.py --collect: rows per job, mean/std per method, speed-up, tables and plots."""
    script = _load_script()
    sweep = tmp_path / "runs"
    jobs = [("equal_split", 0, 4.0, 0.90), ("equal_split", 1, 4.2, 0.92), ("heterogeneous", 0, 2.0, 0.93)]
    for number, (method, seed, seconds, oa) in enumerate(jobs):
        job = sweep / str(number)
        (job / ".hydra").mkdir(parents=True)
        overrides = f"- experiment=paper_comparison\n- strategy={method}\n- seed={seed}\n"
        (job / ".hydra" / "overrides.yaml").write_text(overrides)
        metrics = {
            "test/oa": oa,
            "test/aa": oa - 0.01,
            "test/kappa": oa - 0.02,
            "mean_epoch_time_s": seconds,
            "fit_time_s": 10 * seconds,
            "balance": {"batch_sizes": [32, 32, 32], "speeds": [1.0, 1.0, 1.0]},
            "history": [{"epoch": 0, "val/oa": oa - 0.1}, {"epoch": 1, "val/oa": oa}],
        }
        (job / "metrics.json").write_text(json.dumps(metrics))
    (sweep / "3").mkdir()  # a failed job: no metrics.json

    out = tmp_path / "report"
    assert script.main(["--collect", str(sweep), "--out", str(out)]) == 0
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert [(r["method"], r["seed"]) for r in rows] == [(m, str(s)) for m, s, _, _ in jobs]
    summary = {r["method"]: r for r in csv.DictReader((out / "summary.csv").open())}
    assert float(summary["equal_split"]["mean_epoch_time_s"]) == pytest.approx(4.1)
    assert float(summary["heterogeneous"]["speedup_vs_equal_split"]) == pytest.approx(2.05)
    table = (out / "summary.md").read_text()
    assert "balanced, weighted (ours)" in table and "2.05x" in table
    for name in ("epoch_time.png", "accuracy.png", "learning_curves.png"):
        assert (out / name).stat().st_size > 0


def test_experiment_script_sweep_command():
    script = _load_script()
    args, extra = script.parse_args(["--seeds", "0", "1", "--methods", "equal_split", "unweighted", "--", "a=1"])
    command = script.sweep_command(args, extra, script.Path("/tmp/x"))
    assert command[1:4] == ["-m", "lightning_het.train", "-m"]
    assert "strategy=equal_split,unweighted" in command and "seed=0,1" in command
    assert "hydra.sweep.dir=/tmp/x" in command and command[-1] == "a=1"


def test_experiment_script_tabulates_inter_node_bytes(tmp_path):
    """The all-reduce row is the bytes baseline: each method's inter-node MB and how many times fewer."""
    script = _load_script()
    sweep = tmp_path / "runs"
    for number, (method, inter) in enumerate([("allreduce", 400e6), ("outer_sync", 2e6), ("heterogeneous", None)]):
        job = sweep / str(number)
        (job / ".hydra").mkdir(parents=True)
        (job / ".hydra" / "overrides.yaml").write_text(f"- strategy={method}\n- seed=0\n")
        metrics = {"test/oa": 0.9, "test/aa": 0.9, "test/kappa": 0.9, "mean_epoch_time_s": 1.0, "history": []}
        if inter is not None:
            metrics["comm"] = {"job_bytes_inter_total": inter}
        (job / "metrics.json").write_text(json.dumps(metrics))
    out = tmp_path / "report"
    assert script.main(["--collect", str(sweep), "--out", str(out), "--no-plots"]) == 0
    summary = {r["method"]: r for r in csv.DictReader((out / "summary.csv").open())}
    assert float(summary["outer_sync"]["fewer_inter_node_bytes"]) == pytest.approx(200.0)
    assert "| 2.00 | 200.0x |" in (out / "summary.md").read_text()
