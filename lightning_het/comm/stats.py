"""Byte accounting: how many bytes each rank sends inside its node and between nodes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from lightning_het.cluster.topology import node_members


@dataclass
class Traffic:
    """Bytes sent by every global rank (indexed by global rank) during one collective pattern, by destination."""

    intra: list[float]  # to ranks on the sender's node
    inter: list[float]  # to ranks on other nodes

    @classmethod
    def zeros(cls, world_size: int) -> Traffic:
        return cls([0.0] * world_size, [0.0] * world_size)

    def __add__(self, other: Traffic) -> Traffic:
        intra = [a + b for a, b in zip(self.intra, other.intra)]
        return Traffic(intra, [a + b for a, b in zip(self.inter, other.inter)])

    @property
    def total_intra(self) -> float:
        """Bytes sent inside nodes, summed over the job."""
        return sum(self.intra)

    @property
    def total_inter(self) -> float:
        """Bytes sent between nodes, summed over the job."""
        return sum(self.inter)


def _send(traffic: Traffic, node_ids: Sequence[int], src: int, dst: int, nbytes: float) -> None:
    if node_ids[src] == node_ids[dst]:
        traffic.intra[src] += nbytes
    else:
        traffic.inter[src] += nbytes


def allreduce_traffic(nbytes: float, ranks: Sequence[int], node_ids: Sequence[int]) -> Traffic:
    """Ring all-reduce of ``nbytes`` over the global ``ranks`` (ring order = ascending rank).

    >>> allreduce_traffic(100, [0, 1, 2, 3], [0, 0, 1, 1])
    Traffic(intra=[150.0, 0.0, 150.0, 0.0], inter=[0.0, 150.0, 0.0, 150.0])
    """
    traffic = Traffic.zeros(len(node_ids))
    ring = sorted(ranks)
    p = len(ring)
    if p < 2:
        return traffic
    per_rank = 2.0 * (p - 1) / p * nbytes
    for i, src in enumerate(ring):
        _send(traffic, node_ids, src, ring[(i + 1) % p], per_rank)
    return traffic


def reduce_traffic(nbytes: float, ranks: Sequence[int], root: int, node_ids: Sequence[int]) -> Traffic:
    """Reduce of ``nbytes`` from ``ranks`` to ``root``: every non-root sends its ``nbytes`` once."""
    traffic = Traffic.zeros(len(node_ids))
    for src in ranks:
        if src != root:
            _send(traffic, node_ids, src, root, float(nbytes))
    return traffic


def broadcast_traffic(nbytes: float, ranks: Sequence[int], root: int, node_ids: Sequence[int]) -> Traffic:
    """Broadcast of ``nbytes`` from ``root`` to ``ranks``: the root sends one copy to every other member."""
    traffic = Traffic.zeros(len(node_ids))
    for dst in ranks:
        if dst != root:
            _send(traffic, node_ids, root, dst, float(nbytes))
    return traffic


def flat_allreduce_traffic(nbytes: float, node_ids: Sequence[int]) -> Traffic:
    """One all-reduce over all ranks (plain DDP, ``comm="allreduce"``)."""
    return allreduce_traffic(nbytes, range(len(node_ids)), node_ids)


def hierarchical_traffic(nbytes: float, node_ids: Sequence[int]) -> Traffic:
    """Reduce inside each node, all-reduce among node leaders, broadcast inside each node.

    >>> t = hierarchical_traffic(100, [0, 0, 1, 1])
    >>> t.inter, t.total_intra
    ([100.0, 0.0, 100.0, 0.0], 400.0)
    """
    members = node_members(node_ids)
    leaders = [m[0] for m in members]
    traffic = allreduce_traffic(nbytes, leaders, node_ids)
    for m in members:
        traffic = traffic + reduce_traffic(nbytes, m, m[0], node_ids) + broadcast_traffic(nbytes, m, m[0], node_ids)
    return traffic


def compressed_sync_traffic(nbytes: float, wire_bytes: float, node_ids: Sequence[int]) -> Traffic:
    """A sync of ``comm="node_local"`` with ``sync_dtype`` compression: ``nbytes`` reduced onto each node leader and
    broadcast back, the leaders' ``wire_bytes`` each all-gathered (a ring: ``(N-1) * wire_bytes`` per leader).

    >>> compressed_sync_traffic(400, 100, [0, 0, 1]).inter
    [100.0, 0.0, 100.0]
    """
    members = node_members(node_ids)
    ring = [m[0] for m in members]
    traffic = Traffic.zeros(len(node_ids))
    for i, src in enumerate(ring):
        _send(traffic, node_ids, src, ring[(i + 1) % len(ring)], (len(ring) - 1) * float(wire_bytes))
    for m in members:
        traffic = traffic + reduce_traffic(nbytes, m, m[0], node_ids) + broadcast_traffic(nbytes, m, m[0], node_ids)
    return traffic


def node_local_traffic(nbytes: float, node_ids: Sequence[int]) -> Traffic:
    """One all-reduce inside each node, nothing between nodes."""
    traffic = Traffic.zeros(len(node_ids))
    for m in node_members(node_ids):
        traffic = traffic + allreduce_traffic(nbytes, m, node_ids)
    return traffic


@dataclass
class CommStats:
    """Running byte counters of one job, kept identically on every rank."""

    rank: int
    world_size: int
    steps: int = 0  # optimizer steps recorded
    syncs: int = 0  # global parameter averages recorded
    total: Traffic = field(init=False)  # bytes sent by every rank so far (gradients and syncs)

    def __post_init__(self) -> None:
        self.total = Traffic.zeros(self.world_size)

    def record_step(self, traffic: Traffic) -> None:
        """Add one optimizer step's gradient exchange."""
        self.steps += 1
        self.total = self.total + traffic

    def record_sync(self, traffic: Traffic) -> None:
        """Add one global parameter average (not an optimizer step)."""
        self.syncs += 1
        self.total = self.total + traffic

    def as_dict(self) -> dict[str, float]:
        """Counters in bytes. ``*_per_step`` divide the totals (syncs included) by the number of steps."""
        steps = max(self.steps, 1)
        intra, inter = self.total.intra[self.rank], self.total.inter[self.rank]
        return {
            "steps": float(self.steps),
            "global_syncs": float(self.syncs),
            "bytes_intra_total": intra,
            "bytes_inter_total": inter,
            "bytes_intra_per_step": intra / steps,
            "bytes_inter_per_step": inter / steps,
            "job_bytes_intra_total": self.total.total_intra,
            "job_bytes_inter_total": self.total.total_inter,
            "job_bytes_intra_per_step": self.total.total_intra / steps,
            "job_bytes_inter_per_step": self.total.total_inter / steps,
        }
