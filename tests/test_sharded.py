"""``HeterogeneousFSDPStrategy``: FSDP2 with speed-proportional shares trains exactly what one process trains on the
global batch (the tail, micro-batches under a cap, a rebalance, full and hybrid meshes), on CPU replicas over gloo."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry

from lightning_het import HeterogeneousFSDPStrategy
from lightning_het.arguments import ArgumentError
from lightning_het.sharded import hybrid_groups
from tests.helpers.harness import load_dumps, run_harness, split_output
from tests.helpers.tiny import make_dataset, make_net, reference_weights

#: the 3-replica fits: speeds [1, 2, 4], a global batch of 14 over 45 samples (3 batches and a tail of 3 per epoch)
THREE = {
    "full": {
        "strategy": {"speeds": [1, 2, 4], "global_batch_size": 14, "sharding": "full"},
        "save_every": 5,
        "val_n": 41,
    },
    "micro_rebalance": {
        "strategy": {"speeds": [1, 2, 4], "global_batch_size": 14, "max_micro_batch_sizes": [1, 2, 3]},
        "rebalance_at": [1, [4, 4, 6]],
    },
    "own_configure_model": {"strategy": {"speeds": [1, 2, 4], "global_batch_size": 14}, "shard_in_module": True},
    "accumulate": {"strategy": {"speeds": [1, 2, 4], "global_batch_size": 14}, "accumulate": 2},
}
#: the 4-replica fits: 2 emulated nodes x 2 replicas, 46 samples (3 batches and a tail of 4 per epoch)
FOUR = {
    "hybrid": {"strategy": {"speeds": [1, 2, 4, 1], "node_ids": [0, 0, 1, 1], "global_batch_size": 14}},
    "hybrid_micro": {
        "strategy": {
            "speeds": [1, 2, 4, 1],
            "node_ids": [0, 0, 1, 1],
            "global_batch_size": 14,
            "sharding": "hybrid",
            "max_micro_batch_sizes": [2, 1, 3, 2],
        },
    },
}


#: the checkpoint the "full" fit saves in the middle of its second epoch (a folder: each replica's shards)
CHECKPOINT = "0/ckpt/step=5.ckpt"


def _jobs(tmp_path, devices: int, n: int, fits: dict[str, dict]) -> dict[str, tuple[list[dict], str]]:
    cfgs = [{"devices": devices, "n": n, **cfg} for cfg in fits.values()]
    job = run_harness("sharded", tmp_path, cfgs, limit=400)
    assert job.returncode == 0, job.output[-6000:]
    outputs = split_output(job.output, len(cfgs))
    return {name: (load_dumps(tmp_path / str(i), devices), outputs[i]) for i, name in enumerate(fits)}


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    out = tmp_path_factory.mktemp("three")
    resumed = {"strategy": {"speeds": [1, 2, 4]}, "resume": str(out / CHECKPOINT)}  # the run it was saved in, resumed
    return {**_jobs(out, 3, 45, {**THREE, "resumed": resumed}), "out": out}


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return _jobs(tmp_path_factory.mktemp("four"), 4, 46, FOUR)


def _max_diff(dumps: list[dict], n: int, accumulate: int = 1) -> float:
    reference = reference_weights(make_dataset(n), 14, epochs=2, seed=0, accumulate=accumulate)
    diff = max((d["state_dict"][k] - reference[k]).abs().max().item() for d in dumps for k in reference)
    print(f"largest weight difference from one process: {diff:.2e}")  # what docs/sharded.md quotes
    return diff


def test_full_sharding_trains_the_global_batch_with_its_tail(three):
    dumps, _ = three["full"]
    assert [d["seen_batch_sizes"] for d in dumps] == [[2, 2, 2, 1] * 2, [4, 4, 4, 1] * 2, [8, 8, 8, 1] * 2]
    assert all(d["mesh"] == [3] and d["global_step"] == 8 for d in dumps)
    assert _max_diff(dumps, 45) < 1e-5


def test_uneven_evaluation_sees_every_sample_once(three):
    """Each replica evaluates its share of 41 samples (as many batches everywhere: each forward is a collective); the
    metric is the whole set's, with the final weights."""
    dumps, _ = three["full"]
    assert sum(d["val_seen"] for d in dumps) == 41 * 2 and len({d["val_seen"] for d in dumps}) == 3  # 2 epochs
    net, data = make_net(), make_dataset(41, seed=99)
    net.load_state_dict(dumps[0]["state_dict"])
    with torch.no_grad():
        expected = torch.nn.functional.mse_loss(net(data.tensors[0]), data.tensors[1]).item()
    assert all(d["val_mse"] == pytest.approx(expected, rel=1e-5) for d in dumps)


def test_micro_batches_under_a_cap_and_across_a_rebalance(three):
    dumps, out = three["micro_rebalance"]
    assert "3x2+2x1" in out  # rank 2's share of 8 in pieces of at most 3
    assert [d["seen_batch_sizes"][4:] for d in dumps] == [[4, 4, 4, 1], [4, 4, 4, 1], [6, 6, 6, 1]]
    assert _max_diff(dumps, 45) < 1e-5


