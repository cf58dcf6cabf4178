"""The command line: subprocesses of the console script and of ``python -m lightning_het.train`` (as users run it;
the app's runs that several tests share are in ``test_app.py``), and the same ``main`` in-process for the cheap paths
(composition errors, exit statuses, how sweep jobs are launched).

Every process a test starts is killed with its whole process group when the test ends (also on timeout).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig

from lightning_het.app import config_dir
from lightning_het.app.config import register_configs
from lightning_het.app.train import main, train
from lightning_het.hsi.errors import ShapeMismatchError
from lightning_het.hsi.raster import write_geotiff
from lightning_het.hsi.synthetic import write_synthetic_scene
from tests.helpers.jobs import REPO, run_in_session

_NEXT_TO_PYTHON = Path(sys.executable).parent / "lightning-het-train"  # the console script of this interpreter's env
CONSOLE_SCRIPT = str(_NEXT_TO_PYTHON) if _NEXT_TO_PYTHON.exists() else shutil.which("lightning-het-train")
#: variables of an enclosing distributed job that must not leak into the app's own launch
_LAUNCH_VARS = ("LOCAL_RANK", "NODE_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "HYDRA_FULL_ERROR")


def run_app(args: list[str], *, cwd: Path, timeout: float, module: bool = False) -> subprocess.CompletedProcess:
    """Run the app (console script, or ``python -m lightning_het.train``) in its own process group.

    Returns the completed process with ``stdout`` and ``stderr`` as text. Nothing it started survives the call.
    """
    if not module and CONSOLE_SCRIPT is None:
        pytest.skip("the console script lightning-het-train is not installed (pip install -e .)")
    command = [sys.executable, "-m", "lightning_het.train", *args] if module else [CONSOLE_SCRIPT, *args]
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return run_in_session(command, cwd=cwd, env=env, timeout=timeout, merge_stderr=False)


def check_metrics(path: Path, world_size: int) -> dict:
    """The contract's keys, with fractions in [0, 1] and one allocation entry per replica."""
    metrics = json.loads(path.read_text())
    for key in ("test/oa", "test/aa", "test/kappa"):
        assert isinstance(metrics[key], float) and 0.0 <= metrics[key] <= 1.0, (key, metrics[key])
    balance = metrics["balance"]
    assert len(balance["batch_sizes"]) == world_size and len(balance["speeds"]) == world_size
    assert sum(balance["batch_sizes"]) == balance["global_batch_size"]
    assert metrics["world_size"] == world_size
    return metrics


@pytest.fixture(scope="module")
def scene(tmp_path_factory) -> tuple[Path, Path]:
    """A small synthetic scene written as a GeoTIFF pair (image + labels)."""
    out = tmp_path_factory.mktemp("scene")
    return write_synthetic_scene(out, height=32, width=32, bands=12, classes=4, seed=3)


def test_missing_file_exits_with_one_clear_message(run_main, capsys, tmp_path):
    missing = tmp_path / "nope.tif"
    code = run_main(
        "data=geotiff", f"data.image={missing}", f"data.labels={missing}", f"hydra.run.dir={tmp_path / 'run'}"
    )
    err = capsys.readouterr().err
    assert code == 2, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    assert str(missing) in errors[0] and "image" in errors[0]
    assert "Traceback" not in err


# ------------------------------------------------------------------------------------- in-process error paths
@pytest.fixture
def compose_cfg(tmp_path):
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(config_dir()), version_base="1.3"):
        yield lambda *overrides: compose("train", overrides=[f"output_dir={tmp_path}", *overrides])
    GlobalHydra.instance().clear()


@pytest.fixture
def run_main(monkeypatch, tmp_path):
    """Run the real command line (``lightning_het.train.main``) in this process; returns its exit status."""
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    monkeypatch.chdir(tmp_path)
    for name in _LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)

    def _run(*args: str) -> int:
        monkeypatch.setattr(sys, "argv", ["lightning-het-train", *args])
        GlobalHydra.instance().clear()
        try:
            main()
        except SystemExit as exit_:
            return int(exit_.code or 0)
        finally:
            GlobalHydra.instance().clear()
            HydraConfig.instance().cfg = None  # type: ignore[assignment]  # no run config leaks into later tests
        return 0

    yield _run
    root.handlers[:] = saved[0]  # Hydra configured logging for the run
    root.setLevel(saved[1])


def test_wrong_type_fails_with_hydras_message(run_main, capsys, tmp_path):
    assert run_main("strategy.min_batch_size=many") == 1
    err = capsys.readouterr().err
    assert "strategy.min_batch_size" in err and "could not be converted to Integer" in err
    assert "Traceback" not in err
    assert not (tmp_path / "outputs").exists()  # nothing ran


def test_bad_value_exits_2_with_one_line(run_main, capsys, tmp_path):
    assert run_main("strategy.emulate_slowdown=[1,0.5,2]") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: You set `strategy.emulate_slowdown=[1.0, 0.5, 2.0]`"), err
    assert len(err.strip().splitlines()) == 1


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


