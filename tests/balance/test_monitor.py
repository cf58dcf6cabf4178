"""The balance monitor end to end: telemetry of a 2-replica fit, the report files and the logged metrics."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from tests.helpers.harness import run_balance_job


def test_fast_replica_waits_when_balancing_is_off(tmp_path):
    """Two replicas, equal batches, rank 1 emulated 3x slower: its compute triples and rank 0 waits for it."""
    cfg = {
        "devices": 2,
        "strategy": {"speeds": [1, 1], "emulate_slowdown": [1, 3]},
        "epochs": 1,
        "n": 160,
        "batch_size": 8,
        "module": {"cost_per_sample_s": 0.005},
        "sleep_counts_as_cpu": True,  # the emulation stretches the sleeps as computation, exactly under any load
    }
    dumps = run_balance_job(tmp_path, cfg)
    report = dumps[0]["report"]
    epoch = report["telemetry"]["epochs"][0]
    compute, wait = epoch["compute_s"], epoch["wait_s"]
    assert epoch["steps"] == [10, 10]
    assert 2.4 <= compute[1] / compute[0] <= 3.6, epoch  # the emulation factor
    assert wait[0] >= 0.6 * (compute[1] - compute[0]), epoch  # the fast replica waits for the slow one ...
    assert wait[1] <= 0.25 * wait[0], epoch  # ... which hardly waits
    assert epoch["imbalance"] >= 2.0
    assert epoch["samples_per_s"][0] == pytest.approx(epoch["samples_per_s"][1], rel=0.15)  # same step time
    assert report["telemetry"]["checks"] == []  # no rebalancing configured
    assert len(report["telemetry"]["series"]["compute_s"][1]) == 10
    # the report files, written by rank 0 into the logger's directory, and the logged metrics
    paths = dumps[0]["report_paths"]
    assert set(paths) == {"json", "table", "plot"} and not dumps[1]["report_paths"]
    assert json.loads(Path(paths["json"]).read_text())["telemetry"]["epochs"][0]["steps"] == [10, 10]
    with open(tmp_path / "logs" / "version_0" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("het/imbalance")]
    assert len(rows) == 1 and float(rows[0]["het/wait_s/rank0"]) == pytest.approx(wait[0])


def _one_device_fit(strategy, root: Path, capfd, caplog) -> tuple[set[str], list[str], list[str]]:
    """A one-device fit logging to a ``CSVLogger`` in ``root``: the lines it printed (stdout, stderr, warnings, log
    records), the columns of its ``metrics.csv`` and the files of its log directory."""
    import logging
    import warnings

    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger
    from torch.utils.data import DataLoader

    from tests.helpers.tiny import TinyRegressor, make_dataset

    pl.seed_everything(0)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_epochs=2, default_root_dir=root, logger=CSVLogger(root),
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )  # fmt: skip
    capfd.readouterr()
    caplog.clear()
    caplog.set_level(logging.INFO)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(TinyRegressor(), DataLoader(make_dataset(40), batch_size=4))
    out, err = capfd.readouterr()
    printed = "\n".join([out, err, *caplog.messages, *(str(w.message) for w in caught)])
    lines = {line.replace(str(root), "ROOT") for line in printed.splitlines()}
    log_dir = Path(trainer.log_dir)
    with open(log_dir / "metrics.csv") as f:
        columns = next(csv.reader(f))
    return lines, columns, sorted(p.name for p in log_dir.iterdir())


def test_one_replica_is_silent_like_ddp(tmp_path, capfd, caplog):
    """One replica balances nothing: beside the same fit under Lightning's DDP, no ``het/*`` metrics in the logger, no
    balance report files, no balance table or communication summary printed; the allocation is still readable."""
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_het import HeterogeneousStrategy

    ddp = DDPStrategy(process_group_backend="gloo")
    ddp_lines, ddp_columns, ddp_files = _one_device_fit(ddp, tmp_path, capfd, caplog)
    strategy = HeterogeneousStrategy(process_group_backend="gloo")
    lines, columns, files = _one_device_fit(strategy, tmp_path, capfd, caplog)
    assert columns == ddp_columns and not [c for c in columns if c.startswith("het/")]
    assert files == ddp_files == ["metrics.csv"]
    assert lines - ddp_lines == set(), sorted(lines - ddp_lines)
    assert strategy.batch_sizes == [4] and strategy.balance_report()["batch_sizes"] == [4]
    assert "global batch 4" in strategy.balance_table()
