"""Tests of lightning_het.cluster.topology: node detection, validation of the override, process groups."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_het.cluster.topology import (
    build_node_groups,
    describe_topology,
    gather_node_ids,
    node_ids_from_ranks,
    node_members,
    validate_node_ids,
)
from tests.helpers.gloo import run_gloo


# --------------------------------------------------------------------------- multi-process (gloo, fork)
def _topology_worker(rank: int, world_size: int) -> dict[str, Any]:
    from lightning.fabric.plugins.environments import LightningEnvironment

    result: dict[str, Any] = {}
    # Two launchers on one machine, NODE_RANK=0 for ranks 0-1 and NODE_RANK=1 for ranks 2-3, as Lightning sees them.
    os.environ["NODE_RANK"] = str(rank // 2)
    result["launchers"] = gather_node_ids(LightningEnvironment())
    # Node rank unset (0) everywhere, but two different hosts in interleaved rank order.
    result["hosts"] = gather_node_ids(0, hostname=f"host{rank % 2}")
    for ids in ([0, 1, 0, 1], [0, 0, 0, 1]):
        groups = build_node_groups(ids, rank)
        x = torch.tensor([float(rank)])
        dist.all_reduce(x, group=groups.intra_group)
        y = torch.tensor([float(rank)])
        dist.all_reduce(y, group=groups.intra_bcast_group)
        z = torch.tensor([1.0])
        if groups.is_leader:
            dist.all_reduce(z, group=groups.leader_group)
        result[str(ids)] = {
            "members": groups.members,
            "leader": groups.leader,
            "leaders": tuple(m[0] for m in groups.members),
            "is_leader": groups.is_leader,
            "has_leader_group": groups.leader_group is not None,
            "node_size": groups.node_size,
            "intra_sum": x.item(),
            "bcast_sum": y.item(),
            "leader_count": z.item(),
        }
    return result


@pytest.fixture(scope="module")
def gathered(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("topology")
    world_size = 4
    return run_gloo(_topology_worker, world_size, out)


# --------------------------------------------------------------------------- pure functions
class TestNodeIdsFromRanks:
    def test_two_launchers_on_one_host_are_two_nodes(self) -> None:
        assert node_ids_from_ranks([0, 0, 1, 1], ["box"] * 4) == [0, 0, 1, 1]

    def test_interleaved_and_normalised_by_first_appearance(self) -> None:
        assert node_ids_from_ranks([3, 7, 3, 7], ["box"] * 4) == [0, 1, 0, 1]

    def test_unequal_nodes(self) -> None:
        assert node_ids_from_ranks([0, 0, 0, 1], ["a", "a", "a", "b"]) == [0, 0, 0, 1]

    def test_hostnames_split_equal_node_ranks(self) -> None:
        assert node_ids_from_ranks([0, 0, 0, 0], ["a", "b", "a", "b"]) == [0, 1, 0, 1]

    def test_hostnames_never_merge_node_ranks(self) -> None:
        assert node_ids_from_ranks([0, 1], ["a", "a"]) == [0, 1]


class TestValidateNodeIds:
    def test_normalises(self) -> None:
        assert validate_node_ids([5, 5, 2, 9], 4) == [0, 0, 1, 2]

    def test_wrong_length_names_argument_and_numbers(self) -> None:
        with pytest.raises(ValueError, match=r"`node_ids`.*world size 4.*got 3 entries: \[0, 0, 1\]"):
            validate_node_ids([0, 0, 1], 4)

    @pytest.mark.parametrize("bad", [[0, 1.0], [0, "1"], [0, True]])
    def test_non_integers(self, bad: list[Any]) -> None:
        with pytest.raises(ValueError, match=r"`node_ids` to hold integers, but `node_ids\[1\]`"):
            validate_node_ids(bad, 2)

    @pytest.mark.parametrize("bad", ["0011", 3, None])
    def test_not_a_sequence(self, bad: Any) -> None:
        with pytest.raises(ValueError, match="`node_ids` to be a sequence of integers"):
            validate_node_ids(bad, 4)


def test_node_members_and_description() -> None:
    assert node_members([0, 1, 0, 1]) == [[0, 2], [1, 3]]
    assert describe_topology([0, 0, 1]) == "2 nodes: node 0 = ranks [0, 1], node 1 = ranks [2]"
    assert describe_topology([0]) == "1 node: node 0 = ranks [0]"


# --------------------------------------------------------------------------- collectives over gloo
def test_two_launchers_with_node_rank_are_two_nodes(gathered: list[dict[str, Any]]) -> None:
    for result in gathered:
        assert result["launchers"] == [0, 0, 1, 1]


def test_hostnames_detect_nodes_when_node_rank_unset(gathered: list[dict[str, Any]]) -> None:
    for result in gathered:
        assert result["hosts"] == [0, 1, 0, 1]


@pytest.mark.parametrize(
    ("ids", "members", "leaders"),
    [([0, 1, 0, 1], ((0, 2), (1, 3)), (0, 1)), ([0, 0, 0, 1], ((0, 1, 2), (3,)), (0, 3))],
)
def test_build_node_groups(
    gathered: list[dict[str, Any]], ids: list[int], members: tuple[tuple[int, ...], ...], leaders: tuple[int, ...]
) -> None:
    for rank, result in enumerate(gathered):
        info = result[str(ids)]
        node = members[ids[rank]]
        assert info["members"] == members
        assert info["leaders"] == leaders
        assert info["leader"] == node[0]
        assert info["is_leader"] == info["has_leader_group"] == (rank == node[0])
        assert info["node_size"] == len(node)
        assert info["intra_sum"] == info["bcast_sum"] == float(sum(node))
        if info["is_leader"]:
            assert info["leader_count"] == len(leaders)
