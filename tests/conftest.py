"""Shared fixtures: running multi-process Lightning jobs in subprocesses, with no orphans left behind."""

from __future__ import annotations

import inspect
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import harness
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
    """Run the harness's ``tiny`` job with a config; return the per-rank dumps and the output."""

    def _run(cfg: dict, *, timeout: float = 300, env: dict[str, str] | None = None):
        result = run_job(harness.command("tiny", tmp_path, cfg), timeout=timeout, env=env)
        assert result.returncode == 0, result.stdout[-6000:]
        world = cfg.get("devices", 2) * cfg.get("num_nodes", 1)
        dumps = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
        return dumps, result.stdout

    return _run


# ------------------------------------------------------------------------------------------ the `slow` marker
#: Calls that start other processes (multi-process jobs, the app, installs). A test is marked ``slow`` when its own
#: source or the source of a fixture it uses (directly or through other fixtures) makes one of them, so a new
#: multi-process test or fixture is marked without anyone remembering to: ``pytest -m "not slow"`` stays quick, and CI
#: (plain ``pytest``) still runs everything.
_STARTS_PROCESSES = (
    "run_job(",
    "run_harness(",
    "run_command(",
    "harness.command(",
    "run_in_session(",
    "run_app(",
    "_run_app(",
    "subprocess.",
    "Popen(",
    "mp.spawn(",
    "start_processes(",
    "run_gloo(",
    "tiny_job(",
    "fabric_job(",
    "_trainer(2, strategy",
)


def _starts_processes(function: object, cache: dict[object, bool], depth: int = 3) -> bool:
    """Whether ``function``'s source, or that of a test-tree function it calls by name (``depth`` levels), makes one
    of the :data:`_STARTS_PROCESSES` calls."""
    if function in cache:
        return cache[function]
    cache[function] = False  # recursion guard
    try:
        source = inspect.getsource(function)  # type: ignore[arg-type]
    except (OSError, TypeError):
        return False
    found = any(call in source for call in _STARTS_PROCESSES)
    if not found and depth > 0:
        namespace = getattr(function, "__globals__", {})
        for name in set(re.findall(r"\b([A-Za-z_]\w*)\(", source)):
            callee = namespace.get(name)
            if inspect.isfunction(callee) and _in_tests(callee) and _starts_processes(callee, cache, depth - 1):
                found = True
                break
    cache[function] = found
    return found


def _in_tests(function: object) -> bool:
    try:
        return Path(inspect.getfile(function)).resolve().is_relative_to(REPO / "tests")  # type: ignore[arg-type]
    except TypeError:
        return False


#: the modules that take longest (mostly waiting for their jobs), run first: with ``pytest -n 2 --dist loadfile``
#: (``.ci/run``) the two workers then end together instead of one finishing a long module alone
LONGEST_FIRST = (
    "tests/reliability/test_lifecycle.py",
    "tests/test_engines.py",
    "tests/test_fabric.py",
    "tests/reliability/test_preemption.py",
    "tests/test_run_lightning_tests.py",
    "tests/app/test_app.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(Path(str(item.path)).relative_to(REPO).as_posix(), len(rank)))
    cache: dict[object, bool] = {}
    for item in items:
        if item.get_closest_marker("slow") is not None or not isinstance(item, pytest.Function):
            continue
        functions = [item.function]
        for name in item.fixturenames:
            for fixturedef in item._fixtureinfo.name2fixturedefs.get(name, ()):
                if _in_tests(fixturedef.func):
                    functions.append(fixturedef.func)
        if any(_starts_processes(f, cache) for f in functions):
            item.add_marker(pytest.mark.slow)
