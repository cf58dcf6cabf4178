"""The package as users install it: the core imports with torch and Lightning only, registration in any import order,
a ``--help`` that composes no run, one version. Each check runs in a fresh interpreter, or a fork of one that has
imported nothing of Lightning (``sys.modules`` of this one is not clean)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import lightning_het

REPO = Path(__file__).resolve().parents[1]

#: modules (and their distribution names) that the core plugin must not need
OPTIONAL = ("rasterio", "hydra", "omegaconf", "matplotlib", "scipy", "PIL")

_BLOCKER = textwrap.dedent(
    """
    import importlib.abc, importlib.metadata, sys
    BLOCKED = {blocked!r}
    DISTS = {{b.lower() for b in BLOCKED}} | {{"hydra-core", "hydra_core", "pillow"}}

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by the test)", name=name)
            return None

    sys.meta_path.insert(0, Block())
    for _fn in ("version", "distribution", "metadata"):  # Lightning's availability checks read the metadata
        def _hidden(name, _orig=getattr(importlib.metadata, _fn)):
            if name.lower() in DISTS:
                raise importlib.metadata.PackageNotFoundError(name)
            return _orig(name)
        setattr(importlib.metadata, _fn, _hidden)
    """
)


def _python(code: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env, check=False, cwd=REPO
    )


def test_core_imports_and_trains_without_the_optional_dependencies():
    """Only torch and Lightning: import, registration, a strategy instance, a Trainer with strategy="heterogeneous"."""
    code = _BLOCKER.format(blocked=OPTIONAL) + textwrap.dedent(
        """
        import lightning_het
        import lightning.pytorch as pl
        from lightning.pytorch.strategies import StrategyRegistry
        assert StrategyRegistry["heterogeneous"]["strategy"] is lightning_het.HeterogeneousStrategy
        strategy = lightning_het.HeterogeneousStrategy(speeds=[1, 2], global_batch_size=6)
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="heterogeneous", logger=False)
        assert isinstance(trainer.strategy, lightning_het.HeterogeneousStrategy)
        from lightning.fabric.strategies import STRATEGY_REGISTRY
        assert STRATEGY_REGISTRY["heterogeneous"]["strategy"] is lightning_het.HeterogeneousFabricStrategy
        assert lightning_het.allocate_batch_sizes(6, [1, 2]) == [2, 4]
        from lightning_het import ProportionalDistributedSampler, HeterogeneousDataModule
        import lightning_het.comm, lightning_het.balance
        import lightning_het.reliability.checkpointing, lightning_het.reliability.watchdog
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
        assert not loaded, loaded
        try:
            import lightning_het.hsi.raster
        except ModuleNotFoundError as err:
            assert "rasterio" in str(err), err
        else:
            raise AssertionError("the blocker let rasterio through")
        print("ok")
        """
    )
    result = _python(code)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")


#: import orders under which the strategy must be registered; ``R`` is the registry each one checks
IMPORT_ORDERS = {
    "package-first": "import lightning_het; from lightning.pytorch.strategies import StrategyRegistry as R",
    "lightning-first": "import lightning; import lightning_het; from lightning.pytorch.strategies import"
    " StrategyRegistry as R",
    "strategy-module": "from lightning_het.strategy import HeterogeneousStrategy; from lightning.pytorch.strategies"
    " import StrategyRegistry as R",
    "hsi-module": "import lightning_het.hsi.model; from lightning.pytorch.strategies import StrategyRegistry as R",
    "dependency-module": "import lightning_het.cluster.accelerators; from lightning.pytorch.strategies import"
    " StrategyRegistry as R",
    "pl-after": "import lightning_het; import pytorch_lightning as P; R = P.strategies.StrategyRegistry",
    "pl-before": "import pytorch_lightning as P; import lightning_het; R = P.strategies.StrategyRegistry",
    "fabric": "import lightning_het; from lightning.fabric.strategies import STRATEGY_REGISTRY as R",
    "fabric-module": "from lightning_het.fabric import HeterogeneousFabricStrategy\n"
    "from lightning.fabric.strategies import STRATEGY_REGISTRY as R",
}


#: run in one interpreter: import what every order imports before Lightning itself (torch, its compiler, torchmetrics;
#: nothing of Lightning or this package), then try each order (``argv[1]``, JSON) in a child forked from it, printing
#: ``{order: [exit status, stdout, stderr]}``: each order meets a ``sys.modules`` without Lightning, as in a fresh
#: interpreter, and pays only for Lightning's own import
_ORDERS_IN_FORKS = textwrap.dedent(
    """
    import json, os, sys, tempfile, traceback
    import torch, torch._dynamo, torchmetrics
    FLAVOURS = ("lightning", "lightning_het", "pytorch_lightning", "lightning_fabric")
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in FLAVOURS)
    assert not loaded, loaded
    results = {}
    for name, code in json.loads(sys.argv[1]).items():
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            pid = os.fork()
            if pid == 0:
                os.dup2(out.fileno(), 1)
                os.dup2(err.fileno(), 2)
                status = 0
                try:
                    exec(compile(code, name, "exec"), {"__name__": "__main__"})
                except BaseException:
                    traceback.print_exc()
                    status = 1
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(status)
            _, status = os.waitpid(pid, 0)
            out.seek(0)
            err.seek(0)
            results[name] = [os.waitstatus_to_exitcode(status), out.read(), err.read()]
    print(json.dumps(results))
    """
)


@pytest.fixture(scope="module")
def import_order_runs() -> dict[str, subprocess.CompletedProcess[str]]:
    """Each of :data:`IMPORT_ORDERS` in a child of one interpreter that has imported no Lightning module (see
    :data:`_ORDERS_IN_FORKS`): Lightning's third-party dependencies are imported once, not once per order."""
    have_pl = importlib.util.find_spec("pytorch_lightning") is not None
    codes = {
        name: f"{code}\nprint('heterogeneous' in R)\nimport lightning_utilities.core.rank_zero as Z\nprint(Z.log.name)"
        for name, code in IMPORT_ORDERS.items()
        if have_pl or "pytorch_lightning" not in code
    }
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-c", _ORDERS_IN_FORKS, json.dumps(codes)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env, check=False, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = json.loads(result.stdout.splitlines()[-1])
    return {name: subprocess.CompletedProcess(name, *run) for name, run in runs.items()}


