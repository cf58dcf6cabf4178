"""Lightning Fabric: ``Fabric(strategy="heterogeneous")`` with the Trainer strategy's guarantees."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import STRATEGY_REGISTRY
from torch.utils.data import DataLoader

import lightning_het
from lightning_het import HeterogeneousFabricStrategy, ProportionalDistributedSampler, UnpaddedDistributedSampler
from tests.conftest import REPO, run_job
from tests.helpers.harness import run_harness
from tests.helpers.jobs import alive
from tests.helpers.tiny import FLAVOUR_ENV, FLAVOURS, make_dataset, make_net, reference_weights


def _assert_close(state: dict, reference: dict, atol: float = 1e-5) -> None:
    for key, value in reference.items():
        torch.testing.assert_close(state[key], value, atol=atol, rtol=0, msg=f"parameter {key}")


# ---------------------------------------------------------------------- in-process


def test_registered_in_fabric_registry():
    assert "heterogeneous" in STRATEGY_REGISTRY
    assert STRATEGY_REGISTRY["heterogeneous"]["strategy"] is HeterogeneousFabricStrategy
    fabric = Fabric(strategy="heterogeneous", accelerator="cpu", devices=1)
    assert isinstance(fabric.strategy, HeterogeneousFabricStrategy)
    assert lightning_het.HeterogeneousFabricStrategy is HeterogeneousFabricStrategy


def test_spawn_uses_fabrics_launcher():
    from lightning.fabric.strategies.launchers.multiprocessing import _MultiProcessingLauncher

    strategy = HeterogeneousFabricStrategy(start_method="spawn", speeds=[1, 3])
    Fabric(strategy=strategy, accelerator="cpu", devices=2)
    assert type(strategy.launcher) is _MultiProcessingLauncher


def test_registered_for_standalone_lightning_fabric():
    standalone_fabric, standalone = _standalone()
    from lightning_fabric.strategies import STRATEGY_REGISTRY as standalone_registry

    assert standalone_registry["heterogeneous"]["strategy"] is standalone
    fabric = standalone_fabric(strategy="heterogeneous", accelerator="cpu", devices=1)
    assert isinstance(fabric.strategy, standalone)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param({"emulate_slowdown": [1.0]}, "need the Trainer", id="trainer-only-emulate"),
        pytest.param({"rebalance_threshold": 1.2}, "need the Trainer", id="trainer-only-rebalance"),
        pytest.param({"preemption_grace": 5.0}, "need the Trainer", id="trainer-only-preemption"),
        pytest.param(
            {"max_micro_batch_sizes": [4]}, r"need the Trainer.*micro_batches\(batch, cap\)", id="trainer-only-micro"
        ),
        pytest.param({"profile_step": print}, "unexpected keyword argument `profile_step`", id="profile-step-gone"),
        pytest.param({"comm": "ring"}, "comm", id="comm-unknown"),
        pytest.param({"speeds": [1.0, float("nan")]}, "speeds", id="speeds-nan"),
        pytest.param({"global_batch_size": 0}, "global_batch_size", id="global-batch-size-zero"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        HeterogeneousFabricStrategy(**kwargs)


def _standalone():
    """``lightning_fabric.Fabric`` and the strategy class registered for it."""
    lightning_fabric = pytest.importorskip("lightning_fabric")
    from lightning_het._fabric_compat import HeterogeneousFabricStrategy as Standalone

    return lightning_fabric.Fabric, Standalone


def _one_replica(fabric_cls=Fabric, strategy_cls=HeterogeneousFabricStrategy, **strategy_kwargs):
    strategy = strategy_cls(process_group_backend="gloo", **strategy_kwargs)
    fabric = fabric_cls(accelerator="cpu", devices=1, strategy=strategy)
    fabric.launch()
    net = make_net()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9))
    return fabric, strategy, net, model, optimizer


@pytest.mark.parametrize("package", ["lightning.fabric", "lightning_fabric"])
def test_one_replica_trains_like_one_process_without_profiling(package):
    classes = _standalone() if package == "lightning_fabric" else (Fabric, HeterogeneousFabricStrategy)
    fabric, strategy, net, model, optimizer = _one_replica(*classes, global_batch_size=12)
    dataset = make_dataset(60)
    loader = fabric.setup_dataloaders(DataLoader(dataset, batch_size=5, shuffle=True))
    assert not strategy.profiling and strategy.cost_model is None  # nothing to balance
    assert strategy.batch_sizes == [12] and strategy.loss_scale == 1.0 and strategy.speeds == [1.0]
    assert isinstance(loader.sampler, ProportionalDistributedSampler)
    for _ in range(2):
        for x, y in loader:
            optimizer.zero_grad()
            fabric.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
    _assert_close(net.state_dict(), reference_weights(dataset, 12, epochs=2, seed=0))
    assert "global batch 12" in strategy.balance_table()


def test_eval_sampler_and_loaders_left_alone():
    fabric, strategy, *_ = _one_replica(speeds=[1.0])
    dataset = make_dataset(7)
    val = fabric.setup_dataloaders(DataLoader(dataset, batch_size=3, sampler=strategy.eval_sampler(dataset)))
    assert isinstance(val.sampler, UnpaddedDistributedSampler) and sum(len(x) for x, _ in val) == 7
    plain = fabric.setup_dataloaders(DataLoader(dataset, batch_size=3), use_distributed_sampler=False)
    assert sum(len(x) for x, _ in plain) == 7


def test_any_sampler_is_cut_into_global_batches():
    """A WeightedRandomSampler (which Fabric wraps in its DistributedSamplerWrapper) gives the global batches' order."""
    fabric, *_ = _one_replica(speeds=[1.0], global_batch_size=6)
    dataset = make_dataset(30)
    weights = torch.zeros(30)
    weights[:10] = 1.0  # only the first ten samples can be drawn
    sampler = torch.utils.data.WeightedRandomSampler(weights, num_samples=24, replacement=True)
    loader = fabric.setup_dataloaders(DataLoader(dataset, batch_size=3, sampler=sampler))
    batches = [x for x, _ in loader]
    assert [len(x) for x in batches] == [6] * 4
    drawn = torch.cat(batches)
    assert all(any(torch.equal(row, dataset.tensors[0][i]) for i in range(10)) for row in drawn)


