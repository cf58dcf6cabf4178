"""Node topology: which global ranks share a machine, and the process groups built from that.

A *node* is a set of replicas that can talk to each other cheaply (shared memory, NVLink, loopback), as opposed to
the slower network between nodes. Node ids are small integers ``0..N-1`` indexed by global rank, numbered in order of
first appearance (the node of rank 0 is node 0). Ranks need not be contiguous per node (``[0, 1, 0, 1]`` is fine) and
nodes may hold different numbers of replicas (``[0, 0, 0, 1]``).

The pure functions (:func:`node_ids_from_ranks`, :func:`validate_node_ids`, :func:`node_members`) never communicate;
:func:`gather_node_ids` and :func:`build_node_groups` are collectives that every rank must call, in the same order.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch.distributed as dist

from lightning_het.cluster.rendezvous import local_sockets

__all__ = [
    "NodeGroups",
    "build_node_groups",
    "describe_topology",
    "gather_node_ids",
    "node_ids_from_ranks",
    "node_members",
    "validate_node_ids",
]

log = logging.getLogger(__name__)


@runtime_checkable
class _HasNodeRank(Protocol):
    """What :func:`gather_node_ids` needs from a Lightning ``ClusterEnvironment``."""

    def node_rank(self) -> int: ...


def _normalise(keys: Sequence[Any]) -> list[int]:
    """Map arbitrary hashable labels to ``0..N-1`` in order of first appearance."""
    index: dict[Any, int] = {}
    return [index.setdefault(key, len(index)) for key in keys]


def node_ids_from_ranks(node_ranks: Sequence[int], hostnames: Sequence[str]) -> list[int]:
    """Node id of every global rank, from each rank's launcher node rank and host name.

    The node rank (Lightning's ``ClusterEnvironment.node_rank()``, e.g. ``NODE_RANK`` / ``SLURM_NODEID`` /
    ``GROUP_RANK``) is primary: ranks with different node ranks are always on different nodes, even on one host, so
    two launchers started with ``NODE_RANK=0`` and ``NODE_RANK=1`` on one machine form two nodes (how multi-node jobs
    are emulated and tested). Host names only *refine* that: ranks that report the same node rank from different
    hosts cannot share memory, so they are split into separate nodes (this catches launchers that leave
    ``NODE_RANK`` unset, i.e. 0, everywhere). Host names never merge different node ranks.

    Args:
        node_ranks: node rank reported by each global rank, indexed by global rank.
        hostnames: host name reported by each global rank, same length.

    Returns:
        Node ids ``0..N-1`` indexed by global rank, in order of first appearance.

    Raises:
        ValueError: if the two sequences differ in length or are empty.

    >>> node_ids_from_ranks([0, 0, 1, 1], ["a", "a", "a", "a"])
    [0, 0, 1, 1]
    >>> node_ids_from_ranks([1, 0, 1, 0], ["a", "a", "a", "a"])
    [0, 1, 0, 1]
    >>> node_ids_from_ranks([0, 0, 0], ["a", "b", "a"])
    [0, 1, 0]
    """
    if len(node_ranks) != len(hostnames) or not node_ranks:
        raise ValueError(
            f"Expected `node_ranks` and `hostnames` to have the same non-zero length, but got {len(node_ranks)} and"
            f" {len(hostnames)}."
        )
    return _normalise(list(zip((int(n) for n in node_ranks), hostnames)))


def validate_node_ids(node_ids: Sequence[int], world_size: int) -> list[int]:
    """Check a user-given ``node_ids`` override and normalise it to ``0..N-1`` in order of first appearance.

    Args:
        node_ids: node label of each global rank (any integers; equal labels mean the same node).
        world_size: number of replicas in the job.

    Returns:
        The normalised node ids, e.g. ``[5, 5, 2]`` becomes ``[0, 0, 1]``.

    Raises:
        ValueError: naming ``node_ids``, if it is not a sequence of integers of length ``world_size``.

    >>> validate_node_ids([5, 5, 2], 3)
    [0, 0, 1]
    """
    if isinstance(node_ids, (str, bytes)) or not isinstance(node_ids, Sequence):
        raise ValueError(f"Expected argument `node_ids` to be a sequence of integers, but got {node_ids!r}.")
    values = list(node_ids)
    if len(values) != world_size:
        raise ValueError(
            f"Expected argument `node_ids` to have one entry per replica (world size {world_size}), but got"
            f" {len(values)} entries: {values}. HINT: list the node id of every global rank, e.g."
            f" {[r * 2 // max(world_size, 1) for r in range(world_size)]} for two nodes."
        )
    for rank, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(
                f"Expected argument `node_ids` to hold integers, but `node_ids[{rank}]` is {value!r}"
                f" (node_ids={values})."
            )
    return _normalise(values)


def node_members(node_ids: Sequence[int]) -> list[list[int]]:
    """Global ranks of each node, ascending, for normalised node ids.

    >>> node_members([0, 1, 0, 1])
    [[0, 2], [1, 3]]
    """
    members: list[list[int]] = [[] for _ in range(max(node_ids) + 1)]
    for rank, node in enumerate(node_ids):
        members[node].append(rank)
    return members


def describe_topology(node_ids: Sequence[int]) -> str:
    """One line for the logs, e.g. ``2 nodes: node 0 = ranks [0, 2], node 1 = ranks [1, 3]``."""
    members = node_members(node_ids)
    nodes = ", ".join(f"node {n} = ranks {m}" for n, m in enumerate(members))
    return f"{len(members)} node{'s' if len(members) != 1 else ''}: {nodes}"


def gather_node_ids(
    source: _HasNodeRank | int,
    *,
    hostname: str | None = None,
    group: dist.ProcessGroup | None = None,
) -> list[int]:
    """Detect the node of every rank with one ``all_gather_object`` of ``(node_rank, hostname)``.

    Collective: every rank of ``group`` (default: WORLD) must call it. See :func:`node_ids_from_ranks` for how node
    ranks and host names combine.

    Args:
        source: a Lightning ``ClusterEnvironment`` (its ``node_rank()`` is used) or this rank's node rank.
        hostname: this rank's host name; defaults to :func:`socket.gethostname`.
        group: process group to gather over; ``None`` means WORLD.

    Returns:
        Node ids ``0..N-1`` indexed by rank in ``group``; identical on every rank.
    """
    node_rank = int(source.node_rank()) if isinstance(source, _HasNodeRank) else int(source)
    host = socket.gethostname() if hostname is None else hostname
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (node_rank, host), group=group)
    return node_ids_from_ranks([g[0] for g in gathered], [g[1] for g in gathered])


@dataclass(frozen=True)
class NodeGroups:
    """Process groups of a two-level (intra-node / between-node) topology, as seen from one rank.

    The leader of a node is its lowest global rank. ``intra_group`` and ``intra_bcast_group`` contain the same ranks
    (this rank's node); two groups exist so that a pipelined hierarchical reduction can run its *reduce* and its
    *broadcast* stages concurrently, each group seeing its collectives in the same order on every rank.
    ``leader_group`` holds one rank per node and is ``None`` on ranks that are not leaders.

    Not picklable (it holds process groups): build it in the worker, after ``init_process_group``.
    """

    node_ids: tuple[int, ...]
    rank: int
    members: tuple[tuple[int, ...], ...]
    intra_group: dist.ProcessGroup
    intra_bcast_group: dist.ProcessGroup
    leader_group: dist.ProcessGroup | None

    @property
    def world_size(self) -> int:
        """Number of replicas in the job."""
        return len(self.node_ids)

    @property
    def num_nodes(self) -> int:
        """Number of nodes ``N``."""
        return len(self.members)

    @property
    def node_id(self) -> int:
        """This rank's node."""
        return self.node_ids[self.rank]

    @property
    def node_ranks(self) -> tuple[int, ...]:
        """Global ranks of this rank's node, ascending."""
        return self.members[self.node_id]

    @property
    def node_size(self) -> int:
        """Replicas on this rank's node."""
        return len(self.node_ranks)

    @property
    def leader(self) -> int:
        """Global rank of this node's leader (its lowest rank)."""
        return self.node_ranks[0]

    @property
    def leaders(self) -> tuple[int, ...]:
        """Global rank of every node's leader, in node order (ascending ranks)."""
        return tuple(m[0] for m in self.members)

    @property
    def is_leader(self) -> bool:
        """Whether this rank leads its node."""
        return self.rank == self.leader


def build_node_groups(node_ids: Sequence[int], rank: int) -> NodeGroups:
    """Create the intra-node and leader process groups.

    Collective: every rank of WORLD must call it with the same ``node_ids``. Groups are created in a fixed order on
    every rank (intra-node groups, their broadcast twins, then the leader group), as ``torch.distributed`` requires.
    Uses :func:`torch.distributed.new_subgroups_by_enumeration`, so nodes of unequal size work (unlike
    ``new_subgroups(group_size=...)``).

    Args:
        node_ids: node of every global rank (validated and normalised here).
        rank: this process's global rank.

    Returns:
        The groups as seen from ``rank``.
    """
    ids = validate_node_ids(node_ids, dist.get_world_size())
    members = node_members(ids)
    leaders = [m[0] for m in members]
    with local_sockets(len(members)):
        intra, _ = dist.new_subgroups_by_enumeration(members)
        intra_bcast, _ = dist.new_subgroups_by_enumeration(members)
        leader_group = dist.new_group(ranks=leaders)
    groups = NodeGroups(
        node_ids=tuple(ids),
        rank=rank,
        members=tuple(tuple(m) for m in members),
        intra_group=intra,
        intra_bcast_group=intra_bcast,
        leader_group=leader_group if rank in leaders else None,
    )
    if rank == 0:
        log.info("lightning-het topology: %s; leaders %s", describe_topology(ids), leaders)
    return groups