def test_uncreatable_run_directory_exits_2_naming_it(run_main, capsys, tmp_path):
    (tmp_path / "file").write_text("not a directory")
    run_dir = tmp_path / "file" / "out"
    assert run_main("experiment=quick", f"hydra.run.dir={run_dir}") == 2
    line = _one_error_line(capsys.readouterr().err)
    assert str(run_dir) in line and "hydra.run.dir" in line and "cannot be created" in line


def test_unwritable_sweep_directory_exits_2_naming_it(run_main, capsys, tmp_path):
    (tmp_path / "file").write_text("not a directory")
    sweep_dir = tmp_path / "file" / "sweep"
    assert run_main("-m", "experiment=quick", "seed=0,1", f"hydra.sweep.dir={sweep_dir}") == 2
    line = _one_error_line(capsys.readouterr().err)
    assert str(sweep_dir) in line and "hydra.sweep.dir" in line


def _damaged_checkpoint(path: Path, damage: str) -> Path:
    import torch

    if damage == "truncated":
        torch.save({"state_dict": {"w": torch.zeros(1000)}, "epoch": 1}, path)
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    else:
        path.write_bytes(np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8).tobytes())
    return path


@pytest.mark.parametrize("damage", ["truncated", "random"])
def test_corrupt_checkpoint_is_refused_before_anything_starts(compose_cfg, tmp_path, damage):
    from lightning_het.app.checks import checkpoint_to_resume
    from lightning_het.app.messages import UserError

    path = _damaged_checkpoint(tmp_path / "last.ckpt", damage)
    with pytest.raises(UserError, match="not a readable checkpoint") as info:
        checkpoint_to_resume(compose_cfg(f"ckpt_path={path}"))
    assert str(path) in str(info.value)


@pytest.mark.parametrize("damage", ["truncated", "random"])
def test_corrupt_checkpoint_exits_2_naming_the_file(run_main, capsys, tmp_path, damage):
    path = _damaged_checkpoint(tmp_path / "last.ckpt", damage)
    assert run_main("experiment=quick", f"ckpt_path={path}", f"hydra.run.dir={tmp_path / 'run'}") == 2
    line = _one_error_line(capsys.readouterr().err)
    assert str(path) in line and "not a readable checkpoint" in line


def test_a_valid_checkpoint_passes_the_check(tmp_path):
    import torch

    from lightning_het.app.checks import _unreadable_checkpoint

    torch.save({"state_dict": {"w": torch.zeros(3)}, "epoch": 1}, tmp_path / "ok.ckpt")
    assert _unreadable_checkpoint(str(tmp_path / "ok.ckpt")) is None


def test_far_more_cpu_replicas_than_cores_is_refused(run_main, capsys, monkeypatch, tmp_path):
    monkeypatch.setattr("lightning_het.app.checks._usable_cores", lambda: 2)
    assert run_main("experiment=quick", "trainer.devices=64", f"hydra.run.dir={tmp_path / 'run'}") == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "trainer.devices=64" in line and "2 usable core(s)" in line and "HINT: use `trainer.devices=2`" in line


def test_a_few_more_cpu_replicas_than_cores_warn(compose_cfg, monkeypatch, caplog):
    from lightning_het.app.checks import check_cpu_replicas

    monkeypatch.setattr("lightning_het.app.checks._usable_cores", lambda: 2)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with caplog.at_level(logging.WARNING, logger="lightning_het.app.checks"):
        check_cpu_replicas(compose_cfg("trainer.devices=3"))
        check_cpu_replicas(compose_cfg("trainer.devices=8"))  # 4 per core: still accepted
        check_cpu_replicas(compose_cfg("trainer.devices=2"))
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        "3 CPU replicas on 2 usable core(s)",
        "8 CPU replicas on 2 usable core(s)",
    ]


class _FakePopen:
    """Stands in for the sweep job's single run: records the command, exits with ``status``."""

    commands: list[list[str]] = []
    status = 0

    def __init__(self, command: list[str], cwd: str | None = None) -> None:
        self.commands.append(command)
        self.returncode: int | None = None
        run_dir = next(a for a in command if a.startswith("hydra.run.dir="))
        self.run_dir = Path(run_dir.split("=", 1)[1].strip('"'))

    def wait(self) -> int:
        if self.status == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "metrics.json").write_text(json.dumps({"test/oa": 0.5, "test/aa": 0.5, "test/kappa": 0.4}))
        self.returncode = self.status
        return self.status

    def poll(self) -> int | None:
        return self.returncode


