"""HeterogeneousConfig: the strategy's keywords validated once into one frozen object."""

import dataclasses
from datetime import timedelta

import pytest

from lightning_het import HeterogeneousFabricStrategy, HeterogeneousStrategy
from lightning_het.arguments import ArgumentError
from lightning_het.cluster.rendezvous import rendezvous_wait
from lightning_het.comm.allreduce import FLAT_FIELDS
from lightning_het.comm.node_local import NodeLocal
from lightning_het.config import DEPRECATED_KEYWORDS, HeterogeneousConfig, Profiling, Reliability, typed_keywords

#: the config's defaults are the strategy's
DEFAULTS: dict = {}


def test_fields_are_the_typed_keywords():
    # the config holds every setting: the explicit keywords, the typed objects, the emulation and DDP's timeout
    explicit = {"global_batch_size", "speeds", "min_batch_size", "max_batch_sizes", "max_micro_batch_sizes", "node_ids"}
    names = {f.name for f in dataclasses.fields(HeterogeneousConfig)}
    assert names == explicit | {"comm", "profiling", "reliability", "emulate_slowdown", "emulate_memory_cap", "timeout"}
    assert {group for group, _ in DEPRECATED_KEYWORDS.values()} - names == {"emulation"}


def test_values_are_normalised():
    config = HeterogeneousConfig.from_keywords(
        **{**DEFAULTS, "speeds": (1, 3), "max_batch_sizes": [4, 8], "reliability": Reliability(30), "timeout": 5}
    )
    assert config.speeds == [1.0, 3.0] and config.max_batch_sizes == [4, 8] and config.timeout == timedelta(seconds=5)
    assert rendezvous_wait(config.timeout, config.reliability.startup_timeout) == timedelta(seconds=30)


def test_is_frozen():
    config = HeterogeneousConfig.from_keywords(**DEFAULTS)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.speeds = [1.0]  # type: ignore[misc]


def test_a_bad_value_names_its_keyword():
    with pytest.raises(ArgumentError, match=r"`global_batch_size` to be an integer >= 1") as err:
        HeterogeneousConfig.from_keywords(**{**DEFAULTS, "global_batch_size": 0})
    assert err.value.argument == "global_batch_size"


def test_the_strategy_holds_it():
    with pytest.warns(DeprecationWarning):
        strategy = HeterogeneousStrategy(speeds=[1, 2], profile_steps=3)
    assert isinstance(strategy.config, HeterogeneousConfig)
    assert strategy.config.speeds == [1.0, 2.0] and strategy.config.profiling.steps == 3
    assert strategy.speeds_given


def test_check_world_wants_one_entry_per_replica_and_a_batch_the_bounds_hold():
    config = HeterogeneousConfig.from_keywords(**{**DEFAULTS, "speeds": [1, 2, 3]})
    config.check_world(1, 3)
    with pytest.raises(ValueError, match=r"You set `speeds` with 3 entries .*\(num_nodes=1 x devices=2\)"):
        config.check_world(1, 2)
    bounded = HeterogeneousConfig.from_keywords(**{**DEFAULTS, "global_batch_size": 20, "max_batch_sizes": [4, 8]})
    with pytest.raises(ValueError, match="max_batch_sizes"):
        bounded.check_world(1, 2)


#: node_local's sync keywords, each with a value other than its default
SYNC_SETTINGS = {
    "outer_optimizer": "nesterov",
    "outer_lr": 0.5,
    "outer_momentum": 0.5,
    "sync_dtype": "int8",
    "merge_weights": "nodes",
}


@pytest.mark.parametrize("comm", ["allreduce", "hierarchical", "auto"])
@pytest.mark.parametrize("name", list(SYNC_SETTINGS))
def test_node_local_settings_outside_node_local_are_refused(name, comm):
    """A setting only ``comm="node_local"``'s sync reads would be silently ignored in another mode (``"auto"`` never
    resolves to ``node_local``): refused, naming the keyword and the mode."""
    with pytest.raises(ArgumentError, match=rf"You set `{name}=.*`, but it only applies to `comm='node_local'`") as err:
        HeterogeneousStrategy(comm=comm, **{name: SYNC_SETTINGS[name]})
    assert err.value.argument == name and f"comm={comm!r}" in str(err.value)


@pytest.mark.parametrize("name", ["outer_lr", "outer_momentum"])
@pytest.mark.parametrize("outer", [None, lambda params: None])
def test_outer_numbers_without_a_named_outer_optimizer_are_refused(name, outer):
    """``outer_lr`` and ``outer_momentum`` set ``"nesterov"``'s optimizer: plain averaging has none, and a callable
    builds its own."""
    keywords = {"comm": "node_local", "outer_optimizer": outer, name: SYNC_SETTINGS[name]}
    with pytest.raises(ArgumentError, match=rf"You set `{name}=0.5`, but `outer_optimizer=") as err:
        typed_keywords(keywords)
    assert err.value.argument == name


