"""Node topology: which global ranks share a machine, and the process groups built from that."""

from __future__ import annotations

import logging
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from lightning_het.arguments import expect
from lightning_het.cluster.rendezvous import local_sockets

log = logging.getLogger(__name__)


def node_ids_from_ranks(node_ranks: Sequence[int], hostnames: Sequence[str]) -> list[int]:
    """Node id of every global rank: by launcher node rank first, then host name.

    >>> node_ids_from_ranks([1, 0, 1, 0], ["a", "a", "a", "a"]), node_ids_from_ranks([0, 0, 0], ["a", "b", "a"])
    ([0, 1, 0, 1], [0, 1, 0])
    """
    index: dict[Any, int] = {}  # labels as 0..N-1 in order of first appearance
    return [index.setdefault(key, len(index)) for key in zip((int(n) for n in node_ranks), hostnames)]


def validate_node_ids(node_ids: Sequence[int], world_size: int) -> list[int]:
    """A user-given ``node_ids``, checked and normalised (``[5, 5, 2]`` -> ``[0, 0, 1]``)."""
    ok = not isinstance(node_ids, (str, bytes)) and isinstance(node_ids, Sequence)
    expect(ok, "node_ids", "a sequence of integers", node_ids)
    values = list(node_ids)
    if len(values) != world_size:
        raise ValueError(f"Expected `node_ids` of world size {world_size}, but got {len(values)} entries: {values}.")
    for rank, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"Expected `node_ids` to hold integers, but `node_ids[{rank}]` is {value!r}.")
    index: dict[int, int] = {}
    return [index.setdefault(value, len(index)) for value in values]


def node_members(node_ids: Sequence[int]) -> list[list[int]]:
    """Global ranks of each node, ascending, for normalised node ids (``[0, 1, 0, 1]`` -> ``[[0, 2], [1, 3]]``)."""
    members: list[list[int]] = [[] for _ in range(max(node_ids) + 1)]
    for rank, node in enumerate(node_ids):
        members[node].append(rank)
    return members


def describe_topology(node_ids: Sequence[int]) -> str:
    """One line for the logs, e.g. ``2 nodes: node 0 = ranks [0, 2], node 1 = ranks [1, 3]``."""
    members = node_members(node_ids)
    nodes = ", ".join(f"node {n} = ranks {m}" for n, m in enumerate(members))
    return f"{len(members)} node{'s' if len(members) != 1 else ''}: {nodes}"


def gather_node_ids(source: Any, *, hostname: str | None = None, group: dist.ProcessGroup | None = None) -> list[int]:
    """Every rank's node from one all-gather of ``(node_rank, hostname)`` (``source``: a node rank or environment)."""
    node_rank = int(source.node_rank()) if hasattr(source, "node_rank") else int(source)
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (node_rank, hostname or socket.gethostname()), group=group)
    return node_ids_from_ranks([g[0] for g in gathered], [g[1] for g in gathered])


@dataclass(frozen=True)
class NodeGroups:
    """One rank's groups: two intra-node ones (concurrent reduce and broadcast), ``leader_group`` (leaders only)."""

    node_ids: tuple[int, ...]
    rank: int
    members: tuple[tuple[int, ...], ...]
    intra_group: dist.ProcessGroup
    intra_bcast_group: dist.ProcessGroup
    leader_group: dist.ProcessGroup | None

    @property
    def world_size(self) -> int:
        return len(self.node_ids)

    @property
    def num_nodes(self) -> int:
        return len(self.members)

    @property
    def node_size(self) -> int:
        return len(self.members[self.node_ids[self.rank]])

    @property
    def leader(self) -> int:
        """This node's lowest rank."""
        return self.members[self.node_ids[self.rank]][0]

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader


def build_node_groups(node_ids: Sequence[int], rank: int) -> NodeGroups:
    """Create the intra-node and leader process groups (collective, the same order on every rank)."""
    ids = validate_node_ids(node_ids, dist.get_world_size())
    members = node_members(ids)
    leaders = [m[0] for m in members]
    with local_sockets(len(members)):
        intra, _ = dist.new_subgroups_by_enumeration(members)
        intra_bcast, _ = dist.new_subgroups_by_enumeration(members)
        leader_group = dist.new_group(ranks=leaders)
    if rank == 0:
        log.info("lightning-het topology: %s; leaders %s", describe_topology(ids), leaders)
    members_t = tuple(tuple(m) for m in members)
    return NodeGroups(tuple(ids), rank, members_t, intra, intra_bcast, leader_group if rank in leaders else None)
