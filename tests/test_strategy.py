"""HeterogeneousStrategy end to end: exactness, profiling, spawn, loaders, and early errors."""

from __future__ import annotations

import copy
import math
import sys
import threading

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler

import lightning_het
from lightning_het import HeterogeneousStrategy
from tests.helpers import harness
from tests.helpers.harness import run_fits_job
from tests.helpers.tiny import TinyRegressor, make_dataset, quiet_trainer, reference_weights


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in b)


#: the two-replica fits of this module, run in one job (one launch and rendezvous instead of two)
TWO_REPLICA_FITS = {
    "manual": {"devices": 2, "strategy": {"speeds": [1, 3]}, "epochs": 1, "n": 60, "module": {"manual": True}},
    "accumulate": {"devices": 2, "strategy": {"speeds": [1, 2], "global_batch_size": 12}, "accumulate": 2, "n": 60},
}


@pytest.fixture(scope="module")
def two_replicas(tmp_path_factory) -> dict[str, tuple[list[dict], str]]:
    """Each fit of :data:`TWO_REPLICA_FITS`: its per-rank dumps and its output."""
    results = run_fits_job(tmp_path_factory.mktemp("two_replicas"), list(TWO_REPLICA_FITS.values()))
    return dict(zip(TWO_REPLICA_FITS, results))


def test_manual_optimization_and_gradient_accumulation_exact(two_replicas):
    manual, _ = two_replicas["manual"]
    assert manual[0]["batch_sizes"] == [2, 6]
    ref = reference_weights(make_dataset(60), 8, epochs=1, seed=0)
    assert all(_max_diff(d["state_dict"], ref) < 1e-5 for d in manual)

    accum, _ = two_replicas["accumulate"]
    ref = reference_weights(make_dataset(60), 12, epochs=2, seed=0, accumulate=2)
    assert accum[1]["seen_batch_sizes"] == [8] * 10
    assert all(_max_diff(d["state_dict"], ref) < 1e-5 for d in accum)


def test_spawn_parent_sees_allocation():
    pl.seed_everything(0)
    strategy = HeterogeneousStrategy(speeds=[1, 3], start_method="spawn", process_group_backend="gloo")
    trainer = quiet_trainer(2, strategy, max_epochs=1, num_sanity_val_steps=0)
    trainer.fit(TinyRegressor(), DataLoader(make_dataset(40), batch_size=4))
    assert trainer.strategy.batch_sizes == [2, 6]
    assert trainer.strategy.speeds == [1.0, 3.0]
    assert trainer.strategy.node_ids == [0, 0]


def test_fork_started_fit_then_validate():
    """``start_method="fork"`` (what ``ddp_fork`` and ``ddp_notebook`` map to): a second Trainer call forks its replicas
    from a process whose launcher still lists the first call's workers, which are not the new replicas' children."""
    pl.seed_everything(0)
    strategy = HeterogeneousStrategy(speeds=[1, 3], start_method="fork", process_group_backend="gloo")
    trainer = quiet_trainer(2, strategy, max_epochs=1, num_sanity_val_steps=0)
    model = TinyRegressor()
    trainer.fit(model, DataLoader(make_dataset(40), batch_size=4))
    assert trainer.strategy.batch_sizes == [2, 6]
    results = trainer.validate(model, DataLoader(make_dataset(20, seed=99), batch_size=4))
    assert len(results) == 1 and math.isfinite(results[0]["val/mse"])


