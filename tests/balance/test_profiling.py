"""Profiling on the first training steps: any training loader, manual optimization, one replica untouched, and the
speed cache (see also tests/balance/test_inloop_profiling.py)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader

from lightning_het import HeterogeneousStrategy
from lightning_het.balance.cost import AffineCost, fit_affine
from lightning_het.balance.profiler import ProfileCache, cache_key, fit_stage_timings
from tests.helpers.harness import run_fits_job
from tests.helpers.tiny import TinyRegressor, make_dataset


class CountingSGD(torch.optim.SGD):
    """SGD that counts its ``step`` calls (a count that no state restore can hide)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls = 0

    def step(self, closure=None):
        self.calls += 1
        return super().step(closure)


class Recorder(TinyRegressor):
    """Records, when training starts, everything the old pre-training profiling could have disturbed."""

    def __init__(self, manual: bool) -> None:
        super().__init__(manual=manual)
        self.train_mean = torchmetrics.MeanMetric()
        self.seen: dict = {}

    def training_step(self, batch, batch_idx):
        self.train_mean.update(batch[1].mean())
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        return CountingSGD(self.parameters(), lr=self.lr, momentum=0.9)

    def on_train_start(self) -> None:
        opt = self.optimizers().optimizer
        self.seen = {
            "weights": {k: v.clone() for k, v in self.net.state_dict().items()},
            "optimizer": repr(opt.state_dict()),
            "optimizer_steps": opt.calls,
            "metric_updates": self.train_mean._update_count,
            "metric_value": self.train_mean.mean_value.clone(),
            "rng": torch.rand(3),
            "comm": dict(self.trainer.strategy.comm_stats),
            "global_step": self.trainer.global_step,
        }


def _fit(speeds, manual: bool, **strategy_kwargs) -> tuple[dict, HeterogeneousStrategy]:
    pl.seed_everything(5)
    model = Recorder(manual)
    strategy = HeterogeneousStrategy(speeds=speeds, process_group_backend="gloo", **strategy_kwargs)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(make_dataset(48), batch_size=12, shuffle=True))
    return model.seen, strategy


@pytest.mark.parametrize("manual", [False, True])
def test_one_replica_without_speeds_starts_training_untouched(manual: bool) -> None:
    """Nothing runs before training (one replica does not even profile): on_train_start sees what it sees with
    speeds given."""
    profiled, strategy = _fit(None, manual)
    given, _ = _fit([1.0], manual)
    assert strategy.cost_model is None and strategy.profile_seconds == 0.0 and not strategy.profiling
    assert profiled["optimizer_steps"] == 0  # the user's opt.step() never ran while profiling
    assert profiled["metric_updates"] == 0 and float(profiled["metric_value"]) == 0.0
    assert profiled["global_step"] == 0
    for key in ("weights",):
        assert all(torch.equal(profiled[key][k], given[key][k]) for k in given[key])
    for key in ("optimizer", "comm", "metric_updates"):
        assert profiled[key] == given[key]
    assert torch.equal(profiled["rng"], given["rng"])


def _slow_fit(
    loader: dict | None = None, manual: bool = False, batch_size: int = 16, epochs: int = 1, strategy: Any = None
) -> dict:
    """Rank 1 pays 3x the per-sample cost; the strategy is named by its string, so it profiles (on its first 6 steps;
    the fitted split from step 7, or later when loader workers draw batches further ahead). 10 global batches an
    epoch."""
    return {
        "devices": 2,
        "strategy": strategy or "heterogeneous",
        "epochs": epochs,
        "n": 10 * 2 * batch_size,
        "batch_size": batch_size,
        "module": {"cost_per_sample_s": 0.003, "slow_factor": 3.0, "slow_rank": 1, "manual": manual},
        "loader": loader or {},
    }


#: loaders with worker processes that profiling must cope with
WORKER_LOADERS = {
    "workers1": {"num_workers": 1},
    "workers2-persistent": {"num_workers": 2, "persistent_workers": True, "pin_memory": True, "prefetch_factor": 3},
}