def test_a_second_training_split_is_refused():
    fabric, strategy, *_ = _one_replica(speeds=[1.0])
    fabric.setup_dataloaders(DataLoader(make_dataset(20), batch_size=4, shuffle=True))
    with pytest.raises(ValueError, match="eval_sampler"):
        fabric.setup_dataloaders(DataLoader(make_dataset(9), batch_size=8))
    assert strategy.batch_sizes == [4]


# ---------------------------------------------------------------------- three replicas


#: the three-replica training loops of this module, run in one job (one launch and rendezvous instead of three)
THREE_REPLICA_LOOPS = {
    # speeds 1:2:3 -> batches 2/4/6 of 12
    "exact": {"strategy": {"speeds": [1, 2, 3], "global_batch_size": 12, "comm": "allreduce"}},
    # no speeds: the loop's first steps profile; rank 2 pays 3x the per-sample cost in its steps; the training loader
    # is set up before the model
    "profiled": {
        "strategy": {"global_batch_size": 35, "comm": "hierarchical", "node_ids": [0, 0, 1], "profile_steps": 3},
        "cost_per_sample_s": 0.005,
        "slow_rank": 2,
        "slow_factor": 3.0,
        "n": 280,
        "loader_first": True,
    },
    # the same job again: every replica finds its cost in the speed cache, nothing is profiled
    "cached": {
        "strategy": {"global_batch_size": 35, "comm": "hierarchical", "node_ids": [0, 0, 1]},
        "n": 280,
    },
    # comm='node_local' over nodes [0, 0, 1], K=2, one epoch
    "node_local": {
        "strategy": {
            "speeds": [1, 2, 3],
            "global_batch_size": 12,
            "comm": "node_local",
            "node_ids": [0, 0, 1],
            "global_sync_every": 2,
        },
        "epochs": 1,
    },
}


