"""The typed public API: explicit annotated keywords, comm algorithm objects, Profiling / Reliability, the
EmulatedPlatform callback, and the old flat keywords as deprecated aliases with the same meaning."""

from __future__ import annotations

import inspect
import re
import typing
import warnings

import pytest

import lightning_het
from lightning_het import (
    AllReduce,
    Auto,
    EmulatedPlatform,
    HeterogeneousFabricStrategy,
    HeterogeneousStrategy,
    Hierarchical,
    NodeLocal,
    Profiling,
    Reliability,
)
from lightning_het.arguments import ArgumentError
from lightning_het.config import DEPRECATED_KEYWORDS, typed_keywords
from tests.helpers.tiny import TinyRegressor, make_dataset, quiet_trainer

OURS = {
    "global_batch_size",
    "speeds",
    "min_batch_size",
    "max_batch_sizes",
    "max_micro_batch_sizes",
    "node_ids",
    "comm",
    "profiling",
    "reliability",
    "device_map",
    "cpu_threads",
}


@pytest.mark.parametrize("cls", [HeterogeneousStrategy, HeterogeneousFabricStrategy])
def test_every_keyword_is_explicit_annotated_and_keyword_only(cls):
    hints = typing.get_type_hints(cls.__init__)
    parameters = inspect.signature(cls.__init__).parameters
    keywords = {n for n, p in parameters.items() if p.kind is p.KEYWORD_ONLY}
    assert keywords <= OURS and len(keywords) <= 12
    assert {"global_batch_size", "speeds", "min_batch_size", "max_batch_sizes", "node_ids", "comm"} <= keywords
    assert keywords <= set(hints), sorted(keywords - set(hints))
    assert not any(name in parameters for name in DEPRECATED_KEYWORDS)  # only through **kwargs, deprecated
    assert parameters["comm"].default == "auto"
    assert typing.get_args(hints["profiling"]) == (Profiling, type(None))


def test_the_strategy_takes_every_ours():
    assert {
        n for n, p in inspect.signature(HeterogeneousStrategy).parameters.items() if p.kind is p.KEYWORD_ONLY
    } == OURS


def test_public_names_are_exported_lazily():
    for name in ("AllReduce", "Auto", "Hierarchical", "NodeLocal", "Profiling", "Reliability", "EmulatedPlatform"):
        assert name in lightning_het.__all__
        assert getattr(lightning_het, name).__name__ == name


# ------------------------------------------------------------------------------------------------- algorithm objects
def test_mode_names_are_shorthands_of_the_objects():
    for name, obj in (("auto", Auto()), ("allreduce", AllReduce()), ("hierarchical", Hierarchical())):
        assert HeterogeneousStrategy(comm=name).config == HeterogeneousStrategy(comm=obj).config
    by_name = HeterogeneousStrategy(comm="node_local", node_ids=[0, 1]).config
    assert by_name == HeterogeneousStrategy(comm=NodeLocal(), node_ids=[0, 1]).config


def test_node_local_object_sets_the_sync():
    config = HeterogeneousStrategy(
        comm=NodeLocal(sync_every=16, warmup_steps=2, outer="nesterov", outer_lr=0.5, sync_dtype="int8", merge="nodes"),
        node_ids=[0, 0, 1],
    ).config
    assert (config.comm.mode, config.comm.sync_every, config.comm.warmup_steps) == ("node_local", 16, 2)
    assert (config.comm.outer, config.comm.outer_lr, config.comm.sync_dtype, config.comm.merge) == (
        "nesterov",
        0.5,
        "int8",
        "nodes",
    )
    assert HeterogeneousStrategy(comm=Hierarchical(autotune_steps=0)).config.comm.autotune_steps == 0


@pytest.mark.parametrize(
    ("build", "name"),
    [
        (lambda: NodeLocal(sync_every=0), "sync_every"),
        (lambda: NodeLocal(warmup_steps=-1), "warmup_steps"),
        (lambda: NodeLocal(outer="adam"), "outer"),
        (lambda: NodeLocal(outer_lr=0.5), "outer_lr"),  # read only by outer="nesterov"
        (lambda: NodeLocal(sync_dtype="float16"), "sync_dtype"),
        (lambda: NodeLocal(merge="ranks"), "merge"),
        (lambda: Hierarchical(autotune_steps=-1), "autotune_steps"),
        (lambda: Profiling(steps=0), "steps"),
        (lambda: Profiling(telemetry=False, rebalance_threshold=1.2), "telemetry"),
        (lambda: Profiling(rebalance_threshold=0.5), "rebalance_threshold"),
        (lambda: Profiling(rebalance_threshold=float("nan")), "rebalance_threshold"),
        (lambda: Profiling(rebalance_threshold=True), "rebalance_threshold"),
        (lambda: Reliability(startup_timeout=-1), "startup_timeout"),
        (lambda: Reliability(resume="always"), "resume"),
        (lambda: Reliability(preemption_grace=0), "preemption_grace"),
        (lambda: EmulatedPlatform(slowdown=[0.5, 1]), "slowdown"),
        (lambda: EmulatedPlatform(memory_cap=[4, 0]), "memory_cap"),
    ],
)
def test_objects_check_their_arguments_when_built(build, name):
    with pytest.raises(ArgumentError, match=rf"`{name}") as err:
        build()
    assert err.value.argument == name


