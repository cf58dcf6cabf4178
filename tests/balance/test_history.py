"""Per-epoch statistics of the gathered timings and the history of one fit."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from lightning_het import Profiling
from lightning_het.balance import monitor as history_module
from lightning_het.balance.clock import EpochTimings
from lightning_het.balance.monitor import BalanceMonitor, epoch_summary


def _timings(compute, wait, batch):
    return EpochTimings(compute, wait, [c + w + 0.001 for c, w in zip(compute, wait)], [batch] * len(compute))


class TestSummaryAndHistory:
    def test_epoch_summary(self):
        s = epoch_summary([_timings([0.1, 0.1, 0.5], [0.2, 0.2, 0.2], 8), _timings([0.3, 0.3, 0.3], [0.0] * 3, 8)])
        assert s["compute_s"] == pytest.approx([0.1, 0.3])
        assert s["wait_s"] == pytest.approx([0.2, 0.0])
        assert s["imbalance"] == pytest.approx(3.0)
        assert s["wait_fraction"][0] == pytest.approx(0.6 / 1.3)
        assert s["samples_per_s"][1] == pytest.approx(24 / 0.903)
        assert math.isnan(epoch_summary([_timings([0.1], [0.0], 4), EpochTimings()])["imbalance"])

    def test_epoch_summary_describes_the_allocation_not_the_tail(self):
        """The tail (a smaller last global batch) neither sets the epoch's batch size nor enters the medians: the
        rebalancer pairs the two, and the tail's size with the full steps' time gave nonsense per-sample costs."""
        full = EpochTimings([0.02, 0.021, 0.019, 0.006], [0.001] * 4, [0.03] * 4, [64, 64, 64, 21])
        s = epoch_summary([full, _timings([0.02, 0.02, 0.02, 0.02], [0.0] * 4, 4)])
        assert s["batch_sizes"] == [64, 4]
        assert s["compute_s"][0] == pytest.approx(0.02)  # median of the three full steps (0.0195 with the tail)
        assert s["steps"] == [4, 4] and s["compute_total_s"][0] == pytest.approx(0.066)
        tie = epoch_summary([EpochTimings([0.1, 0.2], [0.0, 0.0], [0.1, 0.2], [3, 5])])
        assert tie["batch_sizes"] == [5] and tie["compute_s"] == [pytest.approx(0.2)]

    def test_history_thins_long_series(self, monkeypatch):
        monkeypatch.setattr(history_module, "_MAX_SERIES_POINTS", 10)
        history = _monitor([4, 4])
        for epoch in range(3):
            history.add([_timings([0.1] * 8, [0.0] * 8, 4)] * 2, epoch=epoch, global_step=8 * (epoch + 1))
        batches = history.history["series"]["batch"][0]
        assert len(batches) <= 10 and batches[0] == 1.0 and batches == sorted(batches)
        trainer = SimpleNamespace(
            current_epoch=2, global_step=24, max_epochs=5, max_steps=-1, should_stop=False,
            reload_dataloaders_every_n_epochs=0,
        )  # fmt: skip
        assert history.maybe_rebalance(trainer, {"compute_s": [0.1, 0.3]}, 2)  # rank 1 is 3x slower
        trainer.current_epoch, trainer.global_step = 3, 32
        assert not history.maybe_rebalance(trainer, {"compute_s": [0.1, 0.1]}, 3)  # balanced now
        checks, rebalances = history.history["checks"], history.history["rebalances"]
        assert len(checks) == 2 and rebalances == checks[:1] and rebalances[0]["batch"] == 24
        assert checks[0]["from"] == [4, 4] and checks[1]["from"] == rebalances[0]["batch_sizes"]


class _Strategy:
    """What the monitor reads and calls on the strategy."""

    def __init__(self, batch_sizes: list[int]) -> None:
        self.batch_sizes, self.world_size, self.root_device = batch_sizes, len(batch_sizes), torch.device("cpu")
        self.cost_model, self.profiling = None, False

    def adopt_allocation(self, batch_sizes, speeds, costs=None) -> None:
        self.batch_sizes = list(batch_sizes)


def _monitor(batch_sizes: list[int]) -> BalanceMonitor:
    return BalanceMonitor(_Strategy(batch_sizes), Profiling(rebalance_every_n_epochs=1))