@pytest.fixture(scope="module")
def three_replicas(tmp_path_factory) -> dict[str, list[dict]]:
    """Each loop of :data:`THREE_REPLICA_LOOPS`: its per-rank dumps."""
    out = tmp_path_factory.mktemp("three_replicas")
    loops = [{**loop, "strategy": dict(loop["strategy"])} for loop in THREE_REPLICA_LOOPS.values()]
    for loop in loops:
        loop["strategy"].setdefault("profile_cache", str(out / "cache"))  # shared by "profiled" and "cached"
    result = run_harness("fabric", out, loops, limit=360)
    assert result.returncode == 0, result.output[-6000:]
    return {
        name: [torch.load(out / str(index) / f"rank{r}.pt") for r in range(3)]
        for index, name in enumerate(THREE_REPLICA_LOOPS)
    }


@pytest.mark.slow
def test_three_replicas_equal_one_process(three_replicas):
    """speeds 1:2:3 -> batches 2/4/6 of 12; the loop's parameters equal one process on the global batches."""
    dumps = three_replicas["exact"]
    reference = reference_weights(make_dataset(60), 12, epochs=2, seed=0)
    for rank, dump in enumerate(dumps):
        assert dump["batch_sizes"] == [2, 4, 6]
        assert dump["seen_batch_sizes"] == [[2, 4, 6][rank]] * 10  # 5 equal steps per epoch on every rank
        assert dump["loss_scale"] == pytest.approx(3 * [2, 4, 6][rank] / 12)
        _assert_close(dump["state_dict"], reference)


@pytest.mark.slow
def test_profiling_sees_a_three_times_slower_replica_hierarchical_exact(three_replicas):
    """No ``speeds``: the loop's first steps run under trial splits and are timed. Rank 2 pays 3x the per-sample cost
    in its steps: its measured speed is about a third, its batch about a seventh of the global one (1:1:1/3); with
    comm='hierarchical' over nodes [0, 0, 1] training stays exact, the trial steps included.

    The cost is a sleep long next to a step's compute (~75 ms per step at the balanced split), so that scheduling
    noise on a loaded machine cannot skew the ratio."""
    dumps = three_replicas["profiled"]
    speeds = dumps[0]["speeds"]
    assert all(d["speeds"] == speeds and d["batch_sizes"] == dumps[0]["batch_sizes"] for d in dumps)
    ratio = (speeds[0] + speeds[1]) / 2 / speeds[2]
    assert 2.2 < ratio < 4.0, speeds
    assert dumps[0]["batch_sizes"][2] < min(dumps[0]["batch_sizes"][:2]), dumps[0]["batch_sizes"]
    assert dumps[0]["comm_mode"] == "hierarchical"
    # a warm-up step, 2 x 3 trial steps, then the fitted split (a plain loop fetches no batch ahead): 16 steps in all
    seen = [d["seen_batch_sizes"] for d in dumps]
    assert all(len(s) == 16 for s in seen) and all(sum(step) == 35 for step in zip(*seen))
    assert seen[0][:7] != [seen[0][8]] * 7  # trial splits
    for rank, dump in enumerate(dumps):
        assert seen[rank][7:] == [dump["batch_sizes"][rank]] * 9
    reference = reference_weights(make_dataset(280), 35, epochs=2, seed=0)
    for dump in dumps:
        _assert_close(dump["state_dict"], reference)


@pytest.mark.slow
def test_speed_cache_skips_profiling_the_second_time(three_replicas):
    profiled, cached = three_replicas["profiled"], three_replicas["cached"]
    assert not any(d["profile_cached"] for d in profiled) and all(d["profile_cached"] for d in cached)
    # (the replicas share one cache key here: same model, data and device; the sleep of rank 2 is not part of it)
    for rank, dump in enumerate(cached):
        assert dump["batch_sizes"] == cached[0]["batch_sizes"] and sum(dump["batch_sizes"]) == 35
        assert dump["seen_batch_sizes"] == [dump["batch_sizes"][rank]] * 16  # no trial split
        _assert_close(dump["state_dict"], reference_weights(make_dataset(280), 35, epochs=2, seed=0))


@pytest.mark.slow
def test_node_local_reaches_consensus(three_replicas):
    """comm='node_local' over nodes [0, 0, 1], K=2: averages after steps 2 and 4 and after the epoch's last step (5);
    the replicas end on one model, which is not the exact algorithm's."""
    dumps = three_replicas["node_local"]
    assert dumps[0]["comm_mode"] == "node_local"
    assert dumps[0]["comm_stats"]["steps"] == 5 and dumps[0]["comm_stats"]["global_syncs"] == 3
    for dump in dumps[1:]:
        _assert_close(dump["state_dict"], dumps[0]["state_dict"], atol=1e-6)
    reference = reference_weights(make_dataset(60), 12, epochs=1, seed=0)
    drift = max((dumps[0]["state_dict"][k] - v).abs().max().item() for k, v in reference.items())
    assert drift > 1e-6  # node-local steps are not the exact algorithm