@pytest.mark.slow  # one interpreter importing Lightning's dependencies, nine forks of it importing Lightning
@pytest.mark.parametrize("order", list(IMPORT_ORDERS))
def test_registered_whatever_the_import_order(import_order_runs, order):
    if "pytorch_lightning" in IMPORT_ORDERS[order]:
        pytest.importorskip("pytorch_lightning")
    result = import_order_runs[order]
    assert result.returncode == 0, result.stderr[-3000:]
    registered, rank_zero_log = result.stdout.split()
    assert registered == "True"
    assert "could not register" not in result.stderr
    # Lightning's rank-zero messages still go to the logger of the package the user imported first
    first = "pytorch_lightning" if order == "pl-before" else "lightning.pytorch"
    assert rank_zero_log == f"{first}.utilities.rank_zero"


def test_help_composes_no_run():
    """``lightning-het-train --help`` prints the app's help and composes no run (no data reader is imported).

    ``import lightning_het`` imports Lightning (it registers the strategy without an import hook), so the help pays
    for Lightning's import (docs/architecture.md)."""
    code = textwrap.dedent(
        """
        import sys
        sys.argv = ["lightning-het-train", "--help"]
        from lightning_het.app.train import main
        try:
            main()
        except SystemExit as stop:
            assert not stop.code, stop.code
        composed = sorted(m for m in sys.modules if m.split(".")[0] == "rasterio" or m.startswith("lightning_het.hsi"))
        print("composed:", composed)
        """
    )
    result = _python(code, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "composed: []" in result.stdout
    assert "lightning-het-train" in result.stdout  # the app's help text


def test_one_version_source():
    from lightning_het._version import __version__

    assert lightning_het.__version__ == __version__
    text = (REPO / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in text and "lightning_het._version.__version__" in text
    try:
        installed = importlib.metadata.version("lightning-het")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("lightning-het is not installed (running from PYTHONPATH)")
    assert installed == __version__


def test_public_names_resolve_lazily():
    assert set(lightning_het.__all__) <= set(dir(lightning_het))
    for name in lightning_het.__all__:
        assert getattr(lightning_het, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = lightning_het.nope


def _private_api_uses(path: Path) -> list[str]:
    """``from <lightning/torch flavour> import _name``, private module paths and ``distributed_c10d._x`` in a file."""
    import ast

    flavours = ("lightning", "torch", "pytorch_lightning", "lightning_fabric")
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in flavours:
            names = [a.name for a in node.names if a.name.startswith("_")]
            if names or any(part.startswith("_") for part in node.module.split(".")):
                found.append(f"{path.name}:{node.lineno}: from {node.module} import {names}")
        private = isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
        owner = ast.unparse(node.value) if private else ""
        if private and (owner.endswith("distributed_c10d") or owner.endswith(("loop", "trainer"))):
            found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")  # torch internals, Lightning's loops
    return found


def test_private_lightning_and_torch_apis_only_through_compat():
    """Every private Lightning/torch API goes through ``lightning_het/_compat.py`` (one guarded import that names the
    versions when one is missing), also those of the standalone ``pytorch_lightning`` / ``lightning_fabric``."""
    uses = [
        use
        for path in sorted((REPO / "lightning_het").rglob("*.py"))
        if path.name != "_compat.py"
        for use in _private_api_uses(path)
    ]
    assert uses == []
    assert _private_api_uses(REPO / "lightning_het" / "_compat.py")  # the guard itself is found by the scan
