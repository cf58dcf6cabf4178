"""The balance report: plain data, logger metrics, the tables, the plot and the ``balance_report.*`` files."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_het.allocation import sample_shares
from lightning_het.balance.cost import AffineCost, step_time
from lightning_het.data.microbatch import micro_batch_sizes, pieces_label

if TYPE_CHECKING:
    from lightning_het.balance.monitor import BalanceMonitor
    from lightning_het.balance.state import Allocation


def balance_report(
    allocation: Allocation, config: Any, node_ids: list[int] | None, devices: list[str], telemetry: Any = None
) -> dict[str, Any]:
    """The allocation as plain data (for ``metrics.json`` and loggers)."""
    sizes, costs = allocation.batch_sizes or [], allocation.cost_model
    return {
        "global_batch_size": allocation.global_batch_size,
        "batch_sizes": list(sizes),
        "speeds": list(allocation.speeds or []),
        "shares": sample_shares(sizes) if sizes else [],
        "node_ids": list(node_ids or []),
        "profiled": config.speeds is None,
        "emulate_slowdown": list(config.emulate_slowdown) if config.emulate_slowdown else None,
        "devices": devices,
        "profile_seconds": allocation.profile_seconds,
        "profile_cached": allocation.profile_cached,
        "cost_model": [c.as_dict() for c in costs] if costs else None,
        "max_micro_batch_sizes": list(allocation.micro_caps) if allocation.micro_caps else None,
        "predicted_step_s": step_time(sizes, costs) if costs and sizes else None,
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


def log_epoch_metrics(loggers: Iterable[Any], summary: dict[str, Any], step: int) -> None:
    """Send one epoch's per-replica figures to Lightning loggers (``logger.log_metrics``), keyed ``het/...``."""
    metrics: dict[str, float] = {}
    if math.isfinite(summary["imbalance"]):
        metrics["het/imbalance"] = float(summary["imbalance"])
    names = {
        "compute_s": "compute_s",
        "wait_s": "wait_s",
        "samples_per_s": "samples_per_s",
        "batch_sizes": "batch_size",
    }
    for key, name in names.items():
        for rank, value in enumerate(summary[key]):
            if isinstance(value, (int, float)) and math.isfinite(value):
                metrics[f"het/{name}/rank{rank}"] = float(value)
    for logger in loggers:
        logger.log_metrics(metrics, step=step)


