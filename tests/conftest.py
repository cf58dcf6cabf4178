"""Shared fixtures: running multi-process Lightning jobs in subprocesses, with no orphans left behind."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.jobs import REPO, free_port, job_env, run_in_session

__all__ = ["REPO", "free_port", "run_job"]


def run_job(args: list[str], *, timeout: float = 120, env: dict[str, str] | None = None, cwd: Path | None = None):
    """Run ``python args...`` in its own session; on timeout kill the whole process group. Returns CompletedProcess."""
    return run_in_session([sys.executable, *args], cwd=cwd or REPO, env=job_env(env), timeout=timeout)


@pytest.fixture(autouse=True)
def _no_leftover_process_group():
    """In-process fits (devices=1) leave torch's default process group initialised and Lightning's variables
    (LOCAL_RANK, MASTER_PORT, ...) in ``os.environ``; later tests would inherit both. Undo them after every test."""
    environ = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(environ)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@pytest.fixture
def tiny_job(tmp_path):
    """Run tests/helpers/run_tiny.py with a JSON config; return the per-rank dumps."""

    def _run(cfg: dict, *, timeout: float = 300, env: dict[str, str] | None = None):
        result = run_job(["-m", "tests.helpers.run_tiny", str(tmp_path), json.dumps(cfg)], timeout=timeout, env=env)
        assert result.returncode == 0, result.stdout[-6000:]
        world = cfg.get("devices", 2) * cfg.get("num_nodes", 1)
        dumps = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
        return dumps, result.stdout

    return _run