class _BroadcastsBetweenBatches(pl.Callback):
    """Counts ``torch.distributed.broadcast`` calls from each training batch's end to the next one's (Lightning's fit
    loop broadcasts rank 0's SIGTERM flag there at every step; the strategy's replicas agree on signals instead)."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.counts, broadcast = [], torch.distributed.broadcast
        self.restore = lambda: setattr(torch.distributed, "broadcast", broadcast)

        def counting(*args, **kwargs):
            if self.counts:
                self.counts[-1] += 1
            return broadcast(*args, **kwargs)

        torch.distributed.broadcast = counting

    def on_train_batch_end(self, trainer: pl.Trainer, *args) -> None:
        self.counts.append(0)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.restore()
        assert len(self.counts) > 2 and self.counts[:-1] == [0] * (len(self.counts) - 1), self.counts


class _DeepCopies(pl.Callback):
    """Deep-copies the trainer's callbacks (the default progress bar holds the trainer, so its strategy too) and the
    strategy at the end of each fit and evaluation, in every replica, while the strategy's guards are running."""

    def _copy(self, trainer: pl.Trainer) -> None:
        callbacks = copy.deepcopy(trainer.callbacks)
        assert [type(c) for c in callbacks] == [type(c) for c in trainer.callbacks]
        assert copy.deepcopy(trainer.strategy).batch_sizes == trainer.strategy.batch_sizes

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._copy(trainer)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Of the strategy's callbacks, Lightning calls one training-batch hook: the preemption callback's batch end
        (which runs the watchdog's, the emergency record's and the balance monitor's parts)."""
        from lightning_het._compat import BATCH_HOOKS

        ours = [c for c in trainer.callbacks if type(c).__module__.startswith("lightning_het")]
        names = sorted(type(c).__name__ for c in ours)
        one = trainer.world_size == 1  # no watchdog, nothing to time
        assert names == (["PreemptionCallback"] if one else ["HeterogeneousBalanceCallback", "PreemptionCallback",
                         "WatchdogCallback"]), names  # fmt: skip
        called = [(type(c).__name__, h) for c in ours for h in BATCH_HOOKS[:6] if callable(getattr(c, h))]
        assert called == [("PreemptionCallback", "on_train_batch_end")], called

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._copy(trainer)


def test_trainer_callbacks_and_strategy_deep_copy_before_during_and_after_a_run(tmp_path):
    """``copy.deepcopy(trainer.callbacks)`` (what Lightning's tests and tools such as tuners do) and
    ``copy.deepcopy(strategy)``: before setup, in every replica of a 2-replica fit while the watchdog, the preemption
    handler and the emergency checkpoint run, and after the fit; the default progress bar and checkpointing."""
    pl.seed_everything(0)
    strategy = HeterogeneousStrategy(speeds=[1, 3], start_method="fork", process_group_backend="gloo")
    assert copy.deepcopy(strategy).config.speeds == [1.0, 3.0]
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, default_root_dir=tmp_path, logger=False,
        enable_model_summary=False, callbacks=[_DeepCopies(), _BroadcastsBetweenBatches()],
    )  # fmt: skip
    copy.deepcopy(trainer.callbacks)
    copy.deepcopy(trainer.strategy)
    trainer.fit(TinyRegressor(), DataLoader(make_dataset(40), batch_size=4), DataLoader(make_dataset(8), batch_size=4))
    assert [type(c) for c in copy.deepcopy(trainer.callbacks)] == [type(c) for c in trainer.callbacks]
    assert copy.deepcopy(trainer.strategy).batch_sizes == [2, 6]
    # one replica (no launch): the fit runs in this process, its guards are this process's
    one = pl.Trainer(
        accelerator="cpu", devices=1, strategy=HeterogeneousStrategy(process_group_backend="gloo"), max_epochs=1,
        default_root_dir=tmp_path / "one", logger=False, enable_model_summary=False, callbacks=[_DeepCopies()],
    )  # fmt: skip
    one.fit(TinyRegressor(), DataLoader(make_dataset(40), batch_size=4), DataLoader(make_dataset(8), batch_size=4))
    assert [type(c) for c in copy.deepcopy(one.callbacks)] == [type(c) for c in one.callbacks]


def test_single_device_runs_whole_batch_and_matches_reference():
    pl.seed_everything(0)
    model = TinyRegressor()
    threads = set(threading.enumerate())
    trainer = quiet_trainer(1, HeterogeneousStrategy(process_group_backend="gloo", profile_steps=1), max_epochs=2)
    trainer.fit(model, DataLoader(make_dataset(60), batch_size=12, shuffle=True))
    # the popen launcher has no replica to watch: no thread of ours outlives the fit (DDP leaves none either)
    assert [t.name for t in set(threading.enumerate()) - threads if t.name.startswith("lightning-het")] == []
    assert trainer.strategy.batch_sizes == [12]
    assert model.seen_batch_sizes == [12] * 10
    ref = reference_weights(make_dataset(60), 12, epochs=2, seed=0)
    assert _max_diff({k: v.detach() for k, v in model.net.state_dict().items()}, ref) < 1e-6


def test_profiling_leaves_no_trace():
    """One replica without speeds runs nothing before or besides training: weights and RNG streams as with speeds."""
    results = []
    for speeds in (None, [1.0]):
        pl.seed_everything(3)
        model = TinyRegressor()
        trainer = quiet_trainer(1, HeterogeneousStrategy(speeds=speeds, process_group_backend="gloo"), max_epochs=1)
        trainer.fit(model, DataLoader(make_dataset(48), batch_size=12, shuffle=True))
        results.append(({k: v.clone() for k, v in model.net.state_dict().items()}, torch.rand(3)))
    assert _max_diff(results[0][0], results[1][0]) == 0.0
    assert torch.equal(results[0][1], results[1][1])


