"""Byte accounting: what each rank sends inside its node and to other nodes, per collective pattern."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from lightning_het.cluster.topology import node_members


@dataclass
class Traffic:
    """Bytes sent by every global rank during one collective pattern: to its own node, to other nodes."""

    intra: list[float]
    inter: list[float]

    @classmethod
    def zeros(cls, world_size: int) -> Traffic:
        return cls([0.0] * world_size, [0.0] * world_size)

    def send(self, node_ids: Sequence[int], src: int, dst: int, nbytes: float) -> Traffic:
        (self.intra if node_ids[src] == node_ids[dst] else self.inter)[src] += nbytes
        return self

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(
            [a + b for a, b in zip(self.intra, other.intra)], [a + b for a, b in zip(self.inter, other.inter)]
        )

    @property
    def total_intra(self) -> float:
        return sum(self.intra)

    @property
    def total_inter(self) -> float:
        return sum(self.inter)


def _ring(nbytes: float, ranks: Sequence[int], node_ids: Sequence[int], per_rank: float | None = None) -> Traffic:
    """A ring over ``ranks`` (ascending): each sends ``per_rank`` bytes (default: an all-reduce's) to the next."""
    traffic, ring = Traffic.zeros(len(node_ids)), sorted(ranks)
    if len(ring) > 1:
        per_rank = 2.0 * (len(ring) - 1) / len(ring) * nbytes if per_rank is None else per_rank
        for i, src in enumerate(ring):
            traffic.send(node_ids, src, ring[(i + 1) % len(ring)], per_rank)
    return traffic


def _reduce_and_broadcast(nbytes: float, node_ids: Sequence[int]) -> Traffic:
    """Inside every node: a reduce onto its leader and a broadcast back."""
    traffic = Traffic.zeros(len(node_ids))
    for members in node_members(node_ids):
        for other in members[1:]:
            traffic.send(node_ids, other, members[0], nbytes).send(node_ids, members[0], other, nbytes)
    return traffic


def flat_allreduce_traffic(nbytes: float, node_ids: Sequence[int]) -> Traffic:
    """One ring all-reduce over all ranks (DDP's).

    >>> flat_allreduce_traffic(100, [0, 0, 1, 1])
    Traffic(intra=[150.0, 0.0, 150.0, 0.0], inter=[0.0, 150.0, 0.0, 150.0])
    """
    return _ring(nbytes, range(len(node_ids)), node_ids)


def hierarchical_traffic(nbytes: float, node_ids: Sequence[int]) -> Traffic:
    """Reduce inside each node, all-reduce among node leaders, broadcast inside each node.

    >>> t = hierarchical_traffic(100, [0, 0, 1, 1])
    >>> t.inter, t.total_intra
    ([100.0, 0.0, 100.0, 0.0], 400.0)
    """
    leaders = [m[0] for m in node_members(node_ids)]
    return _ring(nbytes, leaders, node_ids) + _reduce_and_broadcast(nbytes, node_ids)


def compressed_sync_traffic(nbytes: float, wire_bytes: float, node_ids: Sequence[int]) -> Traffic:
    """A compressed sync: ``nbytes`` reduced onto each leader and broadcast back, the leaders' ``wire_bytes``
    all-gathered in a ring.

    >>> compressed_sync_traffic(400, 100, [0, 0, 1]).inter
    [100.0, 0.0, 100.0]
    """
    leaders = [m[0] for m in node_members(node_ids)]
    ring = _ring(nbytes, leaders, node_ids, per_rank=(len(leaders) - 1) * float(wire_bytes))
    return ring + _reduce_and_broadcast(nbytes, node_ids)


def node_local_traffic(nbytes: float, node_ids: Sequence[int]) -> Traffic:
    """One all-reduce inside each node, nothing between nodes."""
    traffic = Traffic.zeros(len(node_ids))
    for members in node_members(node_ids):
        traffic = traffic + _ring(nbytes, members, node_ids)
    return traffic


@dataclass
class CommStats:
    """Running byte counters of one job, kept identically on every rank."""

    rank: int
    world_size: int
    steps: int = 0
    syncs: int = 0
    total: Traffic = field(init=False)

    def __post_init__(self) -> None:
        self.total = Traffic.zeros(self.world_size)

    def record(self, traffic: Traffic, sync: bool = False) -> None:
        """Add one optimizer step's gradient exchange, or (``sync``) one global parameter average."""
        self.syncs, self.steps = self.syncs + sync, self.steps + (not sync)
        self.total = self.total + traffic

    def as_dict(self) -> dict[str, float]:
        """The counters in bytes; ``*_per_step``: the totals (syncs included) over the optimizer steps."""
        out, steps = {"steps": float(self.steps), "global_syncs": float(self.syncs)}, max(self.steps, 1)
        for kind in ("intra", "inter"):
            mine, job = getattr(self.total, kind)[self.rank], sum(getattr(self.total, kind))
            out |= {f"bytes_{kind}_total": mine, f"bytes_{kind}_per_step": mine / steps}
            out |= {f"job_bytes_{kind}_total": job, f"job_bytes_{kind}_per_step": job / steps}
        return out