def test_balance_table_shows_each_replicas_shards(three):
    dumps, _ = three["full"]
    numel = sum(v.numel() for v in dumps[0]["state_dict"].values())  # the network: 49 parameters, float32
    memory = dumps[0]["report"]["memory"]
    assert all(d["report"]["memory"] == memory for d in dumps) and len(memory) == 3
    for kind in ("params", "grads", "optimizer"):  # SGD with momentum: one buffer per parameter
        assert sum(m[kind] for m in memory) == 4 * numel and max(m[kind] for m in memory) < 4 * numel
    assert "rank params MiB grads MiB optim MiB" in dumps[0]["table"]


def test_gradient_accumulation_syncs_once_per_optimizer_step(three):
    dumps, _ = three["accumulate"]
    assert all(d["global_step"] == 4 for d in dumps)  # 4 global batches per epoch, 2 per optimizer step
    assert _max_diff(dumps, 45, accumulate=2) < 1e-5


def test_a_model_sharded_by_its_own_configure_model(three):
    dumps, _ = three["own_configure_model"]
    assert _max_diff(dumps, 45) < 1e-5


def test_sharded_checkpoint_resumes_to_the_uninterrupted_weights(three, tmp_path):
    assert sorted(p.name for p in (three["out"] / CHECKPOINT).iterdir())[-1] == "meta.pt"  # DCP: a folder of shards
    full = three["full"][0][0]["state_dict"]
    resumed, out = three["resumed"]
    assert "skips the 1 global batch(es) already trained on" in out  # the sampler's place rode along
    assert [d["seen_batch_sizes"] for d in resumed] == [[2, 2, 1], [4, 4, 1], [8, 8, 1]]
    assert max((d["state_dict"][k] - full[k]).abs().max().item() for d in resumed for k in full) <= 1e-6
    cfg = {"devices": 2, "strategy": {"speeds": [1, 3]}, "resume": str(three["out"] / CHECKPOINT)}
    job = run_harness("sharded", tmp_path, cfg, limit=300)  # on another number of replicas: the global batch kept
    assert job.returncode == 0, job.output[-6000:]
    dumps = load_dumps(tmp_path, 2)
    assert [d["seen_batch_sizes"] for d in dumps] == [[4, 4, 1], [10, 10, 2]]
    assert max((d["state_dict"][k] - full[k]).abs().max().item() for d in dumps for k in full) <= 1e-6


@pytest.mark.parametrize("fit", list(FOUR))
def test_hybrid_sharding_replicates_across_nodes(four, fit):
    dumps, _ = four[fit]
    assert all(d["mesh"] == [2, 2] for d in dumps)  # 2 nodes (replicate) x 2 replicas (shard)
    assert [d["seen_batch_sizes"][:4] for d in dumps] == [[2, 2, 2, 1], [3, 3, 3, 1], [7, 7, 7, 1], [2, 2, 2, 1]]
    assert _max_diff(dumps, 46) < 1e-5


def test_registered_and_keywords_checked():
    assert StrategyRegistry["heterogeneous_fsdp"]["strategy"] is HeterogeneousFSDPStrategy
    with pytest.raises(ArgumentError, match="sharding"):
        HeterogeneousFSDPStrategy(sharding="zero3")
    with pytest.raises(ArgumentError, match="comm"):
        HeterogeneousFSDPStrategy(comm="node_local")
    with pytest.raises(ArgumentError, match="broadcast_buffers"):
        HeterogeneousFSDPStrategy(broadcast_buffers=False)
    strategy = HeterogeneousFSDPStrategy(speeds=[1, 2], save_distributed_checkpoint=False, process_group_backend="gloo")
    assert strategy.config.speeds == [1.0, 2.0]
    with pytest.raises(RuntimeError, match="shard mesh"):
        strategy.shard_mesh  # noqa: B018


def test_memory_of_the_shards():
    from lightning_het.sharded import sharded_memory

    net = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(net.parameters())
    net(torch.ones(1, 3)).sum().backward()
    opt.step()
    assert sharded_memory(net, [opt]) == {"params": 32, "grads": 32, "optimizer": 64 + 8}


def test_app_config_builds_the_sharded_strategy(tmp_path):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from lightning_het.app import config_dir
    from lightning_het.app.build import build_trainer
    from lightning_het.app.config import register_configs, validate_config

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(config_dir()), version_base="1.3"):
        overrides = [
            "experiment=quick",
            "strategy=heterogeneous_fsdp",
            "strategy.speeds=[1,3]",
            f"output_dir={tmp_path}",
        ]
        cfg = compose("train", overrides=overrides)
    GlobalHydra.instance().clear()
    strategy_cfg, _ = validate_config(cfg)
    trainer = build_trainer(cfg, strategy_cfg, [])
    assert isinstance(trainer.strategy, HeterogeneousFSDPStrategy) and trainer.strategy.config.speeds == [1.0, 3.0]


def test_hybrid_sharding_refuses_uneven_nodes_before_any_replica_starts():
    with pytest.raises(
        ValueError, match=r"node_ids=\[0, 0, 1\] puts \[2, 1\] on the nodes \[0, 1\]\..*sharding='full'"
    ):
        HeterogeneousFSDPStrategy(speeds=[1, 2, 4], node_ids=[0, 0, 1], sharding="hybrid")
    assert hybrid_groups([0, 1, 0, 1]) == [[0, 2], [1, 3]]  # the mesh's rows: each node's ranks
    HeterogeneousFSDPStrategy(node_ids=[0, 0, 1], sharding="full")  # a full mesh takes any nodes
