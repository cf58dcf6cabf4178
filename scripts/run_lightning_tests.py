#!/usr/bin/env python
"""Run Lightning's own tests with stock DDP and with ``HeterogeneousStrategy`` substituted, and print the difference.

Lightning's tests are not in its packages on PyPI: give a checkout of the repository at the installed version's tag
(``git clone https://github.com/Lightning-AI/pytorch-lightning`` then ``git checkout <tag>``; a patch release whose
tag is missing can use the previous patch's tests when ``src/lightning/pytorch`` differs only in unrelated files).

Every selected test file is run twice, each time in its own pytest process (its own session, killed whole when it
overruns):

* ``ddp``: as Lightning runs it;
* ``heterogeneous``: with every ``StrategyRegistry`` entry built on ``DDPStrategy`` (``"ddp"``, ``"ddp_spawn"``,
  ``"ddp_fork"``, ``"ddp_notebook"``, ``"ddp_find_unused_parameters_true"``, ...) and the names
  ``lightning.pytorch.strategies.DDPStrategy`` / ``lightning.pytorch.strategies.ddp.DDPStrategy`` rebound to
  ``lightning_het.HeterogeneousStrategy`` (same arguments, e.g. ``start_method``), in the pytest process and in every
  process it starts (``scripts/_lightning_tests_plugin.py``, injected with ``-p`` and from a ``sitecustomize``).
  ``strategy="auto"`` with several CPU devices resolves to ``"ddp"``, so it is substituted too.

Printed: per file, the tests run and how many passed under each; then every test that passed with DDP and did not
with ours, with the first line of its failure. Not run in CI (it needs the checkout and takes minutes per file).

Usage (2 cores: a few files at a time)::

    python scripts/run_lightning_tests.py --lightning-repo /tmp/lightning-src \\
        tests_pytorch/models/test_hooks.py tests_pytorch/loops/ --timeout 120 --json /tmp/lt.json

Files and folders are relative to the checkout's ``tests/`` folder (or absolute); without any, the default list
(:data:`DEFAULT_FILES`: CPU-runnable strategy, loop, logging, hook, checkpoint and data-connector tests) runs.
``--list-default`` prints it. ``-k EXPR`` selects tests inside the files, as pytest's ``-k``. ``--sharded`` runs
``ModelParallelStrategy`` (the ``ddp`` mode) against ``HeterogeneousFSDPStrategy`` substituted for it
(:data:`SHARDED_FILES` by default).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent
MODES = ("ddp", "heterogeneous")
NAMES = ("HeterogeneousStrategy", "DDPStrategy")  # ours, and the stock class it stands in for

#: CPU-runnable tests of the strategy, loops, logging, hooks, checkpointing and the data connector (relative to the
#: checkout's ``tests/`` folder; a folder runs every ``test_*.py`` in it, each file in its own pytest process)
DEFAULT_FILES = [
    "tests_pytorch/models/test_hooks.py",
    "tests_pytorch/trainer/logging_/test_train_loop_logging.py",
    "tests_pytorch/trainer/logging_/test_eval_loop_logging.py",
    "tests_pytorch/trainer/logging_/test_logger_connector.py",
    "tests_pytorch/trainer/logging_/test_distributed_logging.py",
    "tests_pytorch/trainer/connectors/test_data_connector.py",
    "tests_pytorch/trainer/connectors/test_accelerator_connector.py",
    "tests_pytorch/trainer/test_dataloaders.py",
    "tests_pytorch/strategies/test_ddp*.py",
    "tests_pytorch/strategies/test_registry.py",
    "tests_pytorch/strategies/launchers/test_multiprocessing.py",
    "tests_pytorch/utilities/test_all_gather_grad.py",
    "tests_pytorch/loops/",
    "tests_pytorch/checkpointing/",
]

#: ``--sharded``: Lightning's ModelParallelStrategy tests that run on CPU (the integration file skips without GPUs)
SHARDED_FILES = [
    "tests_pytorch/strategies/test_model_parallel.py",
    "tests_pytorch/strategies/test_model_parallel_integration.py",
]


def expand(tests_dir: Path, selection: list[str]) -> list[Path]:
    """The test files of ``selection`` (files, folders, globs relative to ``tests_dir`` or absolute), sorted, unique."""
    files: list[Path] = []
    for item in selection:
        path = Path(item) if Path(item).is_absolute() else tests_dir / item
        if any(ch in item for ch in "*?["):
            matches = sorted(p for p in path.parent.glob(path.name) if p.is_file())
        elif path.is_dir():
            matches = sorted(path.rglob("test_*.py"))
        elif path.is_file():
            matches = [path]
        else:
            raise SystemExit(f"error: {item!r} matches no test file under {tests_dir}")
        files.extend(m for m in matches if m not in files)
    return files


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def run_file(
    test_file: Path, mode: str, *, tests_dir: Path, work: Path, args: argparse.Namespace
) -> tuple[dict[str, dict], str]:
    """Run one test file under ``mode``; returns ``{nodeid: {"outcome", "message"}}`` and the output's tail."""
    tag = f"{mode}-{test_file.stem}-{abs(hash(str(test_file))) % 10**8}"
    results = work / f"{tag}.jsonl"
    results.unlink(missing_ok=True)
    env = dict(os.environ)
    env.pop("PL_RUN_STANDALONE_TESTS", None)
    env.update(
        PYTHONPATH=os.pathsep.join(
            p for p in (str(work / "site"), str(SCRIPTS), str(REPO), os.environ.get("PYTHONPATH", "")) if p
        ),
        LIGHTNING_HET_SUBSTITUTE=("sharded" if args.sharded else "1") if mode == "heterogeneous" else "0",
        LIGHTNING_TESTS_TIMEOUT=str(args.timeout),
        LIGHTNING_TESTS_RESULTS=str(results),
        LIGHTNING_TESTS_RUNNER_PID=str(os.getpid()),
        PYTHONDONTWRITEBYTECODE="1",
    )
    command = [
        args.python,
        "-m",
        "pytest",
        str(test_file),
        "-p",
        "_lightning_tests_plugin",
        "-p",
        "no:cacheprovider",
        "-q",
        "-rN",
        "--color=no",
        f"--basetemp={work / 'tmp' / tag}",
        *(["-k", args.k] if args.k else []),
        *args.pytest_args,
    ]
    proc = subprocess.Popen(
        command,
        cwd=tests_dir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=args.file_timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        output, _ = proc.communicate()
        output += f"\n[run_lightning_tests] file timed out after {args.file_timeout} s; its processes were killed\n"
    finally:
        _kill_group(proc.pid)  # nothing the tests started outlives the file
    outcomes: dict[str, dict] = {}
    if results.exists():
        for line in results.read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            outcomes[record.pop("nodeid")] = record
    return outcomes, output[-4000:]


def _rel(nodeid: str, tests_dir: Path) -> str:
    with contextlib.suppress(ValueError):
        path, _, rest = nodeid.partition("::")
        path = str(Path(path).resolve().relative_to(tests_dir)) if Path(path).is_absolute() else path
        return f"{path}::{rest}" if rest else path
    return nodeid


def _terminate(signum: int, frame: object) -> None:
    # `timeout`, `kill` or Ctrl-C: unwind, so that the running pytest's group is killed and the work folder removed
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _terminate)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", help="test files, folders or globs, relative to <checkout>/tests")
    parser.add_argument("--lightning-repo", type=Path, help="checkout of Lightning at the installed version")
    parser.add_argument("--timeout", type=float, default=120, help="seconds per test before it is failed (120)")
    parser.add_argument(
        "--file-timeout", type=float, default=3600, help="seconds per file and mode before its pytest is killed"
    )
    parser.add_argument("-k", help="pytest -k expression selecting tests inside the files")
    parser.add_argument("--json", type=Path, help="write every outcome and the differences to this file")
    parser.add_argument("--python", default=sys.executable, help="interpreter with Lightning and lightning_het")
    parser.add_argument(
        "--modes", nargs="+", choices=MODES, default=list(MODES), help="run only these (the difference needs both)"
    )
    parser.add_argument("--pytest-args", nargs=argparse.REMAINDER, default=[], help="passed on to pytest (last)")
    parser.add_argument("--list-default", action="store_true", help="print the default file list and exit")
    parser.add_argument(
        "--sharded", action="store_true", help="ModelParallelStrategy against HeterogeneousFSDPStrategy instead"
    )
    args = parser.parse_args(argv)
    defaults = SHARDED_FILES if args.sharded else DEFAULT_FILES
    if args.list_default:
        print("\n".join(defaults))
        return 0
    if args.lightning_repo is None:
        parser.error("--lightning-repo is required (a checkout of Lightning at the installed version's tag)")
    tests_dir = (args.lightning_repo / "tests").resolve()
    if not (tests_dir / "tests_pytorch" / "conftest.py").exists():
        parser.error(f"{args.lightning_repo} is not a Lightning checkout (no tests/tests_pytorch/conftest.py)")
    installed = subprocess.run(
        [args.python, "-c", "import lightning; print(lightning.__version__)"], capture_output=True, text=True
    ).stdout.strip()
    version_file = args.lightning_repo / "src" / "version.info"
    checkout = version_file.read_text().strip() if version_file.exists() else "unknown"
    print(f"Lightning installed: {installed}; checkout: {checkout} ({args.lightning_repo})")
    if checkout not in ("unknown", installed):
        print("warning: the checkout's version differs from the installed one; some tests may not match", flush=True)

    files = expand(tests_dir, args.files or defaults)
    report: dict = {"lightning": installed, "checkout": checkout, "files": {}, "differences": []}
    with tempfile.TemporaryDirectory(prefix="lightning-het-lt-") as tmp:
        work = Path(tmp)
        (work / "site").mkdir()
        (work / "tmp").mkdir()  # pytest creates each --basetemp, not its parents
        # processes started by a test (ddp_spawn children, ddp re-launches) substitute as well
        (work / "site" / "sitecustomize.py").write_text(
            "import os\nif os.environ.get('LIGHTNING_HET_SUBSTITUTE') in ('1', 'sharded'):\n"
            "    import _lightning_tests_plugin\n"
        )
        for test_file in files:
            name = str(test_file.relative_to(tests_dir)) if test_file.is_relative_to(tests_dir) else str(test_file)
            per_mode = {}
            for mode in args.modes:
                start = time.monotonic()
                outcomes, tail = run_file(test_file, mode, tests_dir=tests_dir, work=work, args=args)
                seconds = time.monotonic() - start
                outcomes = {_rel(k, tests_dir): v for k, v in outcomes.items()}
                if mode == "heterogeneous":  # parametrize ids made from the class name: DDPStrategy is ours here
                    ours, stock = ("HeterogeneousFSDPStrategy", "ModelParallelStrategy") if args.sharded else NAMES
                    outcomes = {k.replace(ours, stock): v for k, v in outcomes.items()}
                passed = sum(o["outcome"] == "passed" for o in outcomes.values())
                print(f"{name} [{mode}]: {len(outcomes)} tests, {passed} passed ({seconds:.0f} s)", flush=True)
                if not outcomes:
                    print(f"  no test result; pytest's output ends with:\n{tail}", flush=True)
                per_mode[mode] = {"outcomes": outcomes, "seconds": round(seconds, 1), "tail": tail}
            entry = {
                mode: {"passed": sum(o["outcome"] == "passed" for o in m["outcomes"].values())}
                for mode, m in per_mode.items()
            }
            report["files"][name] = {"modes": per_mode, "summary": entry}
            if set(MODES) <= per_mode.keys():
                ddp, ours = per_mode["ddp"]["outcomes"], per_mode["heterogeneous"]["outcomes"]
                diffs = [
                    {
                        "test": nodeid,
                        "outcome": ours.get(nodeid, {}).get("outcome", "not run"),
                        "message": ours.get(nodeid, {}).get("message", ""),
                    }
                    for nodeid, o in ddp.items()
                    if o["outcome"] == "passed" and ours.get(nodeid, {}).get("outcome") != "passed"
                ]
                report["files"][name]["summary"]["tests"] = len(ddp)
                report["files"][name]["summary"]["differences"] = len(diffs)
                report["differences"].extend(diffs)
    if set(MODES) <= set(args.modes):
        print("\nfile | tests | passed with DDP | passed with heterogeneous | differences")
        for name, data in report["files"].items():
            s = data["summary"]
            print(f"{name} | {s['tests']} | {s['ddp']['passed']} | {s['heterogeneous']['passed']} | {s['differences']}")
        total = [sum(d["summary"][k]["passed"] for d in report["files"].values()) for k in MODES]
        print(
            f"total | {sum(d['summary']['tests'] for d in report['files'].values())} | {total[0]} | {total[1]} | "
            f"{len(report['differences'])}"
        )
        print(f"\n{len(report['differences'])} test(s) pass with DDP and not with HeterogeneousStrategy:")
        for diff in report["differences"]:
            print(f"  {diff['test']} [{diff['outcome']}]: {diff['message']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
        print(f"\nwritten: {args.json}")
    return 1 if report["differences"] else 0


if __name__ == "__main__":
    sys.exit(main())
