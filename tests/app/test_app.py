"""The app as a new user meets it: any multi-band scene runs with no extra flag, callbacks and loggers from config
groups merged with the user's, ``last.ckpt`` and an exact resume, clear errors, and the structured config in step with
the strategy's signature."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import inspect
import itertools
import json
import logging
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from lightning.pytorch.strategies import DDPStrategy
from omegaconf import OmegaConf

from lightning_het.app import config_dir
from lightning_het.app.config import StrategyConfig, register_configs
from lightning_het.config import DEPRECATED_KEYWORDS, Profiling, Reliability
from lightning_het.hsi import HyperspectralDataModule
from lightning_het.hsi.datamodule import resolve_pca_components
from lightning_het.hsi.errors import SingleClassError
from lightning_het.hsi.raster import write_geotiff
from lightning_het.hsi.synthetic import write_synthetic_scene
from lightning_het.strategy import HeterogeneousStrategy
from tests.app.test_cli import CONSOLE_SCRIPT, check_metrics, run_app

#: StrategyConfig fields that are not strategy keywords (the app's own switches; emulation: the callback)
APP_ONLY_FIELDS = {"_target_", "gradient_averaging", "ddp_kwargs", "emulation"}
#: StrategyConfig fields that DDPStrategy forwards to DistributedDataParallel through ``**kwargs``
DDP_FORWARDED = {"find_unused_parameters"}


@pytest.fixture
def compose_cfg(tmp_path):
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(config_dir()), version_base="1.3"):
        yield lambda *overrides: compose("train", overrides=[f"output_dir={tmp_path}", *overrides])
    GlobalHydra.instance().clear()


def _scene(out: Path, *, bands: int, classes: int) -> tuple[Path, Path]:
    rng = np.random.default_rng(0)
    labels = np.zeros((24, 24), dtype=np.uint8)
    for c in range(classes):
        labels[4 + c * 4 : 8 + c * 4, 2:22] = c + 1
    image = rng.random((bands, 24, 24), dtype=np.float32) + labels[None].astype(np.float32)
    write_geotiff(out / "image.tif", image)
    write_geotiff(out / "labels.tif", labels[None])
    return out / "image.tif", out / "labels.tif"


# ------------------------------------------------------------------------------------------------- data
@pytest.mark.parametrize(("value", "bands", "expected"), [("auto", 16, 15), ("auto", 200, 30), ("auto", 1, None)])
def test_pca_auto_keeps_min_30_bands_minus_one(value, bands, expected):
    assert resolve_pca_components(value, bands) == expected
    assert resolve_pca_components(7, bands) == 7 and resolve_pca_components(None, bands) is None


def test_a_16_band_scene_needs_no_pca_flag(tmp_path, caplog):
    image, labels = _scene(tmp_path, bands=16, classes=3)
    datamodule = HyperspectralDataModule(image=str(image), labels=str(labels), patch_size=3, pca_components="auto")
    with caplog.at_level(logging.INFO, logger="lightning_het.hsi.datamodule"):
        datamodule.setup("fit")
    assert datamodule.num_bands == 15
    assert "pca_components=auto: keeping 15 principal components of the image's 16 bands" in caplog.text


def test_geotiff_config_defaults_to_auto(compose_cfg):
    assert compose_cfg("data=geotiff", "data.image=a.tif", "data.labels=b.tif").data.pca_components == "auto"


def test_one_class_labels_name_the_file(tmp_path):
    image, labels = _scene(tmp_path, bands=4, classes=1)
    datamodule = HyperspectralDataModule(image=str(image), labels=str(labels), patch_size=3)
    with pytest.raises(SingleClassError, match=r"labels\.tif.*single class \(value 1\).*HINT"):
        datamodule.setup("fit")


# ------------------------------------------------------------------------------------------------- config
def test_structured_strategy_config_matches_the_strategy_signature():
    """Every StrategyConfig field is a keyword of HeterogeneousStrategy (or a DDPStrategy keyword it forwards, or one of
    the deprecated flat keys, views of the typed ones), and the defaults agree except where the app states its own
    choice in conf/strategy/heterogeneous.yaml (a comment saying "default")."""
    signature = inspect.signature(HeterogeneousStrategy.__init__).parameters
    params = {n: p.default for n, p in signature.items()}
    ddp_params = inspect.signature(DDPStrategy.__init__).parameters
    fields = {f.name: f for f in dataclasses.fields(StrategyConfig)}
    known = set(params) | set(ddp_params) | set(DEPRECATED_KEYWORDS) | APP_ONLY_FIELDS | DDP_FORWARDED
    assert not sorted(set(fields) - known), f"StrategyConfig fields the strategy does not take: {set(fields) - known}"
    keywords = [n for n, p in signature.items() if n != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    assert len(keywords) > 10, keywords
    missing = sorted(n for n in keywords if n not in fields)
    assert not missing, f"strategy keywords the app cannot set: {missing}"
    for name, field in fields.items():
        if name in APP_ONLY_FIELDS or name not in params or field.default is dataclasses.MISSING:
            continue
        schema_default = field.default.value if hasattr(field.default, "value") else field.default
        assert schema_default == params[name], (name, schema_default, params[name])
    # the YAML may differ from the code only where a comment says so (the groups: their objects' defaults)
    yaml_text = (config_dir() / "strategy" / "heterogeneous.yaml").read_text()
    objects = {"profiling": Profiling(), "reliability": Reliability()}
    for name, value in OmegaConf.load(config_dir() / "strategy" / "heterogeneous.yaml").items():
        plain = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
        values = plain.items() if name in objects else [(None, plain)] if name in params else []
        for field_name, field_value in values:
            code_default = getattr(objects[name], field_name) if field_name else params[name]
            if isinstance(field_value, str) and field_value.startswith("${"):
                continue  # computed by the app (e.g. the emulated slowdowns)
            if field_value != code_default and not (field_value == {} and code_default is None):
                key = f"\n  {field_name}:" if field_name else f"\n{name}:"
                lines = yaml_text.split(key)[0].splitlines()
                block = " ".join(itertools.takewhile(lambda line: line.lstrip().startswith("#"), reversed(lines)))
                assert "default" in block, f"{name}.{field_name}: YAML {field_value!r} vs {code_default!r}, no comment"


# ------------------------------------------------------------------------------------------------- callbacks, loggers
def test_callback_and_logger_groups_merge_with_the_users(compose_cfg, monkeypatch):
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    from lightning_het.app import build as app_build

    cfg = compose_cfg(
        "+callbacks.early={_target_: lightning.pytorch.callbacks.EarlyStopping, monitor: val/loss}",
        "+trainer.callbacks=[{_target_: lightning.pytorch.callbacks.LearningRateMonitor}]",
    )
    built = app_build._build_callbacks(cfg)
    kinds = [type(c).__name__ for c in built]
    assert kinds == ["ModelCheckpoint", "ModelCheckpoint", "EarlyStopping", "LearningRateMonitor"], kinds
    checkpoint, best = built[0], built[1]
    assert isinstance(checkpoint, ModelCheckpoint) and checkpoint.save_last and isinstance(built[2], EarlyStopping)
    assert best.monitor == "val/oa" and not best.save_last
    assert app_build._checkpointing(cfg, built) is True
    assert app_build._checkpointing(compose_cfg("callbacks=none"), []) is False

    loggers = app_build._build_loggers(cfg)
    assert [type(x) for x in loggers] == [CSVLogger]
    assert app_build._build_loggers(compose_cfg("logger=none")) is False
    assert app_build._build_loggers(compose_cfg("trainer.logger=false")) is False
    both = compose_cfg("logger=[csv,tensorboard]")
    assert set(both.logger) == {"csv", "tensorboard"}


def test_missing_checkpoint_names_the_file(compose_cfg, tmp_path):
    from lightning_het.app.checks import checkpoint_to_resume
    from lightning_het.app.messages import UserError

    with pytest.raises(UserError, match=r"ckpt_path=.*nope\.ckpt.*HINT"):
        checkpoint_to_resume(compose_cfg(f"ckpt_path={tmp_path / 'nope.ckpt'}"))


# ------------------------------------------------------------------------------------------- shared app runs (slow)
@pytest.fixture(scope="module")
def quick_runs(tmp_path_factory):
    """Three runs of ``experiment=quick`` on 2 CPU replicas started by Lightning's popen, on a small GeoTIFF pair,
    shared by the tests below (each checks other things): ``whole`` (2 epochs, by the console script, with the
    prediction map) and ``first`` (1 epoch, ``python -m lightning_het.train``, no map) side by side, then ``resumed``
    (the same, 2 epochs from ``first``'s ``last.ckpt``). Each runs from a working directory of its own outside the
    repository, into ``run`` there; maps each name to ``(its run directory, its completed process)``."""
    root = tmp_path_factory.mktemp("quick_runs")
    (root / "scene").mkdir()
    image, labels = write_synthetic_scene(root / "scene", height=32, width=32, bands=12, classes=4, seed=3)
    common = ["experiment=quick", "data=geotiff", f"data.image={image}", f"data.labels={labels}"]
    common += ["data.patch_size=3", "data.pca_components=null", "data.global_batch_size=24", "trainer.devices=2"]
    common += ["data.train_fraction=0.3", "data.val_fraction=0.1"]  # as data=tiny: profiling ends in epoch 1

    def run(name: str, *extra: str, module: bool = True) -> tuple[Path, subprocess.CompletedProcess]:
        cwd = root / name
        cwd.mkdir()
        result = run_app([*common, f"hydra.run.dir={cwd / 'run'}", *extra], cwd=cwd, timeout=400, module=module)
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
        return cwd / "run", result

    script = CONSOLE_SCRIPT is not None  # else `whole` runs as a module too, and the console script's test skips
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # independent runs: side by side
        whole_run = pool.submit(run, "whole", "trainer.max_epochs=2", module=not script)
        first_run = pool.submit(run, "first", "trainer.max_epochs=1", "prediction_map=false")
        runs = {"whole": whole_run.result(), "first": first_run.result()}
    first = runs["first"][0]
    last = first / "checkpoints" / "last.ckpt"
    runs["resumed"] = run("resumed", "trainer.max_epochs=2", "prediction_map=false", f"ckpt_path={last}")
    return runs


@pytest.mark.slow
def test_console_script_on_a_geotiff_pair_with_two_replicas(quick_runs):
    """From outside the repository (configs come from the package) on 2 CPU replicas started by Lightning's popen."""
    if CONSOLE_SCRIPT is None:
        pytest.skip("the console script lightning-het-train is not installed (pip install -e .)")
    run_dir, result = quick_runs["whole"]
    metrics = check_metrics(run_dir / "metrics.json", world_size=2)
    assert metrics["balance"]["emulate_slowdown"] == [1.0, 4.0]
    assert (run_dir / "prediction_map.tif").is_file() and (run_dir / "prediction_map.png").is_file()
    assert (run_dir / ".hydra" / "config.yaml").is_file()
    # the printed summary: balance table and the three scores, once (rank 0 only)
    assert result.stdout.count("test: OA") == 1
    assert "HeterogeneousStrategy balance" in result.stdout
    # everything went into the run directory: nothing in the working directory, no second run directory
    assert sorted(p.name for p in run_dir.parent.iterdir()) == ["run"]


@pytest.mark.slow
def test_a_limited_run_resumes_from_last_ckpt_to_the_same_weights(quick_runs):
    """Stop after 1 of 2 epochs (as if killed there: last.ckpt is what survives), resume with ``ckpt_path=``: the
    weights after epoch 2 equal those of an uninterrupted 2-epoch run (<= 1e-6)."""
    whole, resumed = quick_runs["whole"][0], quick_runs["resumed"][0]
    reference = torch.load(whole / "checkpoints" / "last.ckpt", weights_only=True)
    final = torch.load(resumed / "checkpoints" / "last.ckpt", weights_only=True)  # plain types only
    assert final["global_step"] == reference["global_step"] and final["epoch"] == reference["epoch"]
    worst = max(
        (reference["state_dict"][k] - final["state_dict"][k]).abs().max().item() for k in reference["state_dict"]
    )
    assert worst <= 1e-6, worst
    assert json.loads((resumed / "metrics.json").read_text())["epochs"] == 2


@pytest.mark.slow
def test_each_lightning_and_strategy_message_is_printed_once(quick_runs):
    """Lightning's own console handler and Hydra's root handler both printed every Lightning/strategy record."""
    out, result = quick_runs["first"]  # a one-epoch run
    console = result.stdout + result.stderr
    assert console.count("GPU available:") == 1, console  # Lightning's
    assert console.count("HeterogeneousStrategy: profiling on the first") == 1, console  # the strategy's
    # the balance table: logged once when profiling ends, and once more in the run's closing summary
    assert console.count("rank node device") == 2, console
    assert "INFO: " not in console  # Lightning's own handler's format
    assert "GPU available:" in (out / "train.log").read_text()  # the job's log file still has Lightning's records


# ------------------------------------------------------------------------------------------ which weights are tested
class _FakeCheckpoint:
    def __init__(self, monitor, best_model_path, best_model_score=None):
        self.monitor, self.best_model_path = monitor, best_model_path
        self.best_model_score = None if best_model_score is None else torch.tensor(best_model_score)


class _FakeTrainer:
    def __init__(self, *callbacks):
        self.checkpoint_callbacks = list(callbacks)


def test_test_ckpt_best_uses_the_monitored_checkpoint():
    from lightning_het.app.run import _test_checkpoint

    trainer = _FakeTrainer(_FakeCheckpoint(None, ""), _FakeCheckpoint("val/oa", "/run/checkpoints/best.ckpt", 0.75))
    assert _test_checkpoint(trainer, "best") == {
        "requested": "best",
        "used": "best",
        "path": "/run/checkpoints/best.ckpt",
        "monitor": "val/oa",
        "score": 0.75,
    }
    assert _test_checkpoint(trainer, "last") == {"requested": "last", "used": "last", "path": None}


def test_test_ckpt_best_without_a_monitored_checkpoint_tests_the_last_weights(caplog):
    from lightning_het.app.run import _test_checkpoint

    with caplog.at_level(logging.WARNING, logger="lightning_het.app.run"):
        record = _test_checkpoint(_FakeTrainer(_FakeCheckpoint(None, "")), "best")
    assert record["used"] == "last" and record["path"] is None and "callbacks=none" in record["note"]
    assert "testing the last epoch's weights" in caplog.text


def test_default_config_tests_the_best_validation_checkpoint(compose_cfg):
    cfg = compose_cfg()
    assert cfg.test_ckpt == "best"
    best = cfg.callbacks.best_checkpoint
    assert best.monitor == "val/oa" and best.mode == "max" and best.save_top_k == 1


def test_unknown_test_ckpt_is_refused(compose_cfg):
    from lightning_het.app.messages import UserError
    from lightning_het.app.run import train

    with pytest.raises(UserError, match=r"test_ckpt=first"):
        train(compose_cfg("experiment=quick", "test_ckpt=first"))


@pytest.mark.slow
def test_the_run_tests_its_best_validation_epoch(quick_runs):
    out = quick_runs["whole"][0]  # the default test_ckpt=best, over 2 epochs
    metrics = json.loads((out / "metrics.json").read_text())
    tested = metrics["test_ckpt"]
    assert tested["requested"] == "best" and tested["used"] == "best" and tested["monitor"] == "val/oa"
    assert Path(tested["path"]) == out / "checkpoints" / "best.ckpt" and Path(tested["path"]).is_file()
    assert tested["score"] == pytest.approx(max(h["val/oa"] for h in metrics["history"]))
