"""HeterogeneousConfig: the strategy's keywords validated once into one frozen object."""

import dataclasses
from datetime import timedelta

import pytest

from lightning_het.arguments import ArgumentError
from lightning_het.config import DEVICE_KEYWORDS, KEYWORD_DEFAULTS, HeterogeneousConfig

#: every field of the config with the strategy's default (``timeout`` is DDP's keyword, which the config holds too)
DEFAULTS = {n: v for n, v in KEYWORD_DEFAULTS.items() if n not in DEVICE_KEYWORDS} | {"timeout": None}


def test_fields_are_the_validated_keywords():
    # the keyword table and the dataclass name the same keywords (the device map's go to the accelerator instead)
    assert {f.name for f in dataclasses.fields(HeterogeneousConfig)} == set(DEFAULTS)


def test_values_are_normalised():
    config = HeterogeneousConfig.from_keywords(
        **{**DEFAULTS, "speeds": (1, 3), "max_batch_sizes": [4, 8], "startup_timeout": 30, "timeout": 5}
    )
    assert config.speeds == [1.0, 3.0] and config.max_batch_sizes == [4, 8]
    assert config.startup_timeout == timedelta(seconds=30) and config.timeout == timedelta(seconds=5)
    assert config.as_dict()["speeds"] == [1.0, 3.0]


def test_is_frozen():
    config = HeterogeneousConfig.from_keywords(**DEFAULTS)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.speeds = [1.0]  # type: ignore[misc]


def test_a_bad_value_names_its_keyword():
    with pytest.raises(ArgumentError, match=r"`global_batch_size` to be an integer >= 1") as err:
        HeterogeneousConfig.from_keywords(**{**DEFAULTS, "global_batch_size": 0})
    assert err.value.argument == "global_batch_size"


def test_the_strategy_holds_it():
    from lightning_het import HeterogeneousStrategy

    strategy = HeterogeneousStrategy(speeds=[1, 2], profile_steps=3)
    assert isinstance(strategy.config, HeterogeneousConfig)
    assert strategy.config.speeds == [1.0, 2.0] and strategy.config.profile_steps == 3
    assert strategy.speeds_given


def test_check_world_wants_one_entry_per_replica_and_a_batch_the_bounds_hold():
    config = HeterogeneousConfig.from_keywords(**{**DEFAULTS, "speeds": [1, 2, 3]})
    config.check_world(1, 3)
    with pytest.raises(ValueError, match=r"You set `speeds` with 3 entries .*\(num_nodes=1 x devices=2\)"):
        config.check_world(1, 2)
    bounded = HeterogeneousConfig.from_keywords(**{**DEFAULTS, "global_batch_size": 20, "max_batch_sizes": [4, 8]})
    with pytest.raises(ValueError, match="max_batch_sizes"):
        bounded.check_world(1, 2)