class TestEarlyErrors:
    @pytest.mark.parametrize(
        ("kwargs", "match"),
        [
            ({"speeds": [1.0, 0.0]}, r"`speeds\[1\]` is 0"),
            ({"speeds": [1.0, math.nan]}, r"`speeds\[1\]` is nan"),
            ({"speeds": [1.0, -1.0]}, r"`speeds\[1\]`"),
            ({"global_batch_size": 0}, r"`global_batch_size`"),
            ({"min_batch_size": 0}, r"`min_batch_size`"),
            ({"comm": "ring"}, r"`comm`.*'ring'"),
            ({"global_sync_every": 0}, r"`global_sync_every`"),
            ({"emulate_slowdown": [0.5, 1]}, r"`emulate_slowdown`"),
            ({"node_ids": [0, -1]}, r"`node_ids\[1\]`"),
            ({"max_micro_batch_sizes": "big"}, r"`max_micro_batch_sizes` to be a list of integers.*or \"auto\""),
            ({"max_micro_batch_sizes": [4, 0]}, r"`max_micro_batch_sizes\[1\]`"),
            ({"max_micro_batch_sizes": []}, r"`max_micro_batch_sizes`.*empty"),
            ({"emulate_memory_cap": 8}, r"`emulate_memory_cap` to be a list of integers"),
            ({"emulate_memory_cap": [8, 2.5]}, r"`emulate_memory_cap\[1\]`"),
        ],
    )
    def test_constructor(self, kwargs, match):
        with pytest.raises(ValueError, match=match):
            HeterogeneousStrategy(**kwargs)

    @pytest.mark.parametrize(
        ("kwargs", "match"),
        [
            ({"speeds": [1.0, 2.0, 3.0]}, r"`speeds` with 3 entries.*2 replicas"),
            ({"node_ids": [0]}, r"`node_ids` with 1 entries"),
            ({"max_batch_sizes": [4]}, r"`max_batch_sizes` with 1 entries"),
            ({"max_micro_batch_sizes": [4]}, r"`max_micro_batch_sizes` with 1 entries"),
            ({"emulate_memory_cap": [4, 4, 4]}, r"`emulate_memory_cap` with 3 entries"),
            ({"global_batch_size": 3, "min_batch_size": 2}, r"`global_batch_size`=3.*2 replicas"),
            ({"global_batch_size": 20, "max_batch_sizes": [4, 8]}, r"`max_batch_sizes`=\[4, 8\] cannot hold"),
        ],
    )
    def test_at_trainer_construction_before_workers(self, kwargs, match):
        with pytest.raises(ValueError, match=match):
            quiet_trainer(2, HeterogeneousStrategy(**kwargs))

    def test_dataset_smaller_than_global_batch(self):
        trainer = quiet_trainer(
            1, HeterogeneousStrategy(global_batch_size=100, process_group_backend="gloo"), max_epochs=1
        )
        with pytest.raises(ValueError, match=r"holds 60 samples, fewer than one global batch of 100"):
            trainer.fit(TinyRegressor(), DataLoader(make_dataset(60), batch_size=4))

    @pytest.mark.parametrize("kind", ["plain", "custom"])
    def test_batch_sampler_refused_with_advice(self, kind):
        dataset = make_dataset(40)
        cls = BatchSampler if kind == "plain" else type("MyBatchSampler", (BatchSampler,), {})
        loader = DataLoader(dataset, batch_sampler=cls(RandomSampler(dataset), 4, False))
        trainer = quiet_trainer(1, HeterogeneousStrategy(process_group_backend="gloo"), max_epochs=1)
        with pytest.raises(ValueError, match=r"batch sampler.*HINT: give the DataLoader the index sampler"):
            trainer.fit(TinyRegressor(), loader)


def test_registered_on_import():
    from lightning.pytorch.strategies import StrategyRegistry

    assert "heterogeneous" in StrategyRegistry
    assert StrategyRegistry["heterogeneous"]["strategy"] is lightning_het.HeterogeneousStrategy
    trainer = quiet_trainer(2, "heterogeneous")
    assert isinstance(trainer.strategy, HeterogeneousStrategy)


def test_registered_for_standalone_pytorch_lightning():
    pytorch_lightning = pytest.importorskip("pytorch_lightning")
    from lightning_het._pl_compat import HeterogeneousStrategy as PLHeterogeneousStrategy

    trainer = pytorch_lightning.Trainer(accelerator="cpu", devices=2, strategy="heterogeneous", logger=False)
    assert isinstance(trainer.strategy, PLHeterogeneousStrategy)
    assert isinstance(trainer.strategy, pytorch_lightning.strategies.DDPStrategy)