@pytest.mark.parametrize("status", [0, 3])
def test_each_sweep_job_runs_as_one_single_run(run_main, monkeypatch, capsys, tmp_path, status):
    """Under -m every job becomes `python -m lightning_het.train <job overrides> hydra.run.dir=<job dir>`, no -m."""
    monkeypatch.setattr("lightning_het.app.sweeps.subprocess.Popen", _FakePopen)
    monkeypatch.setattr(_FakePopen, "commands", [])
    monkeypatch.setattr(_FakePopen, "status", status)
    sweep = tmp_path / "sweep"
    code = run_main("-m", "experiment=quick", "seed=0,1", "optimized_metric=test/oa", f"hydra.sweep.dir={sweep}")
    commands = _FakePopen.commands
    if status == 0:
        assert code == 0
        assert len(commands) == 2
    else:  # the first job fails: its status ends the sweep, with one line naming the job and its directory
        assert code == status and len(commands) == 1
        err = capsys.readouterr().err
        job = "sweep job 0 (experiment=quick seed=0 optimized_metric=test/oa)"
        assert f"error: {job} failed with exit status {status}" in err
        assert str(sweep / "0") in err
    for number, command in enumerate(commands):
        assert command[1:3] == ["-m", "lightning_het.train"]
        assert "-m" not in command[3:] and "--multirun" not in command
        assert f"seed={number}" in command and "experiment=quick" in command
        assert f'hydra.run.dir="{sweep / str(number)}"' in command
        assert not any(arg.startswith(("hydra.mode", "hydra.sweep")) for arg in command)


def test_mismatched_rasters_name_both_shapes(compose_cfg, tmp_path, scene):
    image, _ = scene
    labels = write_geotiff(tmp_path / "labels.tif", np.ones((30, 31), dtype=np.uint8))
    cfg = compose_cfg("experiment=quick", "data=geotiff", f"data.image={image}", f"data.labels={labels}")
    with pytest.raises(ShapeMismatchError) as info:
        train(cfg)
    message = str(info.value)
    assert "32x32" in message and "30x31" in message and str(labels) in message


def test_missing_input_fails_before_anything_is_built(compose_cfg, tmp_path):
    cfg = compose_cfg("data=geotiff", f"data.image={tmp_path / 'a.tif'}", f"data.labels={tmp_path / 'b.tif'}")
    with pytest.raises(FileNotFoundError, match=r"a\.tif"):
        train(cfg)


def test_spawn_start_method_is_refused_with_a_hint(compose_cfg):
    from lightning_het.app.messages import UserError

    with pytest.raises(UserError, match=r"start_method=popen"):
        train(compose_cfg("experiment=quick", "strategy.start_method=spawn"))


@pytest.mark.slow
def test_installed_wheel_ships_and_finds_its_configs(tmp_path):
    """Build the wheel, install it (without dependencies) into a folder and compose the config from there."""
    pytest.importorskip("setuptools")
    source = tmp_path / "src"
    shutil.copytree(
        REPO,
        source,
        ignore=shutil.ignore_patterns(
            ".venv", ".git", "outputs", "multirun", "build", "*.egg-info", "__pycache__", "bench_results", "tests"
        ),
        symlinks=True,
    )
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    built = subprocess.run(
        [*pip, "wheel", str(source), "-w", str(tmp_path / "dist"), "--no-deps", "--no-build-isolation"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("lightning_het-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        entry_points = archive.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    conf = REPO / "conf"
    expected = {f"lightning_het/conf/{p.relative_to(conf).as_posix()}" for p in conf.rglob("*.yaml")}
    assert expected and expected <= names, sorted(expected - names)
    assert "lightning_het/conf/__init__.py" in names
    assert "lightning-het-train = lightning_het.app.train:main" in entry_points

    target = tmp_path / "site"
    installed = subprocess.run(
        [*pip, "install", "--no-deps", "--no-index", "--target", str(target), str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert installed.returncode == 0, installed.stderr[-3000:]
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env["PYTHONPATH"] = str(target)  # ahead of the development tree (and of any editable install)
    shown = subprocess.run(
        [sys.executable, "-m", "lightning_het.train", "experiment=quick", "--info", "all"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert shown.returncode == 0, shown.stderr[-3000:]
    main_path = next(line for line in shown.stdout.splitlines() if "| main" in line)
    assert str(target / "lightning_het" / "conf") in main_path, shown.stdout  # the configs of the installed copy
    assert "experiment/quick" in shown.stdout  # and they compose
    assert "_target_: lightning_het.strategy.HeterogeneousStrategy" in shown.stdout


def test_unweighted_baseline_cancels_the_strategys_loss_scale():
    """``strategy=unweighted``: the loss handed to the strategy is divided by its ``loss_scale`` (W b_r / B)."""
    from types import SimpleNamespace

    import torch

    from lightning_het.app.build import unweighted_gradients

    strategy = SimpleNamespace(loss_scale=1.5)  # e.g. replica 2 of batch sizes [2, 4, 6]
    model = SimpleNamespace(trainer=SimpleNamespace(strategy=strategy))
    model.training_step = lambda batch, batch_idx: torch.tensor(6.0)
    unweighted_gradients(model)
    assert model.training_step(None, 0).item() == pytest.approx(4.0)  # x 1.5 in strategy.backward -> 6.0
    model.training_step = lambda batch, batch_idx: {"loss": torch.tensor(3.0), "extra": 1}
    unweighted_gradients(model)
    assert model.training_step(None, 0)["loss"].item() == pytest.approx(2.0)
    strategy.loss_scale = 1.0  # before the allocation (profiling): unchanged
    assert model.training_step(None, 0)["loss"].item() == pytest.approx(3.0)
