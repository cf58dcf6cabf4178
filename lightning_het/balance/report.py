"""The balance report: plain data, logger metrics, the tables, the plot and the ``balance_report.*`` files."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_het.balance.cost import AffineCost, step_time
from lightning_het.data.microbatch import micro_batch_sizes, pieces_label

if TYPE_CHECKING:
    from lightning_het.balance.monitor import BalanceMonitor
    from lightning_het.balance.policy import Allocation


def balance_report(
    allocation: Allocation, config: Any, node_ids: list[int] | None, devices: list[str], telemetry: Any = None
) -> dict[str, Any]:
    """The allocation as plain data (for ``metrics.json`` and loggers)."""
    sizes, costs = allocation.batch_sizes or [], allocation.cost_model
    return {
        "global_batch_size": allocation.global_batch_size,
        "batch_sizes": list(sizes),
        "speeds": list(allocation.speeds or []),
        "shares": [b / sum(sizes) for b in sizes],
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


def _cell(value: Any, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None or not math.isfinite(value) else format(value * scale, spec)


def render_balance_table(report: dict[str, Any]) -> str:
    """The balance table: each replica's node, device, speed, batch, share, micro-batches, costs and timings."""
    sizes = report.get("batch_sizes") or []
    if not sizes:
        return "HeterogeneousStrategy: no allocation yet"
    caps, costs = report.get("max_micro_batch_sizes"), report.get("cost_model")
    telemetry = report.get("telemetry") or {}
    last = telemetry["epochs"][-1] if telemetry.get("epochs") else None
    unknown = ["?"] * len(sizes)
    nodes, devices = [*(report.get("node_ids") or []), *unknown], [*(report.get("devices") or []), *unknown]
    head = f"HeterogeneousStrategy balance: global batch {report['global_batch_size']}"
    head += " (costs from the profile cache)" if report.get("profile_cached") else ""
    if last:
        head += f"; last epoch {last['epoch']}: imbalance (max/min compute) {_cell(last['imbalance'], '.3f')}"
    titles = ["rank", "node", "device", "speed " + ("samples/s" if report.get("profiled", True) else "(given)")]
    titles += ["batch", "share", *["micro"] * bool(caps), *["fixed ms", "ms/sample", "step ms"] * bool(costs)]
    titles += ["compute ms", "wait ms", "wait share", "samples/s"] if last else []
    rows = [titles]
    for r, (b, speed) in enumerate(zip(sizes, report["speeds"])):
        row = [r, nodes[r], devices[r], f"{speed:.2f}", b, f"{b / sum(sizes):.1%}"]
        if caps:  # the pieces that run: size x count (a share of 16 under a cap of 3: 3x4+2x2)
            row.append(pieces_label(micro_batch_sizes(b, caps[r])))
        if costs:
            cost = AffineCost.from_dict(costs[r])
            row += [f"{cost.fixed_s * 1e3:.2f}", f"{cost.per_sample_s * 1e3:.3f}", f"{cost(b) * 1e3:.2f}"]
        if last:
            row += [_cell(last["compute_s"][r], ".1f", 1e3), _cell(last["wait_s"][r], ".1f", 1e3)]
            row += [_cell(last["wait_fraction"][r], ".1%"), _cell(last["samples_per_s"][r], ".1f")]
        rows.append([str(cell) for cell in row])
    widths = [max(len(row[i]) for row in rows) for i in range(len(titles))]
    lines = [head, *(" ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows)]
    if report.get("predicted_step_s") is not None:
        lines.append(f"predicted step (slowest replica's local compute): {report['predicted_step_s'] * 1e3:.2f} ms")
    lines += [
        f"rebalanced at the end of epoch {e['epoch']} (step {e['global_step']}): {e['from']} -> {e['batch_sizes']}"
        f" ({e['reason']})"
        for e in telemetry.get("rebalances") or []
    ]
    return "\n".join(lines)


def log_epoch_metrics(loggers: Iterable[Any], summary: dict[str, Any], step: int) -> None:
    """Send one epoch's per-replica figures to Lightning loggers (``logger.log_metrics``), keyed ``het/...``."""
    metrics = {"het/imbalance": summary["imbalance"]}
    for key in ("compute_s", "wait_s", "samples_per_s", "batch_sizes"):  # het/batch_size/rank0, ...
        metrics |= {f"het/{key.replace('sizes', 'size')}/rank{r}": v for r, v in enumerate(summary[key])}
    metrics = {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(v)}
    for logger in loggers:
        logger.log_metrics(metrics, step=step)


def plot_balance(report: dict[str, Any], path: str | Path) -> None:
    """PNG of each replica's compute and wait time per training batch, with rebalances marked."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    telemetry = report.get("telemetry") or {}
    series = telemetry.get("series") or {}
    steps = series.get("batch") or []
    fig = Figure(figsize=(9, 6))
    axes = fig.subplots(2, 1, sharex=True)
    for ax, key, title in ((axes[0], "compute_s", "compute"), (axes[1], "wait_s", "wait (gradient sync)")):
        values = series.get(key) or []
        for r, row in enumerate(values):
            ax.plot(steps[r], [v * 1e3 for v in row], lw=0.9, label=f"rank {r}")
        for e in telemetry.get("rebalances") or []:
            ax.axvline(e["batch"] + 0.5, color="k", ls="--", lw=0.8)
        finite = sorted(v for row in values for v in row if math.isfinite(v))
        if len(finite) > 20:  # keep the first steps (start-up costs) from flattening the rest
            ax.set_ylim(0, finite[int(0.98 * (len(finite) - 1))] * 1.3e3)
        ax.set_ylabel(f"{title}\nms / step")
        ax.grid(alpha=0.3)
    if steps:
        axes[0].legend(loc="upper right", fontsize=8, ncol=max(len(steps) // 8, 1))
    else:
        axes[0].set_title("no telemetry recorded")
    axes[-1].set_xlabel("training batch (dashed: rebalance)")
    fig.tight_layout()
    FigureCanvasAgg(fig).print_png(str(path))


def balance_report_paths(directory: str | Path) -> dict[str, Path]:
    """Where :func:`write_balance_report` puts its files in ``directory``, keyed ``json``, ``table`` and ``plot``."""
    out = Path(directory)
    return {"json": out / "balance_report.json", "table": out / "balance_report.md", "plot": out / "balance_report.png"}


def write_balance_report(report: dict[str, Any], directory: str | Path) -> dict[str, Path]:
    """Write ``balance_report.json``, ``balance_report.md`` (table) and ``balance_report.png`` into ``directory``."""
    paths = balance_report_paths(directory)
    paths["json"].parent.mkdir(parents=True, exist_ok=True)
    paths["json"].write_text(json.dumps(_plain(report), indent=1) + "\n")
    paths["table"].write_text(f"```text\n{render_balance_table(report)}\n```\n")
    plot_balance(report, paths["plot"])
    return paths


def _plain(value: Any) -> Any:
    """JSON-safe copy: non-finite floats become ``None``, tuples lists, unknown objects strings."""
    return json.loads(json.dumps(value, default=str), parse_constant=lambda _: None)


def telemetry_section(monitor: BalanceMonitor | None, snapshot: dict | None, *, include_series: bool) -> dict | None:
    """The ``"telemetry"`` entry of ``balance_report()``: JSON-safe, from the live monitor or a spawn snapshot."""
    data = monitor.history if monitor is not None and monitor.record else snapshot
    return None if data is None else _plain({k: v for k, v in data.items() if include_series or k != "series"})