def test_node_local_takes_its_settings():
    with pytest.warns(DeprecationWarning):
        config = HeterogeneousStrategy(comm="node_local", node_ids=[0, 1], **SYNC_SETTINGS).config
    assert config.comm.outer == "nesterov" and config.comm.sync_dtype == "int8" and config.comm.outer_lr == 0.5
    # the defaults, or a callable without the numbers, are fine in any mode
    typed_keywords({"comm": "allreduce", **{n: getattr(NodeLocal(), FLAT_FIELDS[n]) for n in SYNC_SETTINGS}})
    typed_keywords({"comm": "node_local", "outer_optimizer": lambda params: None})


@pytest.mark.parametrize("node_ids", [[0, 0, 0], [3], [2, 2]])
def test_node_local_on_one_declared_node_is_refused_at_construction(node_ids):
    with pytest.raises(
        ArgumentError, match=r"You set `comm='node_local'`, but `node_ids=.*` puts every replica"
    ) as err:
        HeterogeneousConfig.from_keywords(**{**DEFAULTS, "comm": "node_local", "node_ids": node_ids})
    assert err.value.argument == "node_ids"
    HeterogeneousConfig.from_keywords(**{**DEFAULTS, "comm": "node_local", "node_ids": [0, 0, 1]})


@pytest.mark.parametrize(
    ("speeds", "shown"),
    [
        ({0: 1, 1: 2}, r"the mapping \{0: 1, 1: 2\}"),
        ([True, 2], r"`speeds\[0\]` is True"),
        ([1, "2"], r"`speeds\[1\]` is '2'"),
        ([1, None], r"`speeds\[1\]` is None"),
    ],
)
def test_speeds_must_be_real_numbers(speeds, shown):
    with pytest.raises(ArgumentError, match=shown) as err:
        HeterogeneousConfig.from_keywords(**{**DEFAULTS, "speeds": speeds})
    assert err.value.argument == "speeds"


def test_speeds_take_any_real_number_type():
    import numpy as np

    config = HeterogeneousConfig.from_keywords(**{**DEFAULTS, "speeds": (np.float32(1.5), np.int64(2), 3)})
    assert config.speeds == [1.5, 2.0, 3.0]


def test_the_sync_defaults_are_the_strategys():
    from lightning_het.arguments import SYNC_DEFAULTS

    assert {n: getattr(NodeLocal(), FLAT_FIELDS[n]) for n in SYNC_DEFAULTS} == SYNC_DEFAULTS


def test_the_job_identity_reads_the_comm_object_under_the_flat_names():
    """``resume="auto"`` tells jobs apart by node_local's settings, named as in checkpoints written before."""
    from types import SimpleNamespace

    from lightning_het.reliability.checkpointing import identity_differences, trajectory_settings

    trainer = SimpleNamespace(
        accumulate_grad_batches=1, gradient_clip_val=None, gradient_clip_algorithm=None, precision="32-true"
    )
    four, eight = (HeterogeneousConfig.from_keywords(comm=NodeLocal(sync_every=k, outer="nesterov")) for k in (4, 8))
    settings = trajectory_settings(four, "node_local", trainer)
    assert (settings["global_sync_every"], settings["outer_optimizer"], settings["merge_weights"]) == (
        4,
        "nesterov",
        "samples",
    )
    assert identity_differences(settings, trajectory_settings(eight, "node_local", trainer)) == [
        "global_sync_every 4 -> 8"
    ]
    assert trajectory_settings(four, "hierarchical", trainer)["comm"] == "exact"


def test_the_grouped_settings_defaults():
    profiling = Profiling(steps=3, rebalance_threshold=1.1)
    fields = "steps=3, warmup=1, cache=None, rebalance_every_n_epochs=None, rebalance_threshold=1.1, telemetry=True"
    assert repr(profiling) == f"Profiling({fields})"
    with pytest.raises(
        ArgumentError, match=r"^Expected argument `preemption_grace` to be finite seconds > 0, but got 0\.$"
    ):
        Reliability(preemption_grace=0)


def test_both_strategies_hold_their_normalised_keywords():
    strategy = HeterogeneousStrategy(speeds=[3, 1], global_batch_size=8, timeout=60)
    assert (strategy.config.speeds, strategy.batch_sizes) == ([3.0, 1.0], None)
    assert HeterogeneousFabricStrategy(speeds=[1, 3], timeout=60).config.speeds == [1.0, 3.0]
    flat = {"comm": "node_local", "global_sync_every": 4, "profile_steps": 3, "emulate_slowdown": [1, 2]}
    assert typed_keywords(flat) == (
        {"comm": NodeLocal(sync_every=4), "profiling": Profiling(steps=3)},
        {"slowdown": [1, 2]},
    )


@pytest.mark.parametrize("node_ids", [3, "0011", [0, 1.0], [0, True], [0, -1], []])
def test_node_ids_that_are_not_integers_per_replica_are_refused_naming_node_ids(node_ids):
    with pytest.raises(ArgumentError, match=r"`node_ids") as err:
        HeterogeneousStrategy(node_ids=node_ids)
    assert err.value.argument == "node_ids"
    assert HeterogeneousStrategy(node_ids=(5, 5, 0)).config.node_ids == [5, 5, 0]  # normalised per job later
