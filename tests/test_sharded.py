"""``HeterogeneousFSDPStrategy``: FSDP2 with speed-proportional shares trains exactly what one process trains on the
global batch (the tail, micro-batches under a cap, a rebalance, full and hybrid meshes), on CPU replicas over gloo."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry

from lightning_het import HeterogeneousFSDPStrategy
from lightning_het.arguments import ArgumentError
from tests.helpers.harness import load_dumps, run_harness, split_output
from tests.helpers.tiny import make_dataset, reference_weights

#: the 3-replica fits: speeds [1, 2, 4], a global batch of 14 over 45 samples (3 batches and a tail of 3 per epoch)
THREE = {
    "full": {"strategy": {"speeds": [1, 2, 4], "global_batch_size": 14, "sharding": "full"}},
    "micro_rebalance": {
        "strategy": {"speeds": [1, 2, 4], "global_batch_size": 14, "max_micro_batch_sizes": [1, 2, 3]},
        "rebalance_at": [1, [4, 4, 6]],
    },
    "own_configure_model": {"strategy": {"speeds": [1, 2, 4], "global_batch_size": 14}, "shard_in_module": True},
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


def _jobs(tmp_path, devices: int, n: int, fits: dict[str, dict]) -> dict[str, tuple[list[dict], str]]:
    cfgs = [{"devices": devices, "n": n, **cfg} for cfg in fits.values()]
    job = run_harness("sharded", tmp_path, cfgs, limit=400)
    assert job.returncode == 0, job.output[-6000:]
    outputs = split_output(job.output, len(cfgs))
    return {name: (load_dumps(tmp_path / str(i), devices), outputs[i]) for i, name in enumerate(fits)}


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    return _jobs(tmp_path_factory.mktemp("three"), 3, 45, THREE)


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return _jobs(tmp_path_factory.mktemp("four"), 4, 46, FOUR)


def _max_diff(dumps: list[dict], n: int) -> float:
    reference = reference_weights(make_dataset(n), 14, epochs=2, seed=0)
    return max((d["state_dict"][k] - reference[k]).abs().max().item() for d in dumps for k in reference)


def test_full_sharding_trains_the_global_batch_with_its_tail(three):
    dumps, _ = three["full"]
    assert [d["seen_batch_sizes"] for d in dumps] == [[2, 2, 2, 1] * 2, [4, 4, 4, 1] * 2, [8, 8, 8, 1] * 2]
    assert all(d["mesh"] == [3] and d["global_step"] == 8 for d in dumps)
    assert _max_diff(dumps, 45) < 1e-5


def test_micro_batches_under_a_cap_and_across_a_rebalance(three):
    dumps, out = three["micro_rebalance"]
    assert "3x2+2x1" in out  # rank 2's share of 8 in pieces of at most 3
    assert [d["seen_batch_sizes"][4:] for d in dumps] == [[4, 4, 4, 1], [4, 4, 4, 1], [6, 6, 6, 1]]
    assert _max_diff(dumps, 45) < 1e-5


def test_a_model_sharded_by_its_own_configure_model(three):
    dumps, _ = three["own_configure_model"]
    assert _max_diff(dumps, 45) < 1e-5


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