def test_trainer_strategies_of_both_packages_get_the_lifecycle_launcher_and_the_watchdog():
    """Whether a strategy gets the watchdog and the popen launcher depends on who drives it (a Trainer, of either
    package), never on which package's DDPStrategy it subclasses."""
    pytorch_lightning = pytest.importorskip("pytorch_lightning")
    import lightning_het.pl
    from lightning_het.reliability.launch import ScriptLauncher

    unified = quiet_trainer(2, "heterogeneous").strategy
    standalone = pytorch_lightning.Trainer(
        accelerator="cpu", devices=2, strategy="heterogeneous", logger=False
    ).strategy
    for strategy in (unified, standalone):
        assert strategy.launcher.finishes_runs and strategy.launcher.strategy is strategy
        assert strategy.watchdog is None  # started with the replicas (setup_environment), not at construction
    assert type(unified.launcher) is ScriptLauncher and type(standalone.launcher) is ScriptLauncher
    for fabric_strategy in (lightning_het.HeterogeneousFabricStrategy, lightning_het.pl.HeterogeneousFabricStrategy):
        # your own loop: no Trainer hooks to watch; Fabric's launcher (made orphan-proof), not the Trainer's
        assert not issubclass(fabric_strategy, lightning_het.HeterogeneousStrategy)
        assert "watchdog" not in dir(fabric_strategy)


def test_public_import_for_the_standalone_packages(monkeypatch):
    pytest.importorskip("pytorch_lightning")
    import lightning_het.pl
    from lightning_het._fabric_compat import HeterogeneousFabricStrategy as LFStrategy
    from lightning_het._pl_compat import HeterogeneousStrategy as PLStrategy
    from lightning_het.pl import HeterogeneousFabricStrategy, HeterogeneousStrategy

    assert HeterogeneousStrategy is PLStrategy and HeterogeneousFabricStrategy is LFStrategy
    assert dir(lightning_het.pl) == ["HeterogeneousFabricStrategy", "HeterogeneousStrategy"]
    monkeypatch.delitem(vars(lightning_het.pl), "HeterogeneousFabricStrategy")
    monkeypatch.setitem(sys.modules, "lightning_fabric", None)  # as if it were not installed
    with pytest.raises(ImportError, match=r"`lightning_fabric` package, which is not installed.*pip install"):
        lightning_het.pl.HeterogeneousFabricStrategy  # noqa: B018
    with pytest.raises(AttributeError):
        lightning_het.pl.Nothing  # noqa: B018


def test_the_watchdog_knows_either_packages_sigterm_exception():
    pytorch_lightning = pytest.importorskip("pytorch_lightning")
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from lightning_het.reliability.launch import Preempted
    from lightning_het.reliability.watchdog import is_sigterm_exit

    assert is_sigterm_exit(SIGTERMException()) and is_sigterm_exit(Preempted(None, [15, 0]))
    assert is_sigterm_exit(pytorch_lightning.utilities.exceptions.SIGTERMException())
    from lightning_het._pl_compat import Preempted as StandalonePreempted  # what a pytorch_lightning run raises

    assert isinstance(StandalonePreempted(None, [15]), pytorch_lightning.utilities.exceptions.SIGTERMException)
    assert is_sigterm_exit(StandalonePreempted(None, [15])) and not isinstance(
        StandalonePreempted(None, [15]), Preempted
    )
    assert not is_sigterm_exit(SystemExit(1)) and not is_sigterm_exit(KeyboardInterrupt())


def test_standalone_pytorch_lightning_gets_its_own_callbacks():
    """The callbacks the strategy adds and the mixed accelerator subclass the trainer's own package's classes."""
    pytorch_lightning = pytest.importorskip("pytorch_lightning")
    from lightning.pytorch import Callback

    from lightning_het._flavour import trainer_flavour

    trainer = pytorch_lightning.Trainer(accelerator="cpu", devices=1, logger=False)
    standalone, unified = trainer_flavour(trainer), trainer_flavour(quiet_trainer(1, "heterogeneous"))
    for name in ("WatchdogCallback", "PreemptionCallback", "HeterogeneousBalanceCallback"):
        assert issubclass(getattr(unified, name), Callback)
        assert issubclass(getattr(standalone, name), pytorch_lightning.Callback)
        assert not issubclass(getattr(standalone, name), Callback)
    assert issubclass(standalone.MixedAccelerator, pytorch_lightning.accelerators.Accelerator)


def test_fit_outputs_are_split_even_when_a_marker_lands_inside_another_ranks_line():
    marker = harness.MARKER
    output = f"start\n{marker}0\na\nhalf of a line{marker}1\nb\n{marker}0\nlate rank 1 line\n{marker}1\nc\n"
    assert harness.split_output(output, 2) == ["start\na\nhalf of a line", "b\nlate rank 1 line\nc\n"]
