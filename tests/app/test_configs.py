"""The Hydra config tree: every option composes, every experiment instantiates, schemas reject bad types and values."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

import lightning_het
from lightning_het.app import config_dir
from lightning_het.app.config import (
    ConfigValueError,
    DataConfig,
    StrategyConfig,
    default_devices,
    emulated_node_ids,
    emulated_slowdowns,
    equal_speeds,
    register_configs,
    run_id,
    validate_config,
)
from lightning_het.app.sweeps import _is_sweep_only, sweep_job_command
from tests.conftest_hsi import CLASSES, raster_pair

__all__ = ["raster_pair"]

CONF = config_dir()
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.fixture
def compose_cfg(tmp_path):
    """Compose ``train.yaml`` with overrides, outside a Hydra run (``output_dir`` points into ``tmp_path``)."""
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(CONF), version_base="1.3"):

        def _compose(*overrides: str) -> DictConfig:
            return compose("train", overrides=[f"output_dir={tmp_path}", *overrides])

        yield _compose
    GlobalHydra.instance().clear()


def _world(cfg: DictConfig) -> int:
    return cfg.trainer.devices * cfg.trainer.num_nodes


class TestTree:
    def test_groups_exist(self):
        for group in ("trainer", "strategy", "data", "model", "experiment", "hydra"):
            assert (CONF / group).is_dir(), group
        assert EXPERIMENTS, "conf/experiment/ is empty"
        assert {"quick", "paper_comparison", "node_local", "gpu"} <= set(EXPERIMENTS)

    def test_repo_conf_is_the_config_tree(self):
        repo_conf = Path(lightning_het.__file__).resolve().parents[1] / "conf"
        if (repo_conf / "train.yaml").exists():  # in the repository (not an installed wheel)
            assert not repo_conf.is_symlink()
            assert repo_conf.resolve() == CONF.resolve()

    @pytest.mark.parametrize(
        ("group", "option"),
        [(g, o) for g in ("trainer", "strategy", "data", "model") for o in _options(g)],
    )
    def test_every_group_option_composes(self, compose_cfg, group, option):
        overrides = [f"{group}={option}"]
        if option == "geotiff":
            overrides += ["data.image=cube.tif", "data.labels=gt.tif"]
        cfg = compose_cfg(*overrides)
        OmegaConf.to_container(cfg.trainer, resolve=True)
        validate_config(cfg)


class TestExperiments:
    @pytest.mark.parametrize("name", EXPERIMENTS)
    def test_composes_and_instantiates(self, compose_cfg, name):
        cfg = compose_cfg(f"experiment={name}")
        strategy_cfg, data_cfg = validate_config(cfg)

        datamodule = instantiate({"_target_": data_cfg._target_, **data_cfg.to_kwargs()})
        assert isinstance(datamodule, lightning_het.HeterogeneousDataModule)
        model = instantiate(cfg.model)
        assert isinstance(model, pl.LightningModule)
        node, emulation = strategy_cfg.to_node()  # the typed form the app builds: nested `_target_` objects
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)
            strategy = instantiate(node)
        assert isinstance(strategy, lightning_het.HeterogeneousStrategy)
        with pytest.warns(DeprecationWarning):  # the flat keys, as deprecated aliases: the same settings
            flat = instantiate({"_target_": strategy_cfg._target_, **strategy_cfg.to_kwargs()})
        assert flat.config == dataclasses.replace(
            strategy.config,
            emulate_slowdown=emulation.get("slowdown"),
            emulate_memory_cap=emulation.get("memory_cap"),
        )

        trainer_cfg = cfg.trainer
        if trainer_cfg.accelerator != "cpu":
            # accelerator configs (experiment=gpu) are built here on CPU: same config, CPU devices instead
            trainer_cfg = OmegaConf.merge(trainer_cfg, {"accelerator": "cpu", "devices": 2, "precision": "32-true"})
            strategy = instantiate(strategy_cfg.to_node()[0])
        trainer = instantiate(trainer_cfg, strategy=strategy)
        assert isinstance(trainer, pl.Trainer)
        assert trainer.strategy is strategy

    def test_paper_comparison_on_your_own_scene(self, compose_cfg, raster_pair):
        """`run_experiments.py -- data=geotiff data.image=... data.labels=...`: the scene replaces the synthetic one."""
        image, labels, _, _ = raster_pair
        cfg = compose_cfg(
            "experiment=paper_comparison",
            "strategy=heterogeneous",
            "seed=0",
            "data=geotiff",
            f"data.image={image}",
            f"data.labels={labels}",
            "data.pca_components=auto",
        )
        assert cfg.data.synthetic is None
        assert cfg.data.patch_size == 5 and cfg.data.global_batch_size == 84  # the experiment's other settings
        _, data_cfg = validate_config(cfg)
        datamodule = instantiate({"_target_": data_cfg._target_, **data_cfg.to_kwargs()})
        datamodule.setup("fit")
        assert datamodule.num_classes == CLASSES

    def test_paper_comparison_keeps_its_synthetic_scene(self, compose_cfg):
        cfg = compose_cfg("experiment=paper_comparison")
        assert dict(cfg.data.synthetic)["height"] == 80 and cfg.data.synthetic.bands == 32

    def test_gpu_experiment_uses_every_gpu_without_emulation(self, compose_cfg):
        cfg = compose_cfg("experiment=gpu")
        assert cfg.trainer.accelerator == "gpu"
        assert cfg.trainer.devices == -1
        assert cfg.strategy.emulation.slowdown is None

    def test_quick_experiment_is_tiny(self, compose_cfg):
        cfg = compose_cfg("experiment=quick")
        assert cfg.trainer.devices == 2
        assert cfg.data.synthetic.height * cfg.data.synthetic.width <= 32 * 32


class TestDefaults:
    def test_default_run_emulates_three_heterogeneous_cpu_replicas(self, compose_cfg):
        cfg = compose_cfg()
        assert cfg.trainer.accelerator == "cpu"
        assert cfg.trainer.devices == 3
        assert list(cfg.strategy.emulation.slowdown) == [1.0, 2.0, 4.0]
        assert cfg.data.synthetic is not None and cfg.data.image is None

    def test_gpu_accelerator_uses_every_gpu_and_real_speeds(self, compose_cfg):
        cfg = compose_cfg("trainer.accelerator=gpu")
        assert cfg.trainer.devices == -1
        assert cfg.strategy.emulation.slowdown is None

    @pytest.mark.parametrize(
        ("overrides", "expected"),
        [
            (["trainer.devices=2"], [1.0, 4.0]),
            (["trainer.devices=1"], None),
            (["trainer.devices=2", "trainer.num_nodes=2"], None),
            (["strategy.emulation.slowdown=[1,1,3]"], [1.0, 1.0, 3.0]),
            (["strategy.emulation.slowdown=null"], None),
            (["strategy.emulate_slowdown=[1,1,3]"], [1.0, 1.0, 3.0]),  # the deprecated flat key: the same run
            (["strategy.emulate_slowdown=null"], None),
        ],
    )
    def test_emulation_follows_the_trainer(self, compose_cfg, overrides, expected):
        strategy_cfg, _ = validate_config(compose_cfg(*overrides))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            assert strategy_cfg.to_node()[1].get("slowdown") == expected

    def test_equal_split_has_one_equal_speed_per_replica(self, compose_cfg):
        cfg = compose_cfg("strategy=equal_split", "trainer.devices=4")
        assert list(cfg.strategy.speeds) == [1.0] * 4

    def test_equal_split_needs_an_integer_device_count(self, compose_cfg):
        cfg = compose_cfg("strategy=equal_split", "trainer.devices=auto")
        with pytest.raises(Exception, match=r"trainer\.devices"):
            validate_config(cfg)

    def test_node_local_emulates_two_nodes_on_one_cpu_machine(self, compose_cfg):
        cfg = compose_cfg("strategy=node_local")
        assert cfg.strategy.comm._target_ == "lightning_het.NodeLocal"
        assert list(cfg.strategy.node_ids) == [0, 0, 1]
        cfg = compose_cfg("strategy=node_local", "trainer.num_nodes=2", "trainer.devices=2")
        assert cfg.strategy.node_ids is None  # a real multi-node job: detected


class TestResolvers:
    def _root(self, accelerator="cpu", devices=3, num_nodes=1):
        return OmegaConf.create({"trainer": {"accelerator": accelerator, "devices": devices, "num_nodes": num_nodes}})

    def test_emulated_slowdowns(self):
        assert emulated_slowdowns(4, _root_=self._root()) == [1.0, 2.0, 4.0]
        assert emulated_slowdowns(9, _root_=self._root(devices=2)) == [1.0, 9.0]
        assert emulated_slowdowns(4, _root_=self._root(accelerator="gpu")) is None
        assert emulated_slowdowns(None, _root_=self._root()) is None
        assert emulated_slowdowns(4, _root_=OmegaConf.create({})) is None  # a group composed on its own

    def test_emulated_node_ids(self):
        assert emulated_node_ids(2, _root_=self._root(devices=5)) == [0, 0, 0, 1, 1]
        assert emulated_node_ids(8, _root_=self._root(devices=3)) == [0, 1, 2]
        assert emulated_node_ids(2, _root_=self._root(devices=2, num_nodes=2)) is None

    def test_equal_speeds(self):
        assert equal_speeds(_root_=self._root(devices=2, num_nodes=3)) == [1.0] * 6
        with pytest.raises(ConfigValueError, match=r"trainer\.devices"):
            equal_speeds(_root_=self._root(devices="auto"))

    def test_default_devices(self):
        assert default_devices("cpu") == 3
        assert default_devices("gpu") == -1
        assert default_devices("auto") == "auto"

    def test_run_id_is_shared_by_the_processes_of_a_job(self, monkeypatch):
        monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
        monkeypatch.setenv("SLURM_JOB_ID", "123")
        monkeypatch.setenv("SLURM_STEP_ID", "4")
        monkeypatch.setenv("SLURM_NTASKS", "8")
        assert run_id() == "slurm-123.4"
        monkeypatch.setenv("SLURM_NTASKS", "1")  # one task inside an allocation: its own time-stamped directory
        assert not run_id().startswith("slurm")
        monkeypatch.delenv("SLURM_JOB_ID")
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
        assert run_id() == "torchrun-abc"
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
        assert run_id() == run_id()  # a time stamp, stable within the process


class TestValidation:
    @pytest.mark.parametrize(
        ("override", "message"),
        [
            ("strategy.min_batch_size=abc", "could not be converted to Integer"),
            ("strategy.speeds=[1,fast]", "could not be converted to Float"),
            ("strategy.typo=1", "Key 'typo' not in 'StrategyConfig'"),
            ("data.patch_size=big", "could not be converted to Integer"),
            ("data.split=diagonal", "Invalid value 'diagonal'"),
            ("data.synthetic.bands=1.5", "could not be converted to Integer"),
            ("data.typo=1", "Key 'typo' not in 'DataConfig'"),
        ],
    )
    def test_wrong_type_fails_when_composing(self, compose_cfg, override, message):
        with pytest.raises(ConfigCompositionException) as info:
            compose_cfg(override)
        assert message in f"{info.value} {info.value.__cause__}"

    @pytest.mark.parametrize(
        ("overrides", "key"),
        [
            (["strategy.min_batch_size=0"], "strategy.min_batch_size"),
            (["strategy.emulate_slowdown=[1,0.5,2]"], "strategy.emulate_slowdown"),
            (["strategy.emulation.slowdown=[1,0.5,2]"], "strategy.emulation.slowdown"),
            (["strategy.comm=fastest"], "strategy.comm"),
            (["strategy.profiling.steps=0"], "strategy.profiling.steps"),
            (["strategy=node_local", "strategy.comm.sync_every=0"], "strategy.comm"),
            (["strategy.speeds=[1,-1,1]"], "strategy.speeds"),
            (["strategy.global_sync_every=0", "strategy.comm=node_local"], "strategy.global_sync_every"),
            (["strategy.comm_warmup_steps=-1"], "strategy.comm_warmup_steps"),
            (["strategy.timeout=-5"], "strategy.timeout"),
            (["+strategy.ddp_kwargs.comm=allreduce"], "strategy.ddp_kwargs"),
            (["strategy=unweighted", "strategy.comm=hierarchical"], "strategy.gradient_averaging"),
        ],
    )
    def test_impossible_value_names_the_key(self, compose_cfg, overrides, key):
        cfg = compose_cfg(*overrides)
        with pytest.raises(ConfigValueError, match=key.replace(".", r"\.")):
            strategy_cfg, _ = validate_config(cfg)
            strategy_cfg.to_kwargs()

    @pytest.mark.parametrize(("override", "expected"), [("false", False), ("ck/", "ck/"), ("null", None)])
    def test_preemption_checkpoint_path_or_false(self, compose_cfg, override, expected):
        for key in ("strategy.reliability.preemption_checkpoint", "strategy.preemption_checkpoint"):
            strategy_cfg, _ = validate_config(compose_cfg(f"{key}={override}"))
            assert strategy_cfg.to_kwargs()["preemption_checkpoint"] == expected

    def test_preemption_checkpoint_true_names_the_key(self, compose_cfg):
        with pytest.raises(ConfigValueError, match=r"strategy\.reliability\.preemption_checkpoint"):
            validate_config(compose_cfg("strategy.reliability.preemption_checkpoint=true"))[0].to_kwargs()
        with pytest.raises(ConfigValueError, match=r"strategy\.preemption_checkpoint"):
            validate_config(compose_cfg("strategy.preemption_checkpoint=true"))[0].to_kwargs()

    def test_geotiff_requires_both_files(self, compose_cfg):
        with pytest.raises(ConfigValueError, match=r"`data\.image`, `data\.labels`"):
            validate_config(compose_cfg("data=geotiff"))
        with pytest.raises(ConfigValueError, match=r"`data\.labels`"):
            validate_config(compose_cfg("data=geotiff", "data.image=cube.tif"))

    def test_image_and_synthetic_together_is_an_error(self, compose_cfg):
        with pytest.raises(ConfigValueError, match=r"data\.synthetic"):
            validate_config(compose_cfg("data.image=cube.tif", "data.labels=gt.tif"))

    def test_schema_round_trip(self, compose_cfg):
        strategy_cfg, data_cfg = validate_config(compose_cfg())
        assert isinstance(strategy_cfg, StrategyConfig) and isinstance(data_cfg, DataConfig)
        kwargs = strategy_cfg.to_kwargs()
        assert kwargs["comm"] == "auto" and kwargs["start_method"] == "popen"  # enums as plain strings
        assert "_target_" not in kwargs and "ddp_kwargs" not in kwargs
        assert data_cfg.to_kwargs()["split"] == "random"


class TestSweepCommand:
    def _hydra_cfg(self, tmp_path, task, hydra_overrides, sources):
        return OmegaConf.create(
            {
                "runtime": {
                    "output_dir": str(tmp_path / "sweep" / "1"),
                    "config_sources": [
                        {"path": path, "schema": schema, "provider": provider} for provider, schema, path in sources
                    ],
                },
                "job": {"config_name": "train", "num": 1},
                "overrides": {"task": task, "hydra": hydra_overrides},
            }
        )

    def test_a_sweep_job_becomes_a_single_run_in_its_directory(self, tmp_path):
        hydra_cfg = self._hydra_cfg(
            tmp_path,
            task=["seed=1", "experiment=quick"],
            hydra_overrides=["hydra.mode=MULTIRUN", "hydra.sweep.dir=/x", "hydra/launcher=basic", "hydra.verbose=true"],
            sources=[
                ("hydra", "pkg", "hydra.conf"),
                ("main", "pkg", "lightning_het.conf"),
                ("command-line", "file", "/my/conf"),
            ],
        )
        command = sweep_job_command(hydra_cfg, python="python")
        assert command[:3] == ["python", "-m", "lightning_het.train"]
        assert "--config-path=pkg://lightning_het.conf" in command
        assert "--config-dir=/my/conf" in command
        assert "--config-name=train" in command
        assert "seed=1" in command and "experiment=quick" in command
        assert "hydra.verbose=true" in command
        assert not any(arg in ("-m", "--multirun") for arg in command[3:])
        assert not any(arg.startswith(("hydra.mode", "hydra.sweep", "hydra/launcher")) for arg in command)
        assert f'hydra.run.dir="{tmp_path / "sweep" / "1"}"' in command
        assert "hydra.output_subdir=null" in command

    @pytest.mark.parametrize(
        ("override", "sweep_only"),
        [
            ("hydra.mode=MULTIRUN", True),
            ("hydra/launcher=slurm", True),
            ("hydra.launcher.partition=gpu", True),
            ("hydra.sweeper.params={a:1}", True),
            ("hydra.sweep.dir=x", True),
            ("hydra.run.dir=x", True),
            ("hydra.job.chdir=true", False),
            ("hydra/job_logging=disabled", False),
            ("hydra.searchpath=[pkg://x]", False),
        ],
    )
    def test_sweep_only_overrides(self, override, sweep_only):
        assert _is_sweep_only(override) is sweep_only


def test_slurm_launcher_config_composes(compose_cfg):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose(
            "train",
            overrides=["hydra/launcher=slurm", "trainer=gpu", "trainer.devices=4", "trainer.num_nodes=2"],
            return_hydra_config=True,
        )
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert launcher.nodes == 2 and launcher.tasks_per_node == 4 and launcher.gpus_per_node == 4


class TestOneSourceOfTruth:
    """The strategy node of the app mirrors the strategy: same keywords, same defaults, the same validators."""

    def test_fields_and_defaults_match_the_strategy_signature(self):
        import enum
        import inspect

        from lightning_het import HeterogeneousStrategy, Profiling, Reliability
        from lightning_het.app.config import EmulationConfig, ProfilingConfig, ReliabilityConfig
        from lightning_het.config import DEPRECATED_KEYWORDS

        parameters = inspect.signature(HeterogeneousStrategy).parameters
        app_only = {"_target_", "gradient_averaging", "ddp_kwargs", "emulation"}  # app switches, not strategy keywords
        ddp_keywords = {"process_group_backend", "start_method", "timeout", "find_unused_parameters"}  # **kwargs
        fields = {f.name: f for f in dataclasses.fields(StrategyConfig)}
        ours = {name for name, p in parameters.items() if p.kind is p.KEYWORD_ONLY}
        # the typed keywords, and the deprecated flat keys (views of the typed ones, which an override replaces)
        assert set(fields) - app_only - ddp_keywords == ours | set(DEPRECATED_KEYWORDS)
        for name in ours - {"profiling", "reliability"}:
            default = fields[name].default
            assert (default.value if isinstance(default, enum.Enum) else default) == parameters[name].default, name
        for schema, cls in ((ProfilingConfig, Profiling), (ReliabilityConfig, Reliability)):
            assert dataclasses.asdict(schema()) == dataclasses.asdict(cls()), cls
        assert [f.name for f in dataclasses.fields(EmulationConfig)] == ["slowdown", "memory_cap"]
        for old, (_, name) in DEPRECATED_KEYWORDS.items():
            assert name in fields[old].default, (old, fields[old].default)  # `${.profiling.steps}`, ...

    def test_the_config_runs_the_strategy_validators(self):
        from lightning_het.app.config import ProfilingConfig

        with pytest.raises(ConfigValueError, match=r"strategy\.max_batch_sizes.*`min_batch_size`=4"):
            StrategyConfig(min_batch_size=4, max_batch_sizes=[8, 2])
        with pytest.raises(ConfigValueError, match=r"strategy\.profiling\.telemetry"):
            StrategyConfig(profiling=ProfilingConfig(telemetry=False, rebalance_every_n_epochs=1))
        with pytest.raises(ConfigValueError, match=r"strategy\.telemetry"):
            StrategyConfig(telemetry=False, rebalance_every_n_epochs=1)


def test_flat_overrides_build_the_typed_form(compose_cfg):
    """`strategy=node_local strategy.global_sync_every=4`: the deprecated flat keys still work, with a warning naming
    the typed keys, and build the same strategy node as `strategy.comm.sync_every=4` (nested `_target_` nodes)."""
    cfg = compose_cfg("strategy=node_local", "strategy.global_sync_every=4", "strategy.profile_steps=3")
    strategy_cfg, _ = validate_config(cfg)
    with pytest.warns(FutureWarning, match=r"`strategy.global_sync_every=4`.*use `strategy.comm.sync_every=4`"):
        node, emulation = strategy_cfg.to_node()
    typed_cfg, _ = validate_config(
        compose_cfg("strategy=node_local", "strategy.comm.sync_every=4", "strategy.profiling.steps=3")
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert typed_cfg.to_node() == (node, emulation)
    assert node["comm"]["_target_"] == "lightning_het.NodeLocal" and node["comm"]["sync_every"] == 4
    assert node["profiling"]["_target_"] == "lightning_het.Profiling" and node["profiling"]["steps"] == 3
    assert node["reliability"]["resume"] == "auto"
    assert not {"global_sync_every", "profile_steps", "emulate_slowdown", "resume", "emulation"} & set(node)
    assert emulation == {"slowdown": [1.0, 2.0, 4.0]}
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        strategy = instantiate(node)
    assert (strategy.config.comm.mode, strategy.config.comm.sync_every, strategy.config.profiling.steps) == (
        "node_local",
        4,
        3,
    )
    # a mode name and an old comm key: the object of that mode
    cfg = compose_cfg("strategy.comm=node_local", "strategy.global_sync_every=2", "strategy.node_ids=[0,0,1]")
    with pytest.warns(FutureWarning):
        node, _ = validate_config(cfg)[0].to_node()
    assert node["comm"]["_target_"] == "lightning_het.NodeLocal" and node["comm"]["sync_every"] == 2