def test_a_wrong_object_or_both_forms_are_refused():
    with pytest.raises(ArgumentError, match=r"`profiling` to be a `lightning_het.Profiling`"):
        HeterogeneousStrategy(profiling={"steps": 3})
    with pytest.raises(ArgumentError, match=r"`comm=NodeLocal.*`global_sync_every=4`.*`sync_every` on the `comm`"):
        HeterogeneousStrategy(comm=NodeLocal(), global_sync_every=4, node_ids=[0, 1])
    with pytest.raises(ArgumentError, match=r"`profile_steps=3`"):
        HeterogeneousStrategy(profiling=Profiling(), profile_steps=3)
    with pytest.raises(ArgumentError, match=r"comm.*one of"):
        HeterogeneousStrategy(comm="ring")


def test_fabric_takes_the_objects_and_refuses_what_needs_the_trainer():
    config = HeterogeneousFabricStrategy(
        comm=NodeLocal(sync_every=4), node_ids=[0, 1], profiling=Profiling(steps=3), reliability=Reliability(60)
    ).config
    assert (config.comm.sync_every, config.profiling.steps, config.reliability.startup_timeout) == (4, 3, 60)
    assert config.profiling.telemetry is False
    with pytest.raises(ArgumentError, match=r"`rebalance_threshold=1.2`.*Trainer"):
        HeterogeneousFabricStrategy(profiling=Profiling(rebalance_threshold=1.2))
    with pytest.raises(ArgumentError, match=r"`resume='auto'`.*Trainer"):
        HeterogeneousFabricStrategy(reliability=Reliability(resume="auto"))
    deprecated = r"`global_sync_every=4` is deprecated; use comm=NodeLocal\(sync_every=4\)"
    with pytest.warns(DeprecationWarning, match=deprecated):
        old = HeterogeneousFabricStrategy(comm="node_local", global_sync_every=4, node_ids=[0, 1])
    assert old.config == HeterogeneousFabricStrategy(comm=NodeLocal(sync_every=4), node_ids=[0, 1]).config
    with pytest.raises(ValueError, match=r"emulate_slowdown.*need the Trainer's loop"):
        HeterogeneousFabricStrategy(emulate_slowdown=[2.0])


# ------------------------------------------------------------------------------------------------- deprecated aliases
#: one value per old keyword (with what it needs beside it: `comm`, `node_ids`), for a one-replica world
OLD_VALUES = {
    "global_sync_every": {"global_sync_every": 16},
    "comm_warmup_steps": {"comm_warmup_steps": 3},
    "comm_autotune_steps": {"comm_autotune_steps": 0},
    "outer_optimizer": {"outer_optimizer": "nesterov"},
    "outer_lr": {"outer_optimizer": "nesterov", "outer_lr": 0.5},
    "outer_momentum": {"outer_optimizer": "nesterov", "outer_momentum": 0.5},
    "sync_dtype": {"sync_dtype": "int8"},
    "merge_weights": {"merge_weights": "nodes"},
    "emulate_slowdown": {"emulate_slowdown": [2.0]},
    "emulate_memory_cap": {"emulate_memory_cap": [4]},
    "profile_steps": {"profile_steps": 3},
    "profile_warmup": {"profile_warmup": 0},
    "profile_cache": {"profile_cache": "/tmp/speeds"},
    "rebalance_every_n_epochs": {"rebalance_every_n_epochs": 2},
    "rebalance_threshold": {"rebalance_threshold": 1.2},
    "telemetry": {"telemetry": False},
    "startup_timeout": {"startup_timeout": 60},
    "preemption_checkpoint": {"preemption_checkpoint": "pre.ckpt"},
    "preemption_grace": {"preemption_grace": 10.0},
    "resume": {"resume": "auto"},
}
_NAMESPACE = {c.__name__: c for c in (AllReduce, Auto, Hierarchical, NodeLocal, Profiling, Reliability)}


