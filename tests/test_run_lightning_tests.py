"""``scripts/run_lightning_tests.py``'s plumbing on a stand-in for Lightning's checkout (Lightning's own tests are not
run in CI): the substitution reaches the test process and the processes it starts, the registry entries keep their
arguments, a hanging test is failed by the per-test timeout, and the difference lists exactly the tests that pass with
DDP and not with ours."""

from __future__ import annotations

import json
import os
import sys
import textwrap

from tests.helpers.jobs import REPO, run_in_session

FAKE_TESTS = """
import subprocess
import sys
import time

from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.strategies.ddp import DDPStrategy as DDPStrategyFromModule

SUBSTITUTED = DDPStrategy.__name__ == "HeterogeneousStrategy"


def test_passes_only_with_ddp():
    assert not SUBSTITUTED


def test_names_and_registry_agree():
    assert DDPStrategyFromModule is DDPStrategy
    for name in ("ddp", "ddp_spawn", "ddp_fork", "ddp_notebook", "ddp_find_unused_parameters_true"):
        assert StrategyRegistry[name]["strategy"] is DDPStrategy, name
    assert StrategyRegistry["ddp_spawn"]["init_params"] == {"start_method": "spawn"}
    assert StrategyRegistry["ddp_find_unused_parameters_true"]["init_params"] == {
        "find_unused_parameters": True, "start_method": "popen"
    }


def test_child_process_substitutes_too():
    code = "import lightning.pytorch.strategies as s; print(s.DDPStrategy.__name__)"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert child.stdout.strip() == DDPStrategy.__name__


def test_hangs_only_with_ours():
    if SUBSTITUTED:
        time.sleep(60)
"""


def test_runner_lists_exactly_the_differences(tmp_path):
    checkout = tmp_path / "lightning"
    tests = checkout / "tests" / "tests_pytorch"
    tests.mkdir(parents=True)
    (tests / "__init__.py").write_text("")
    (tests / "conftest.py").write_text("")
    (tests / "test_fake.py").write_text(textwrap.dedent(FAKE_TESTS))
    report = tmp_path / "report.json"
    command = [sys.executable, str(REPO / "scripts" / "run_lightning_tests.py"), "--lightning-repo", str(checkout)]
    command += ["tests_pytorch/test_fake.py", "--timeout", "12", "--json", str(report)]
    result = run_in_session(command, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
    assert result.returncode == 1, result.stdout[-4000:]  # 1: there are differences
    data = json.loads(report.read_text())
    outcomes = {
        mode: {
            k.rsplit("::", 1)[1]: v["outcome"]
            for k, v in data["files"]["tests_pytorch/test_fake.py"]["modes"][mode]["outcomes"].items()
        }
        for mode in ("ddp", "heterogeneous")
    }
    assert outcomes["ddp"] == dict.fromkeys(outcomes["ddp"], "passed")
    assert outcomes["heterogeneous"] == {
        "test_passes_only_with_ddp": "failed",
        "test_names_and_registry_agree": "passed",
        "test_child_process_substitutes_too": "passed",
        "test_hangs_only_with_ours": "failed",
    }
    differences = {d["test"].rsplit("::", 1)[1]: d["message"] for d in data["differences"]}
    assert set(differences) == {"test_passes_only_with_ddp", "test_hangs_only_with_ours"}
    assert "TimeoutError" in differences["test_hangs_only_with_ours"]
    assert "4 | 4 | 2 | 2" in result.stdout  # tests | passed with DDP | passed with ours | differences
