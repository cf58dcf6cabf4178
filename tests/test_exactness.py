"""Exact and robust in ordinary Lightning setups: epoch metrics, tiny evaluation sets, the tail, any sampler, batch
norm, loaders without a batch size. Each multi-replica result is compared with one process doing the same.

The two-replica job runs on both Lightning packages: ``lightning.pytorch`` and the standalone ``pytorch_lightning``
(its ``Trainer`` and ``LightningModule``, the strategy from :mod:`lightning_het.pl`)."""

from __future__ import annotations

import concurrent.futures
import importlib.util

import pytest
import torch
from torch import nn
from torch.utils.data import WeightedRandomSampler

from lightning_het import ProportionalDistributedSampler
from tests.helpers.harness import run_harness
from tests.helpers.tiny import FLAVOUR_ENV, FLAVOURS, make_dataset, make_net, reference_weights

pytestmark = pytest.mark.slow


#: the scenarios of the two-replica job (speeds [1, 3]) and of the three-replica one (speeds [1, 1, 10])
TWO = ["metrics_41", "tail", "weighted", "batchnorm", "no_batch_size", "numpy_global_batch"]
THREE = ["metrics_40", "metrics_1", "metrics_2", "metrics_5"]


def _job(
    tmp_path, devices: int, speeds: list[float], scenarios: list[str], flavour: str = "lightning"
) -> tuple[list[dict], str]:
    result = run_harness(
        "exact",
        tmp_path,
        {"devices": devices, "speeds": speeds, "scenarios": scenarios},
        env={FLAVOUR_ENV: flavour},
    )
    assert result.returncode == 0, result.output[-6000:]
    assert not result.survivors
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(devices)], result.output


def _full_mse(n: int) -> float:
    data = make_dataset(n, seed=99)
    with torch.no_grad():
        return nn.functional.mse_loss(make_net()(data.tensors[0]), data.tensors[1]).item()


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in b)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict[str, tuple[list[dict], str]]:
    """The module's jobs, side by side (independent, and none times anything): ``"two"`` replicas with speeds [1, 3]
    on each installed Lightning package (``"two-<package>"`` for the standalone one) and ``"three"`` with
    [1, 1, 10]; each: the per-rank dumps and the output."""
    standalone = [f for f in FLAVOURS if f != "lightning" and importlib.util.find_spec(f) is not None]
    with concurrent.futures.ThreadPoolExecutor(2 + len(standalone)) as pool:
        runs = {
            "two": pool.submit(_job, tmp_path_factory.mktemp("two"), 2, [1.0, 3.0], TWO),
            "three": pool.submit(_job, tmp_path_factory.mktemp("three"), 3, [1.0, 1.0, 10.0], THREE),
        }
        for flavour in standalone:
            runs[f"two-{flavour}"] = pool.submit(
                _job, tmp_path_factory.mktemp(f"two-{flavour}"), 2, [1.0, 3.0], TWO, flavour
            )
        return {name: run.result() for name, run in runs.items()}


@pytest.fixture(scope="module", params=FLAVOURS)
def two_replicas(request, jobs):
    """The two-replica job on each Lightning package (the standalone one: skipped when it is not installed)."""
    if request.param == "lightning":
        return jobs["two"]
    pytest.importorskip(request.param)
    return jobs[f"two-{request.param}"]


@pytest.fixture(scope="module")
def three_replicas(jobs):
    return jobs["three"]


def test_epoch_metric_with_uneven_shares_equals_one_process(two_replicas, three_replicas):
    """41 samples over speeds [1, 3] (shares 10 / 31) and 40 over [1, 1, 10]: no truncated sample count."""
    for dumps, n in ((two_replicas[0], 41), (three_replicas[0], 40)):
        assert sum(d[f"metrics_{n}"]["val_seen"] for d in dumps) == n
        for d in dumps:
            assert d[f"metrics_{n}"]["val_loss"] == pytest.approx(_full_mse(n), rel=1e-6)


@pytest.mark.parametrize("n", [1, 2, 5])
def test_tiny_validation_set_gives_every_replica_a_sample(three_replicas, n):
    dumps, out = three_replicas
    seen = [d[f"metrics_{n}"]["val_seen"] for d in dumps]
    assert min(seen) >= 1
    repeats = -(-3 // n) if n < 3 else 1
    assert sum(seen) == n * repeats
    for d in dumps:  # a mean over equally repeated samples is the mean
        assert d[f"metrics_{n}"]["val_loss"] == pytest.approx(_full_mse(n), rel=1e-6)
    if repeats > 1:
        assert f"evaluated {repeats} times over" in out


def test_tail_trained_as_last_smaller_batch(two_replicas):
    dumps, _ = two_replicas
    reference = reference_weights(make_dataset(45), 8, epochs=2, seed=0)  # one process: 5 x 8, then 5
    for rank, d in enumerate(dumps):
        r = d["tail"]
        assert r["batch_sizes"] == [2, 6] and r["global_step"] == 12
        assert r["seen_batch_sizes"] == ([2] * 5 + [1] if rank == 0 else [6] * 5 + [4]) * 2
        assert _max_diff(r["state_dict"], reference) < 1e-5


def test_weighted_random_sampler_wrapped(two_replicas):
    dumps, _ = two_replicas
    order = WeightedRandomSampler(torch.linspace(0.2, 1.0, 40), 50, replacement=True)
    reference = reference_weights(make_dataset(40), 8, epochs=2, seed=0, order_sampler=order)
    for d in dumps:
        assert d["weighted"]["global_step"] == 2 * 7  # 6 x 8 + a tail of 2, per epoch
        assert _max_diff(d["weighted"]["state_dict"], reference) < 1e-5


def test_batchnorm_warns_and_keeps_two_samples_per_replica(two_replicas):
    dumps, out = two_replicas
    assert "batch norm layer(s) (net.1)" in out and "sync_batchnorm=True" in out
    assert dumps[0]["batchnorm"]["batch_sizes"] == [2, 2]  # [1, 3] without batch norm
    assert min(min(d["batchnorm"]["seen_batch_sizes"]) for d in dumps) == 2


def test_loader_without_batch_size_and_numpy_global_batch(two_replicas):
    dumps, _ = two_replicas
    reference = reference_weights(make_dataset(40), 8, epochs=2, seed=0)
    for rank, d in enumerate(dumps):
        assert d["no_batch_size"]["seen_batch_sizes"] == [[2, 6][rank]] * 10
        assert _max_diff(d["no_batch_size"]["state_dict"], reference) < 1e-5
        assert d["numpy_global_batch"]["batch_sizes"] == [2, 6]


def test_reference_order_sampler_matches_sampler_unit():
    """The one-process reference draws the same order as ProportionalDistributedSampler([B])."""
    order = WeightedRandomSampler(torch.ones(20), 20)
    s = ProportionalDistributedSampler(list(range(20)), [8], 0, seed=0, order_sampler=order)
    assert len(s) == 20 and s.num_steps == 3