def format_balance_table(report: dict[str, Any]) -> str:
    """Markdown table of a :meth:`HeterogeneousStrategy.balance_report`: allocation plus last-epoch telemetry."""
    sizes = report.get("batch_sizes") or []
    if not sizes:
        return "HeterogeneousStrategy: no allocation yet"
    telemetry = report.get("telemetry") or {}
    epochs = telemetry.get("epochs") or []
    last = epochs[-1] if epochs else None
    speeds = report.get("speeds") or [float("nan")] * len(sizes)
    lines = [
        f"Global batch {report.get('global_batch_size')}, {len(sizes)} replicas"
        + (f"; last epoch {last['epoch']}: imbalance (max/min compute) {last['imbalance']:.3f}" if last else ""),
        "",
        "| rank | batch | speed (samples/s) | compute (ms, median) | wait (ms, median) | wait share | samples/s |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r, (b, s) in enumerate(zip(sizes, speeds)):
        if last:
            c, w = last["compute_s"][r] * 1e3, last["wait_s"][r] * 1e3
            cols = f"{c:.1f} | {w:.1f} | {last['wait_fraction'][r]:.1%} | {last['samples_per_s'][r]:.1f}"
        else:
            cols = "- | - | - | -"
        lines.append(f"| {r} | {b} | {s:.2f} | {cols} |")
    rebalances = telemetry.get("rebalances") or []
    if rebalances:
        lines += ["", "Rebalances:"]
        for e in rebalances:
            lines.append(
                f"- end of epoch {e['epoch']} (step {e['global_step']}): {e['from']} -> {e['batch_sizes']}"
                f" ({e['reason']})"
            )
    return "\n".join(lines)


def plot_balance(report: dict[str, Any], path: str | Path) -> Path:
    """PNG of compute vs wait time per replica over the global step, with rebalances marked."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    telemetry = report.get("telemetry") or {}
    series = telemetry.get("series") or {}
    compute, wait, steps = series.get("compute_s") or [], series.get("wait_s") or [], series.get("batch") or []
    world = len(compute)
    path = Path(path)
    rebalance_steps = [e["batch"] + 0.5 for e in telemetry.get("rebalances") or []]
    if world == 0:
        fig = Figure(figsize=(6, 2))
        fig.text(0.5, 0.5, "no telemetry recorded", ha="center", va="center")
    elif world <= 8:
        fig = Figure(figsize=(9, 1.8 * world + 0.8))
        axes = fig.subplots(world, 1, sharex=True, squeeze=False)[:, 0]
        for r, ax in enumerate(axes):
            ax.plot(steps[r], [c * 1e3 for c in compute[r]], lw=0.9, label="compute")
            ax.plot(steps[r], [w * 1e3 for w in wait[r]], lw=0.9, label="wait (gradient sync)")
            for s in rebalance_steps:
                ax.axvline(s, color="k", ls="--", lw=0.8)
            ax.set_ylabel(f"rank {r}\nms / step")
            ax.grid(alpha=0.3)
            values = sorted(v for v in compute[r] + wait[r] if math.isfinite(v))
            if len(values) > 20:  # keep the first steps (start-up costs) from flattening the rest
                ax.set_ylim(0, values[int(0.98 * (len(values) - 1))] * 1.3e3)
        axes[0].legend(loc="upper right", fontsize=8)
        axes[-1].set_xlabel("training batch" + ("  (dashed: rebalance)" if rebalance_steps else ""))
        fig.suptitle("Compute vs wait per replica")
    else:
        fig = Figure(figsize=(10, 6))
        axes = fig.subplots(2, 1, sharex=True)
        length = min(len(c) for c in compute)
        for ax, data, title in ((axes[0], compute, "compute (ms)"), (axes[1], wait, "wait (ms)")):
            image = ax.imshow([[v * 1e3 for v in row[:length]] for row in data], aspect="auto", interpolation="nearest")
            ax.set_ylabel("rank")
            ax.set_title(title)
            fig.colorbar(image, ax=ax)
        axes[-1].set_xlabel("recorded step")
    fig.tight_layout()
    FigureCanvasAgg(fig).print_png(str(path))
    return path


def balance_report_paths(directory: str | Path) -> dict[str, Path]:
    """Where :func:`write_balance_report` puts its files in ``directory``, keyed ``json``, ``table`` and ``plot``."""
    out = Path(directory)
    return {"json": out / "balance_report.json", "table": out / "balance_report.md", "plot": out / "balance_report.png"}


def write_balance_report(report: dict[str, Any], directory: str | Path) -> dict[str, Path]:
    """Write ``balance_report.json``, ``balance_report.md`` (table) and ``balance_report.png`` into ``directory``."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = balance_report_paths(out)
    paths["json"].write_text(json.dumps(_plain(report), indent=1) + "\n")
    paths["table"].write_text(format_balance_table(report) + "\n")
    plot_balance(report, paths["plot"])
    return paths


def _plain(value: Any) -> Any:
    """JSON-safe copy: non-finite floats become ``None``, tuples lists, unknown objects strings."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return str(value)


def telemetry_section(
    monitor: BalanceMonitor | None, snapshot: dict[str, Any] | None, *, include_series: bool
) -> dict[str, Any] | None:
    """The ``"telemetry"`` entry of ``balance_report()``: JSON-safe, from the live monitor or a spawn snapshot."""
    if monitor is not None and monitor.record:
        data = monitor.history.as_dict()
    elif snapshot is not None:
        data = dict(snapshot)
    else:
        return None
    if not include_series:
        data.pop("series", None)
    return _plain(data)