# ---------------------------------------------------------------------- the documented example


def _documented_example() -> str:
    text = (REPO / "docs" / "fabric.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    complete = [b for b in blocks if 'if __name__ == "__main__":' in b]
    assert len(complete) == 1, "docs/fabric.md must hold exactly one complete example"
    return complete[0]


@pytest.mark.slow
def test_documented_example_runs_as_written(tmp_path):
    script = tmp_path / "train_fabric.py"
    script.write_text(_documented_example())
    result = run_job([str(script)], cwd=tmp_path, timeout=420)
    assert result.returncode == 0, result.stdout[-6000:]
    assert "validation MSE" in result.stdout, result.stdout[-3000:]


# ---------------------------------------------------------------------- lifecycle
@pytest.mark.parametrize("package", ["lightning.fabric", "lightning_fabric"])
def test_popen_launcher_starts_replicas_that_cannot_outlive_it(package):
    fabric_cls, strategy_cls = _standalone() if package == "lightning_fabric" else (Fabric, HeterogeneousFabricStrategy)
    from lightning_het.reliability.launch import ScriptLauncher

    launcher = fabric_cls(accelerator="cpu", devices=2, strategy=strategy_cls())._strategy.launcher
    assert isinstance(launcher, ScriptLauncher) and not launcher.is_interactive_compatible
    assert launcher.strategy is not None and launcher.num_processes == 2


@pytest.mark.slow
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_a_replica_that_hangs_does_not_outlive_the_job(tmp_path, flavour):
    """Replica 1 hangs in the loop: replica 0's all-reduce times out after `timeout`, its process ends (Fabric raises
    in your loop), and the hung replica ends with it instead of running on; on both Fabric packages."""
    if flavour != "lightning":
        pytest.importorskip(flavour)
    timeout = 10
    cfg = {"devices": 2, "epochs": 1, "strategy": {"speeds": [1, 1], "timeout": timeout}}
    cfg["fault"] = {"rank": 1, "step": 2}
    result = run_harness("fabric", tmp_path, cfg, limit=180, env={FLAVOUR_ENV: flavour})
    assert (tmp_path / "fault.json").exists(), result.output[-3000:]
    fault = json.loads((tmp_path / "fault.json").read_text())
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
    print(f"{flavour}: status {result.returncode}, job ended {result.ended - fault['time']:.1f} s after the fault")
    assert result.returncode != 0 and result.survivors == [] and alive(pids) == [], result.output[-3000:]
    assert result.ended - fault["time"] < timeout + 30, result.output[-3000:]
    assert "replica(s) [1] still ran when the launching process ended; killed them" in result.output


class _ShowingController:
    """Stands for a ``node_local`` controller: shows a zero "consensus" and gives the own weights back."""

    def __init__(self, params) -> None:
        self.params, self.own = list(params), None

    def sync(self) -> bool:
        raise AssertionError("a save must not sync the replicas (with an outer optimizer, that is an extra step)")

    def show_consensus(self) -> None:
        self.own = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for p in self.params:
                p.zero_()

    def hide_consensus(self) -> None:
        with torch.no_grad():
            for p, own in zip(self.params, self.own or []):
                p.copy_(own)


def test_node_local_save_holds_the_consensus_and_leaves_the_model(tmp_path):
    """``fabric.save`` under ``comm="node_local"`` writes the consensus model without a sync and leaves each replica's
    own model as it was (watching the model does not change its trajectory)."""
    strategy = HeterogeneousFabricStrategy()
    model = torch.nn.Linear(3, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    strategy._ddp_model = SimpleNamespace(module=model)
    strategy.comm_algorithm = _ShowingController(model.parameters())
    strategy.save_checkpoint(tmp_path / "ckpt.pt", {"model": model})
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)["model"]
    assert all(not v.any() for v in saved.values())  # the consensus
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())  # the model's own weights