@pytest.fixture(scope="module")
def slow_replica_fits(tmp_path_factory) -> dict[str, tuple[list[dict], str]]:
    """The profiled fits of this module, in one job (one launch and rendezvous instead of six): per-rank dumps and
    output of a plain loader (``"string"``), of each loader of :data:`WORKER_LOADERS` (three epochs: with 2 workers
    prefetching 3 batches each, 7 batches are drawn ahead and the fitted split starts at step 19), of ``"manual"``
    optimization (loader batch 4), and twice with the speed cache on (``"cache_first"``, ``"cache_second"``)."""
    fits = {"string": _slow_fit()}  # no loader workers; the first fit, the one that launches the replica
    fits.update({name: _slow_fit(loader, epochs=3) for name, loader in WORKER_LOADERS.items()})
    fits["manual"] = _slow_fit(manual=True, batch_size=4)
    # the replicas share the machine: the emulated slowdown is what gives them cache keys of their own
    cache = {"profile_cache": str(tmp_path_factory.mktemp("speed_cache")), "emulate_slowdown": [1, 1.5]}
    fits["cache_first"] = _slow_fit(strategy=cache)
    fits["cache_second"] = _slow_fit(strategy=cache)
    results = run_fits_job(tmp_path_factory.mktemp("slow_replica"), list(fits.values()))
    return dict(zip(fits, results))


@pytest.mark.slow
def test_string_strategy_profiles_slow_replica_to_a_quarter(slow_replica_fits) -> None:
    dumps, out = slow_replica_fits["string"]
    sizes = dumps[0]["batch_sizes"]
    assert sum(sizes) == 32
    assert 6 <= sizes[1] <= 10, sizes  # a quarter of 32 is 8
    assert dumps[0]["speeds"][0] / dumps[0]["speeds"][1] == pytest.approx(3.0, rel=0.35)
    seen = dumps[1]["seen_batch_sizes"]
    # warm-up at the equal split (a sized loader: Lightning draws nothing ahead), the rough split and one beyond it
    # (each timed twice), the fitted one
    assert seen[0] == 16 and seen[1:5] == seen[1:3] * 2 and 16 > seen[1] > seen[2] and seen[5:] == [sizes[1]] * 5
    assert "profiling on the first 5 training steps" in out and "balance" in out and "samples/s" in out


@pytest.mark.slow
@pytest.mark.parametrize("loader", list(WORKER_LOADERS))
def test_loaders_with_workers_profile_and_balance(slow_replica_fits, loader: str) -> None:
    dumps, _ = slow_replica_fits[loader]
    sizes = dumps[0]["batch_sizes"]
    assert sum(sizes) == 32 and 6 <= sizes[1] <= 10, sizes  # a quarter of 32 is 8
    seen = dumps[1]["seen_batch_sizes"]
    assert len(seen) == 30 and seen[-10:] == [sizes[1]] * 10  # the whole third epoch at the fitted split


@pytest.mark.slow
def test_manual_optimization_profiles_the_slow_replica(slow_replica_fits) -> None:
    dumps, _ = slow_replica_fits["manual"]
    sizes = dumps[0]["batch_sizes"]
    assert sum(sizes) == 8 and sizes[0] >= 5, sizes  # 3x slower rank 1: 6 of 8 on rank 0 when balanced
    costs = [AffineCost.from_dict(c) for c in dumps[0]["cost_model"]]
    assert costs[1](2) > costs[0](2)  # the slow replica's step is predicted slower at any size


def test_fit_stage_timings_uses_the_fastest_step_of_each_stage() -> None:
    slow_first = [1.0, 0.03]
    cost = fit_stage_timings([(4, slow_first), (8, [0.05, 0.051])])
    assert cost.fixed_s == pytest.approx(0.01) and cost.per_sample_s == pytest.approx(0.005)


