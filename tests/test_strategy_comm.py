"""The comm modes wired into HeterogeneousStrategy, end to end through Lightning (gloo, CPU), from the default flat
all-reduce (with unpadded validation) to the node hierarchy and node-local SGD."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from lightning_het import allocate_batch_sizes
from tests.conftest import REPO, free_port, run_job
from tests.helpers import harness
from tests.helpers.harness import run_fits_job
from tests.helpers.tiny import make_dataset, reference_weights


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in b)


#: the three-replica fits of this module, run in one job (one launch and rendezvous instead of four)
THREE_REPLICA_FITS = {
    "allreduce": {"speeds": [1, 2, 3], "global_batch_size": 12},
    "interleaved": {
        "speeds": [1, 2, 3],
        "global_batch_size": 12,
        "node_ids": [0, 1, 0],
        "comm": "hierarchical",
        "comm_autotune_steps": 0,  # the node hierarchy on every step
    },
    "measured": {"speeds": [1, 2, 3], "global_batch_size": 12, "node_ids": [0, 0, 1], "comm_autotune_steps": 1},
    "node_local": {
        "speeds": [1, 2, 3],
        "global_batch_size": 12,
        "node_ids": [0, 0, 1],
        "comm": "node_local",
        "global_sync_every": 2,
    },
}


@pytest.fixture(scope="module")
def three_replicas(tmp_path_factory) -> dict[str, list[dict]]:
    """Each fit of :data:`THREE_REPLICA_FITS` (3 replicas, 2 epochs of 60 samples; the first one validates on 50
    samples after each epoch): its per-rank dumps."""
    cfgs = [{"devices": 3, "strategy": strategy, "epochs": 2, "n": 60} for strategy in THREE_REPLICA_FITS.values()]
    cfgs[0]["val_n"] = 50
    results = run_fits_job(tmp_path_factory.mktemp("three_replicas"), cfgs)
    return {name: dumps for name, (dumps, _) in zip(THREE_REPLICA_FITS, results)}


def test_three_replicas_speeds_123_exact_with_unpadded_validation(three_replicas):
    dumps = three_replicas["allreduce"]
    reference = reference_weights(make_dataset(60), 12, epochs=2, seed=0)
    for rank, dump in enumerate(dumps):
        assert dump["batch_sizes"] == [2, 4, 6]
        assert dump["seen_batch_sizes"] == [[2, 4, 6][rank]] * 10  # 60 // 12 = 5 steps x 2 epochs
        assert dump["global_step"] == 10
        assert dump["loss_scale"] == pytest.approx([0.5, 1.0, 1.5][rank])
        assert _max_diff(dump["state_dict"], reference) < 1e-5
    # validation: every sample evaluated exactly once per epoch, shares follow the allocation
    assert [d["val_seen"] for d in dumps] == [2 * n for n in allocate_batch_sizes(50, [2, 4, 6])]
    val = make_dataset(50, seed=99)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    net.load_state_dict(dumps[0]["state_dict"])
    with torch.no_grad():
        expected = torch.nn.functional.mse_loss(net(val.tensors[0]), val.tensors[1]).item()
    assert dumps[0]["val_mse"] == pytest.approx(expected, rel=1e-5)


def test_hierarchical_interleaved_nodes_exact_and_identical(three_replicas):
    dumps = three_replicas["interleaved"]
    reference = reference_weights(make_dataset(60), 12, epochs=2, seed=0)
    for dump in dumps:
        assert dump["comm_mode"] == "hierarchical"
        assert dump["comm_reduction"] == "hierarchical"
        assert dump["node_ids"] == [0, 1, 0]
        assert _max_diff(dump["state_dict"], reference) < 1e-5
        assert _max_diff(dump["state_dict"], dumps[0]["state_dict"]) == 0.0
    # rank 1 is alone on node 1: it sends nothing inside its node, only to the other leader
    assert dumps[1]["comm_stats"]["bytes_intra_per_step"] == 0
    assert dumps[1]["comm_stats"]["bytes_inter_per_step"] > 0


def test_hierarchical_measured_choice_is_agreed_and_exact(three_replicas):
    """Default-style `comm="auto"` on two nodes: steps 2-3 time flat vs hierarchy, then every rank keeps one."""
    dumps = three_replicas["measured"]
    reference = reference_weights(make_dataset(60), 12, epochs=2, seed=0)
    choices = {dump["comm_reduction"] for dump in dumps}
    assert len(choices) == 1 and choices <= {"flat", "hierarchical"}
    for dump in dumps:
        assert dump["comm_mode"] == "hierarchical"  # what "auto" resolves to over [0, 0, 1]
        assert _max_diff(dump["state_dict"], reference) < 1e-5
        assert _max_diff(dump["state_dict"], dumps[0]["state_dict"]) == 0.0


def test_node_local_differs_from_exact_but_ends_in_consensus(three_replicas):
    dumps = three_replicas["node_local"]
    reference = reference_weights(make_dataset(60), 12, epochs=2, seed=0)
    for dump in dumps:
        assert dump["comm_mode"] == "node_local"
        assert _max_diff(dump["state_dict"], dumps[0]["state_dict"]) == 0.0  # consensus at epoch end
    assert _max_diff(dumps[0]["state_dict"], reference) > 1e-3  # not silently exact training
    stats = dumps[0]["comm_stats"]
    assert stats["global_syncs"] >= 4  # every 2 of 5 steps per epoch, plus each epoch end


def test_two_launchers_with_node_rank_are_two_nodes(tmp_path):
    """Two launchers on one machine, NODE_RANK=0/1, num_nodes=2, one device each: detected as two nodes."""
    port = str(free_port())
    cfg = {"devices": 1, "num_nodes": 2, "strategy": {"speeds": [1, 3]}, "epochs": 1}
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "NODE_RANK": "1", "PYTHONPATH": str(REPO)}
    second = subprocess.Popen(
        [sys.executable, *harness.command("tiny", tmp_path, cfg)],
        cwd=REPO,
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        first = run_job(
            harness.command("tiny", tmp_path, cfg),
            env={"MASTER_PORT": port, "NODE_RANK": "0"},
            timeout=150,
        )
        assert first.returncode == 0, first.stdout[-4000:]
        assert second.wait(timeout=60) == 0
    finally:
        if second.poll() is None:
            second.kill()
            second.wait()
    dumps = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert [d["node_ids"] for d in dumps] == [[0, 1], [0, 1]]
    assert dumps[0]["comm_mode"] == "allreduce"  # auto: one replica per node is a flat all-reduce
    assert dumps[0]["batch_sizes"] == [2, 6]  # loader batch 4 x 2 replicas, split 1:3
