"""pytest plugin used by ``scripts/run_lightning_tests.py`` (injected with ``-p _lightning_tests_plugin``).

* With ``LIGHTNING_HET_SUBSTITUTE=1``, DDP is replaced by :class:`lightning_het.HeterogeneousStrategy` when this
  plugin is loaded (it imports ``lightning.pytorch``): every ``StrategyRegistry`` entry built on ``DDPStrategy``
  (``"ddp"``, ``"ddp_spawn"``, ``"ddp_fork"``, ``"ddp_notebook"``, the ``*_find_unused_parameters_*`` variants) is
  rebound to it, keeping its arguments (``start_method``, ...), and so are the names
  ``lightning.pytorch.strategies.DDPStrategy`` and ``lightning.pytorch.strategies.ddp.DDPStrategy`` (a test that
  builds ``DDPStrategy(...)`` or checks ``isinstance(strategy, DDPStrategy)`` gets ours). The runner also imports this
  module from a ``sitecustomize`` so that processes started by a test (``ddp_spawn`` children, ``ddp`` re-launches)
  substitute too.
* With ``LIGHTNING_HET_SUBSTITUTE=sharded``, ``lightning.pytorch.strategies.ModelParallelStrategy`` (and its module's
  name) is :class:`lightning_het.HeterogeneousFSDPStrategy` instead.
* ``LIGHTNING_TESTS_TIMEOUT=<seconds>``: a test still running after that long is failed (``TimeoutError``) after its
  child processes are killed (a deadlocked collective would otherwise hold the run forever).
* ``flaky`` (pytest-rerunfailures' marker, which Lightning's tests use) is registered when that plugin is missing, so
  those files are collected (each test then runs once).
* ``LIGHTNING_TESTS_RESULTS=<path>``: one JSON line per test is appended to the file: ``nodeid``, ``outcome``
  (``passed``, ``failed``, ``skipped``, ``xfailed``, ``xpassed``, ``error``) and ``message`` (the failure's first
  line).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from pathlib import Path

SUBSTITUTE = os.environ.get("LIGHTNING_HET_SUBSTITUTE") == "1"
SHARDED = os.environ.get("LIGHTNING_HET_SUBSTITUTE") == "sharded"  # ModelParallelStrategy -> HeterogeneousFSDPStrategy
TIMEOUT = float(os.environ.get("LIGHTNING_TESTS_TIMEOUT") or 0)
RESULTS = os.environ.get("LIGHTNING_TESTS_RESULTS")


def _substitute() -> None:
    """Rebind Lightning's DDP names and registry entries to ``HeterogeneousStrategy`` (idempotent)."""
    import lightning.pytorch.strategies as strategies
    import lightning.pytorch.strategies.ddp as ddp
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_het import HeterogeneousStrategy

    stock = getattr(ddp, "_stock_DDPStrategy", ddp.DDPStrategy)
    ddp._stock_DDPStrategy = stock
    for entry in StrategyRegistry.values():
        if entry["strategy"] is stock:
            entry["strategy"] = HeterogeneousStrategy
    strategies.DDPStrategy = HeterogeneousStrategy
    ddp.DDPStrategy = HeterogeneousStrategy


def _substitute_sharded() -> None:
    """Rebind Lightning's ``ModelParallelStrategy`` names to ``HeterogeneousFSDPStrategy`` (``--sharded``)."""
    import lightning.pytorch.strategies as strategies
    import lightning.pytorch.strategies.model_parallel as model_parallel

    from lightning_het import HeterogeneousFSDPStrategy

    strategies.ModelParallelStrategy = model_parallel.ModelParallelStrategy = HeterogeneousFSDPStrategy


def install() -> None:
    """Substitute now (importing ``lightning_het``, which imports ``lightning.pytorch``)."""
    if SUBSTITUTE:
        _substitute()
    elif SHARDED:
        _substitute_sharded()


install()


# ---------------------------------------------------------------------------------------------- pytest hooks
class _TestTimeout(Exception):
    pass


#: results are written by the pytest process the runner started, not by a ``ddp`` re-launch of it in a child
_RECORDS = RESULTS is not None and str(os.getppid()) == os.environ.get("LIGHTNING_TESTS_RUNNER_PID")


def _descendants(pid: int) -> list[int]:
    """All live descendants of ``pid`` (from /proc), deepest last."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def _on_alarm(signum, frame):
    for pid in _descendants(os.getpid()):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    message = f"TimeoutError: test still running after {TIMEOUT:g} s (its child processes were killed)"
    if pytest is not None:
        pytest.fail(message, pytrace=True)
    raise _TestTimeout(message)


def _is_group(error: object) -> bool:
    """An exception group (Python 3.11's ``BaseExceptionGroup`` or the ``exceptiongroup`` backport)."""
    return isinstance(error, BaseException) and isinstance(getattr(error, "exceptions", None), (list, tuple))


def _first_line(report) -> str:
    if getattr(report, "het_message", None):
        return report.het_message[:600]
    longrepr = report.longrepr
    if longrepr is None:
        return ""
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None:
        text = crash.message
    elif isinstance(longrepr, tuple):  # skip: (path, line, reason)
        text = str(longrepr[-1])
    else:
        text = str(longrepr)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0][:300] if lines else ""


try:
    import pytest
except ImportError:  # imported from sitecustomize in a process without pytest
    pytest = None

if pytest is not None:

    def pytest_configure(config) -> None:
        if not config.pluginmanager.hasplugin("rerunfailures"):  # Lightning marks some tests `flaky` (no reruns here)
            config.addinivalue_line("markers", "flaky(reruns, reruns_delay): rerun marker of pytest-rerunfailures")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        if TIMEOUT <= 0:
            yield
            return
        previous = signal.signal(signal.SIGALRM, _on_alarm)
        signal.setitimer(signal.ITIMER_REAL, TIMEOUT)
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(item, call):
        outcome = yield
        error = call.excinfo.value if call.excinfo is not None else None
        if _is_group(error):  # e.g. several fixtures failing at teardown: name each error
            leaves, stack = [], [error]
            while stack:
                current = stack.pop()
                if _is_group(current):
                    stack.extend(reversed(current.exceptions))
                else:
                    leaves.append(current)
            first = [(str(e).strip().splitlines() or [""])[0] for e in leaves]
            outcome.get_result().het_message = "; ".join(
                f"{type(e).__name__}: {line}" for e, line in zip(leaves, first, strict=True)
            )

    _outcomes: dict[str, tuple[str, str]] = {}

    def pytest_runtest_logreport(report) -> None:
        if not _RECORDS:
            return
        nodeid = report.nodeid
        xfail = hasattr(report, "wasxfail")
        if report.when == "call":
            outcome = ("xfailed" if report.skipped else "xpassed") if xfail else report.outcome
            _outcomes[nodeid] = (outcome, _first_line(report))
        elif report.failed:  # setup/teardown error (a teardown error after a passing call counts as a failure)
            _outcomes[nodeid] = ("error", f"[{report.when}] " + _first_line(report))
        elif report.skipped and nodeid not in _outcomes:
            _outcomes[nodeid] = ("xfailed" if xfail else "skipped", _first_line(report))
        if report.when == "teardown" and nodeid in _outcomes:
            outcome, message = _outcomes.pop(nodeid)
            with open(RESULTS, "a", encoding="utf-8") as fh:
                fh.write(json.dumps({"nodeid": nodeid, "outcome": outcome, "message": message}) + "\n")
