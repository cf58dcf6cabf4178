"""The allocation one strategy holds (batch sizes, speeds, loss scale, cost model) and its plain-data forms."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_het.allocation import loss_scale, sample_shares
from lightning_het.balance.cost import AffineCost, step_time
from lightning_het.data.microbatch import micro_batch_sizes, pieces_label


class Allocation:
    """Samples per step and speed (samples/s when measured) of every replica by global rank, the global batch, the loss
    scale ``W * b_r / B`` and the last profiled affine costs; ``None`` before the allocation is known.
    """

    def __init__(self) -> None:
        self.batch_sizes: list[int] | None = None
        self.speeds: list[float] | None = None
        self.global_batch_size: int | None = None
        self.loss_scale = 1.0
        self.cost_model: list[AffineCost] | None = None  # per-replica costs behind the last profiled allocation
        self.profile_seconds = 0.0  # time this replica spent profiling
        self.profile_cached = False  # the last allocation's costs came from the cache
        self.micro_caps: list[int] | None = None  # most samples each replica runs at once (None: its whole share)
        self.telemetry_snapshot: dict[str, Any] | None = None  # the workers' telemetry, in the parent after spawn

    def adopt(
        self, batch_sizes: list[int], speeds: list[float], rank: int, costs: list[dict[str, float]] | None = None
    ) -> None:
        """Make ``batch_sizes`` the allocation (speeds, global batch, loss scale and given ``costs`` change with it)."""
        if costs is not None:  # a rebalancing check refreshed the cost model
            self.cost_model = [AffineCost.from_dict(c) for c in costs]
        self.batch_sizes = list(batch_sizes)
        self.speeds = list(speeds)
        self.global_batch_size = sum(batch_sizes)
        self.loss_scale = loss_scale(self.batch_sizes, rank)

    def reset(self) -> None:
        """A new fit derives a new allocation; until then (and for good with a loader left alone): plain DDP."""
        self.batch_sizes = None
        self.loss_scale = 1.0

    def step_batch_sizes(self, sampler: Any, batch_idx: Callable[[], int | None]) -> list[int]:
        """Per-replica samples of the global batch being trained: the allocation, a trial split or the tail's."""
        sizes = list(self.batch_sizes or [])
        if sampler is None or list(sampler.batch_sizes) != sizes:
            return sizes
        if sampler.tail_batch_sizes is None and sampler.split_schedule is None:
            return sizes
        step = batch_idx()
        if step is None:
            return sizes
        return sampler.step_batch_sizes(step)

    def step_loss_scale(self, sizes: list[int], rank: int) -> float:
        """``W * b_r / B`` for the global batch split as ``sizes`` (the tail batch has its own)."""
        if not sizes or sizes == self.batch_sizes:
            return self.loss_scale
        return loss_scale(sizes, rank)

    def export(self, node_ids: list[int] | None, telemetry: dict[str, Any] | None) -> dict[str, Any]:
        """The allocation, costs and telemetry as plain data: what a spawned worker sends back to the parent."""
        return {
            "batch_sizes": self.batch_sizes,
            "speeds": self.speeds,
            "node_ids": node_ids,
            "profile_seconds": self.profile_seconds,
            "cost_model": [c.as_dict() for c in self.cost_model] if self.cost_model else None,
            "profile_cached": self.profile_cached,
            "micro_caps": self.micro_caps,
            "telemetry": telemetry,
        }

    def import_(self, state: dict[str, Any], rank: int) -> None:
        """Adopt what :meth:`export` returned in a worker (parent process, after spawn); node ids are the caller's."""
        if state.get("batch_sizes"):
            self.adopt(state["batch_sizes"], state["speeds"], rank)
        self.profile_seconds = state.get("profile_seconds", 0.0)
        if state.get("cost_model"):
            self.cost_model = [AffineCost.from_dict(c) for c in state["cost_model"]]
        self.profile_cached = bool(state.get("profile_cached", False))
        self.micro_caps = state.get("micro_caps")
        self.telemetry_snapshot = state.get("telemetry")

    def report(
        self,
        *,
        node_ids: list[int] | None,
        profiled: bool,
        emulate_slowdown: list[float] | None,
        devices: list[str],
        telemetry: dict[str, Any] | None,
    ) -> dict[str, Any]:
        """The allocation as plain data (for ``metrics.json`` and loggers); see ``balance_report``."""
        sizes = self.batch_sizes or []
        return {
            "global_batch_size": self.global_batch_size,
            "batch_sizes": list(sizes),
            "speeds": list(self.speeds or []),
            "shares": sample_shares(sizes) if sizes else [],
            "node_ids": list(node_ids or []),
            "profiled": profiled,
            "emulate_slowdown": list(emulate_slowdown) if emulate_slowdown else None,
            "devices": devices,
            "profile_seconds": self.profile_seconds,
            "profile_cached": self.profile_cached,
            "cost_model": [c.as_dict() for c in self.cost_model] if self.cost_model else None,
            "max_micro_batch_sizes": list(self.micro_caps) if self.micro_caps else None,
            "predicted_step_s": step_time(sizes, self.cost_model) if self.cost_model and sizes else None,
            "telemetry": telemetry,
        }


def render_balance_table(report: dict[str, Any]) -> str:
    """A human-readable table of a balance report: rank, node, device, speed, batch size, share (and costs)."""
    if not report["batch_sizes"]:
        return "HeterogeneousStrategy: no allocation yet"
    devices = report["devices"]
    unit = "samples/s" if report["profiled"] else "(given)"
    costs = report["cost_model"]
    caps = report.get("max_micro_batch_sizes")
    source = " (costs from the profile cache)" if report["profile_cached"] else ""
    lines = [
        f"HeterogeneousStrategy balance: global batch {report['global_batch_size']}{source}",
        f"{'rank':>4} {'node':>4} {'device':>8} {'speed ' + unit:>18} {'batch':>6} {'share':>7}"
        + (f" {'micro':>7}" if caps else "")
        + (f" {'fixed ms':>9} {'ms/sample':>9} {'step ms':>8}" if costs else ""),
    ]
    for r, (b, s, sh) in enumerate(zip(report["batch_sizes"], report["speeds"], report["shares"])):
        node = report["node_ids"][r] if r < len(report["node_ids"]) else "?"
        device = devices[r] if r < len(devices) else "?"
        line = f"{r:>4} {node!s:>4} {device:>8} {s:>18.2f} {b:>6d} {sh:>7.1%}"
        if caps:  # the pieces that run: size x count (a share of 16 under a cap of 3: 3x4+2x2)
            line += f" {pieces_label(micro_batch_sizes(b, caps[r])):>7}"
        if costs:
            cost = AffineCost.from_dict(costs[r])
            line += f" {cost.fixed_s * 1e3:>9.2f} {cost.per_sample_s * 1e3:>9.3f} {cost(b) * 1e3:>8.2f}"
        lines.append(line)
    if report["predicted_step_s"] is not None:
        lines.append(f"predicted step (slowest replica's local compute): {report['predicted_step_s'] * 1e3:.2f} ms")
    return "\n".join(lines)