class TestProfileCache:
    def test_round_trip_and_key_mismatch(self, tmp_path) -> None:
        cache = ProfileCache(tmp_path / "c")
        assert cache.get("k")["cost"] is None
        cache.put("k", cost=AffineCost(0.01, 0.002))
        assert cache.get("k")["cost"] == AffineCost(0.01, 0.002)
        assert cache.get("other")["cost"] is None
        assert cache.get("k")["threshold"] is None  # stored without one
        cache.put("k", cost=AffineCost(0.01, 0.002), threshold=1.25)
        assert cache.get("k")["cost"] == AffineCost(0.01, 0.002) and cache.get("k")["threshold"] == 1.25
        assert cache.get("other")["threshold"] is None
        (tmp_path / "c" / next(p.name for p in (tmp_path / "c").iterdir())).write_text("{not json")
        assert cache.get("k") == {"cost": None, "threshold": None, "cap": None}  # unreadable: nothing stored
        ProfileCache(tmp_path / "file" / "c").directory.parent.write_text("")  # an unwritable directory is ignored
        ProfileCache(tmp_path / "file" / "c").put("k", cap=3)

    def test_default_directory(self, tmp_path, monkeypatch) -> None:
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
        assert ProfileCache().directory == tmp_path / "lightning_het" / "profiles"

    def test_key_depends_on_what_sets_the_speed(self) -> None:
        cpu = torch.device("cpu")
        sample = (torch.zeros(4), torch.zeros(1))
        base = cache_key(TinyRegressor(), cpu, sample, slowdown=1.0)
        assert base == cache_key(TinyRegressor(), cpu, (torch.ones(4), torch.ones(1)), slowdown=1.0)
        assert base != cache_key(TinyRegressor(), cpu, (torch.zeros(5), torch.zeros(1)), slowdown=1.0)
        assert base != cache_key(TinyRegressor(), cpu, sample, slowdown=2.0)
        wider = TinyRegressor()
        wider.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
        assert base != cache_key(wider, cpu, sample, slowdown=1.0)

    @pytest.mark.slow
    def test_second_fit_skips_profiling(self, slow_replica_fits) -> None:
        (first, first_out), (second, second_out) = slow_replica_fits["cache_first"], slow_replica_fits["cache_second"]
        assert not first[0]["profile_cached"] and second[0]["profile_cached"]
        assert second[0]["cost_model"] == first[0]["cost_model"]
        assert second[0]["batch_sizes"] == first[0]["batch_sizes"]
        assert set(second[1]["seen_batch_sizes"]) == {second[0]["batch_sizes"][1]}  # no trial split at all
        assert "profiling on the first" in first_out and "profiling on the first" not in second_out
        assert "costs from the profile cache" in second_out
        _, off = _fit(None, False, profile_cache="unused")  # one replica: no profiling, the cache is not consulted
        assert not off.balance_report()["profile_cached"]

    def test_invalid_argument(self) -> None:
        with pytest.raises(ValueError, match="profile_cache"):
            HeterogeneousStrategy(profile_cache=3)


def test_fit_stage_timings_keeps_a_cautious_slope() -> None:
    # two stages that timing noise made almost equal: the slope is kept at 10 % of 20 ms / 8 samples
    cost = fit_stage_timings([(2, [0.0199]), (8, [0.020])])
    assert cost.per_sample_s == pytest.approx(0.00025)
    assert cost(8) == pytest.approx(0.020)


def test_fit_stage_timings_drops_a_fixed_cost_within_the_timing_noise() -> None:
    # 3 ms a sample, timed twice at 6, 8 and 10 samples with 25 % noise: the minima's line has a 3.3 ms intercept
    noisy = [(6, [0.025, 0.020]), (8, [0.030, 0.0375]), (10, [0.032, 0.040])]
    stages = [(b, list(ts)) for b, ts in noisy]
    assert fit_affine([6, 8, 10], [0.020, 0.030, 0.032]).fixed_s == pytest.approx(0.01 / 3)
    cost = fit_stage_timings(stages)
    assert cost.fixed_s == 0.0 and cost.per_sample_s == pytest.approx((6 * 0.02 + 8 * 0.03 + 10 * 0.032) / 200)
    # the same minima timed with 2 % noise: the intercept is beyond the noise, kept
    quiet = [(b, [t, t * 1.02]) for b, t in ((6, 0.020), (8, 0.030), (10, 0.032))]
    assert fit_stage_timings(quiet).fixed_s == pytest.approx(0.01 / 3)