def test_every_old_keyword_has_a_case():
    assert set(OLD_VALUES) == set(DEPRECATED_KEYWORDS)
    assert len(OURS - {"comm", "profiling", "reliability"}) + len(DEPRECATED_KEYWORDS) + 1 == 29  # + comm: 29 of old


@pytest.mark.parametrize("old", sorted(OLD_VALUES))
def test_an_old_keyword_warns_once_with_the_new_form_of_the_same_meaning(old):
    values = OLD_VALUES[old]
    is_comm = DEPRECATED_KEYWORDS[old][0] == "comm"
    node_local = is_comm and old != "comm_autotune_steps"
    base = {"comm": "node_local", "node_ids": [0, 1]} if node_local else {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        strategy = HeterogeneousStrategy(**base, **values)
    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(deprecations) == 1, [str(w.message) for w in deprecations]
    message = str(deprecations[0].message)
    assert f"`{old}=" in message
    new_form = re.search(r"deprecated; use (.*)\.$", message).group(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        if new_form.startswith("Trainer(callbacks=["):  # emulation: the callback hands it over before the fit
            platform = eval(new_form[len("Trainer(callbacks=[") : -2], {"EmulatedPlatform": EmulatedPlatform})
            typed = HeterogeneousStrategy(**base)
            typed.policy.emulate(platform.slowdown, platform.memory_cap)
        else:
            keyword, expression = new_form.split("=", 1)
            typed = HeterogeneousStrategy(**{**base, keyword: eval(expression, _NAMESPACE)})
    assert typed.config == strategy.config


def test_several_old_keywords_give_one_warning():
    with pytest.warns(DeprecationWarning) as record:
        HeterogeneousStrategy(comm="node_local", node_ids=[0, 1], global_sync_every=4, sync_dtype="int8", resume="auto")
    messages = [str(w.message) for w in record if issubclass(w.category, DeprecationWarning)]
    assert messages == [
        "HeterogeneousStrategy: `global_sync_every=4`, `sync_dtype='int8'`, `resume='auto'` are deprecated; use"
        " comm=NodeLocal(sync_every=4, sync_dtype='int8'), reliability=Reliability(resume='auto')."
    ]


def test_the_new_form_warns_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        HeterogeneousStrategy(
            comm=NodeLocal(sync_every=4),
            node_ids=[0, 1],
            profiling=Profiling(steps=3, rebalance_threshold=1.1),
            reliability=Reliability(startup_timeout=60, resume="auto"),
        )


def test_typed_keywords_maps_a_flat_config_with_the_same_meaning():
    flat = {"comm": "node_local", "node_ids": [0, 1], "global_sync_every": 4, "outer_optimizer": "nesterov"}
    flat |= {"profile_steps": 3, "resume": "auto", "emulate_slowdown": [1.0, 2.0], "emulate_memory_cap": None}
    keywords, emulation = typed_keywords(flat)
    assert emulation == {"slowdown": [1.0, 2.0]}
    assert keywords["comm"] == NodeLocal(sync_every=4, outer="nesterov")
    flat.pop("emulate_slowdown")
    with pytest.warns(DeprecationWarning):
        old = HeterogeneousStrategy(**flat)
    assert HeterogeneousStrategy(**keywords).config == old.config
    with pytest.warns(UserWarning, match=r"`global_sync_every=4` only applies to `comm='node_local'`; it is ignored"):
        keywords, _ = typed_keywords({"comm": "allreduce", "global_sync_every": 4})
    assert keywords["comm"] == AllReduce()


# ------------------------------------------------------------------------------------------------- configuration tools
def test_hydra_instantiates_the_strategy_and_its_objects():
    hydra_utils = pytest.importorskip("hydra.utils", reason="the Hydra app extra is not installed")
    from omegaconf import OmegaConf

    node = OmegaConf.create(
        {
            "_target_": "lightning_het.HeterogeneousStrategy",
            "node_ids": [0, 0, 1],
            "comm": {"_target_": "lightning_het.NodeLocal", "sync_every": 16, "sync_dtype": "int8"},
            "profiling": {"_target_": "lightning_het.Profiling", "steps": 3},
            "reliability": {"_target_": "lightning_het.Reliability", "resume": "auto"},
        }
    )
    strategy = hydra_utils.instantiate(node, _convert_="all")
    typed = HeterogeneousStrategy(
        node_ids=[0, 0, 1],
        comm=NodeLocal(sync_every=16, sync_dtype="int8"),
        profiling=Profiling(steps=3),
        reliability=Reliability(resume="auto"),
    )
    assert strategy.config == typed.config
    assert hydra_utils.instantiate({"_target_": "lightning_het.NodeLocal", "sync_every": 4}) == NodeLocal(sync_every=4)


def test_lightning_cli_builds_the_strategy_with_a_nested_comm_object(tmp_path):
    pytest.importorskip("jsonargparse", reason="LightningCLI needs jsonargparse (lightning[pytorch-extra])")
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.demos.boring_classes import BoringModel

    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n"
        "  accelerator: cpu\n"
        "  devices: 2\n"
        "  strategy:\n"
        "    class_path: lightning_het.HeterogeneousStrategy\n"
        "    init_args:\n"
        "      node_ids: [0, 1]\n"
        "      comm:\n"
        "        class_path: lightning_het.NodeLocal\n"
        "        init_args:\n"
        "          sync_every: 8\n"
        "      profiling:\n"
        "        class_path: lightning_het.Profiling\n"
        "        init_args:\n"
        "          steps: 3\n"
    )
    cli = LightningCLI(BoringModel, run=False, args=["--config", str(config)])
    strategy = cli.trainer.strategy
    assert isinstance(strategy, HeterogeneousStrategy)
    assert (strategy.config.comm.mode, strategy.config.comm.sync_every, strategy.config.profiling.steps) == (
        "node_local",
        8,
        3,
    )
    # the command line: a mode name as the shorthand, or the object and its fields
    args = ["--trainer.accelerator=cpu", "--trainer.devices=2"]
    args.append("--trainer.strategy=lightning_het.HeterogeneousStrategy")
    cli = LightningCLI(BoringModel, run=False, args=[*args, "--trainer.strategy.comm=allreduce"])
    assert cli.trainer.strategy.config.comm.mode == "allreduce"
    node_local = ["--trainer.strategy.comm=lightning_het.NodeLocal", "--trainer.strategy.comm.sync_every=4"]
    cli = LightningCLI(BoringModel, run=False, args=[*args, "--trainer.strategy.node_ids=[0, 1]", *node_local])
    assert (cli.trainer.strategy.config.comm.mode, cli.trainer.strategy.config.comm.sync_every) == ("node_local", 4)


# ------------------------------------------------------------------------------------------------- EmulatedPlatform
class _Sizes(TinyRegressor):
    """Records the size of every training forward."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def training_step(self, batch, batch_idx):
        self.sizes.append(len(batch[0]))
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("form", ["callback", "keyword"])
def test_emulated_platform_runs_as_the_old_keywords(form):
    from torch.utils.data import DataLoader

    if form == "callback":
        strategy = HeterogeneousStrategy(process_group_backend="gloo")
        callbacks = [EmulatedPlatform(slowdown=[1.5], memory_cap=[6])]
    else:
        with pytest.warns(DeprecationWarning, match=r"use Trainer\(callbacks=\[EmulatedPlatform\(slowdown=\[1.5\]"):
            strategy = HeterogeneousStrategy(
                process_group_backend="gloo", emulate_slowdown=[1.5], emulate_memory_cap=[6]
            )
        callbacks = []
    model = _Sizes()
    trainer = quiet_trainer(1, strategy, max_epochs=1, callbacks=callbacks)
    trainer.fit(model, DataLoader(make_dataset(24), batch_size=12))
    assert (strategy.config.emulate_slowdown, strategy.config.emulate_memory_cap) == ([1.5], [6])
    # the emulated cap (an emulated out-of-memory error above 6 samples): the shares of 12 ran in pieces of 6
    assert model.sizes and set(model.sizes) == {6}


def test_emulated_platform_needs_the_heterogeneous_strategy():
    from torch.utils.data import DataLoader

    trainer = quiet_trainer(1, "auto", max_epochs=1, callbacks=[EmulatedPlatform(slowdown=[2.0])])
    with pytest.raises(TypeError, match=r"EmulatedPlatform needs `HeterogeneousStrategy`"):
        trainer.fit(TinyRegressor(), DataLoader(make_dataset(8), batch_size=4))


def test_emulated_platform_and_a_different_keyword_are_refused():
    from torch.utils.data import DataLoader

    with pytest.warns(DeprecationWarning):
        strategy = HeterogeneousStrategy(process_group_backend="gloo", emulate_slowdown=[2.0])
    trainer = quiet_trainer(1, strategy, max_epochs=1, callbacks=[EmulatedPlatform(slowdown=[3.0])])
    with pytest.raises(ValueError, match=r"`emulate_slowdown=\[2.0\]` and the EmulatedPlatform callback \[3.0\]"):
        trainer.fit(TinyRegressor(), DataLoader(make_dataset(8), batch_size=4))
