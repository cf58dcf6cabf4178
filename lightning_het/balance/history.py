"""Per-epoch timings of every replica: the all-gather, the per-epoch statistics and the history of one ``fit``."""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_het.balance.clock import EpochTimings

_MAX_SERIES_POINTS = 20_000  # per replica; older points are thinned (every other one kept) beyond this


def gather_timings(local: EpochTimings, world_size: int, device: torch.device) -> list[EpochTimings]:
    """All-gather every replica's timings (a collective: call it on every rank at the same point)."""
    if world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return [local]
    rows = local.as_tensor().to(device)
    count = torch.tensor([rows.shape[0]], dtype=torch.int64, device=device)
    counts = [torch.zeros_like(count) for _ in range(world_size)]
    dist.all_gather(counts, count)
    longest = max(int(c.item()) for c in counts)
    if longest == 0:  # the same on every rank: nothing recorded anywhere
        return [EpochTimings() for _ in range(world_size)]
    padded = torch.zeros(longest, 4, dtype=torch.float64, device=device)
    padded[: rows.shape[0]] = rows
    everyone = [torch.zeros_like(padded) for _ in range(world_size)]
    dist.all_gather(everyone, padded)
    return [EpochTimings.from_tensor(t[: int(c.item())]) for t, c in zip(everyone, counts)]


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def _typical_steps(t: EpochTimings) -> tuple[int, EpochTimings]:
    """The epoch's most common batch size (ties: the largest) and the steps that ran it (not the tail batch's)."""
    if not t.batch_sizes:
        return 0, t
    counts = Counter(t.batch_sizes)
    size = max(counts, key=lambda b: (counts[b], b))
    keep = [i for i, b in enumerate(t.batch_sizes) if b == size]
    return size, EpochTimings(
        [t.compute_s[i] for i in keep], [t.wait_s[i] for i in keep], [t.step_s[i] for i in keep], [size] * len(keep)
    )


def epoch_summary(timings: Sequence[EpochTimings]) -> dict[str, Any]:
    """Per-replica figures of one epoch (lists indexed by global rank) and the imbalance."""
    typical = [_typical_steps(t) for t in timings]
    compute = [_median(t.compute_s) for _, t in typical]
    total_c = [math.fsum(t.compute_s) for t in timings]
    total_w = [math.fsum(t.wait_s) for t in timings]
    positive = [c for c in compute if math.isfinite(c) and c > 0]
    return {
        "steps": [len(t) for t in timings],
        "batch_sizes": [size for size, _ in typical],
        "compute_s": compute,
        "compute_recent_s": [_median(t.compute_s[len(t.compute_s) // 2 :]) for _, t in typical],
        "wait_s": [_median(t.wait_s) for _, t in typical],
        "step_s": [_median(t.step_s) for _, t in typical],
        "compute_total_s": total_c,
        "wait_total_s": total_w,
        "wait_fraction": [w / (c + w) if c + w > 0 else 0.0 for c, w in zip(total_c, total_w)],
        "samples_per_s": [
            sum(t.batch_sizes) / math.fsum(t.step_s) if t.step_s and math.fsum(t.step_s) > 0 else 0.0 for t in timings
        ],
        "imbalance": (max(positive) / min(positive)) if len(positive) == len(compute) and positive else float("nan"),
    }


class TelemetryHistory:
    """Everything measured during one ``fit``, identical on every rank once gathered."""

    def __init__(self) -> None:
        self.epochs: list[dict[str, Any]] = []
        self.series: dict[str, list[list[float]]] = {"compute_s": [], "wait_s": [], "batch": []}
        self.rebalances: list[dict[str, Any]] = []
        self.checks: list[dict[str, Any]] = []
        self._stride = 1
        self._seen = 0

    def add(self, timings: Sequence[EpochTimings], *, epoch: int, global_step: int) -> dict[str, Any]:
        """Book one gathered window (usually an epoch); returns its summary."""
        summary = epoch_summary(timings)
        summary.update(epoch=epoch, global_step=global_step)
        self.epochs.append(summary)
        world = len(timings)
        if not self.series["compute_s"]:
            self.series = {key: [[] for _ in range(world)] for key in ("compute_s", "wait_s", "batch")}
        steps = max((len(t) for t in timings), default=0)
        for i in range(steps):
            if (self._seen + i) % self._stride:
                continue
            for r, t in enumerate(timings):
                if i < len(t):
                    self.series["compute_s"][r].append(t.compute_s[i])
                    self.series["wait_s"][r].append(t.wait_s[i])
                    self.series["batch"][r].append(float(self._seen + i + 1))
        self._seen += steps
        while self.series["compute_s"] and len(self.series["compute_s"][0]) > _MAX_SERIES_POINTS:
            self.series = {key: [v[::2] for v in values] for key, values in self.series.items()}
            self._stride *= 2
        return summary

    def record_check(self, decision: dict[str, Any], *, epoch: int, global_step: int, old: Sequence[int]) -> None:
        """Book a rebalancing decision (``RebalanceDecision.as_dict``) made after ``batch`` batches."""
        entry = {"epoch": epoch, "global_step": global_step, "batch": self._seen, "from": list(old), **decision}
        self.checks.append(entry)
        if decision.get("adopt"):
            self.rebalances.append(entry)

    def as_dict(self) -> dict[str, Any]:
        """Plain data (JSON-serialisable)."""
        return {
            "epochs": [dict(e) for e in self.epochs],
            "series": {k: [list(v) for v in vals] for k, vals in self.series.items()},
            "rebalances": [dict(r) for r in self.rebalances],
            "checks": [dict(c) for c in self.checks],
        }
