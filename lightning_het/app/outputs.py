"""A run's outputs: the prediction map, ``metrics.json`` (written by global rank 0) and the console summary."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig

from lightning_het.reliability.output_dir import OutputDirError

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_het.app.callbacks import EpochTimer

__all__ = ["REQUIRED_METRICS", "collect_metrics", "write_metrics", "write_prediction_map"]

#: Keys of the test metrics every ``metrics.json`` carries (fractions in [0, 1]).
REQUIRED_METRICS = ("test/oa", "test/aa", "test/kappa")


def write_prediction_map(cfg: DictConfig, trainer: pl.Trainer, model: Any, datamodule: Any) -> dict[str, str] | None:
    """Predict every pixel of the scene on all replicas; rank 0 writes the class map (GeoTIFF + PNG)."""
    if not cfg.get("prediction_map", True):
        return None
    from lightning_het.hsi.prediction import PredictionMapWriter

    writer = next(c for c in trainer.callbacks if isinstance(c, PredictionMapWriter))
    trainer.predict(model, datamodule=datamodule, return_predictions=False)
    return {path.suffix.lstrip("."): str(path) for path in writer.paths}


def collect_metrics(
    trainer: pl.Trainer,
    test_results: list[dict[str, float]],
    timer: EpochTimer,
    fit_seconds: float,
    total_seconds: float,
) -> dict[str, Any]:
    metrics: dict[str, Any] = {}
    for results in test_results:
        metrics.update({k: float(v) for k, v in results.items()})
    missing = [k for k in REQUIRED_METRICS if k not in metrics]
    if missing:
        raise RuntimeError(
            f"The test loop logged {sorted(metrics)}, but metrics.json needs {list(REQUIRED_METRICS)} (missing"
            f" {missing}). HINT: the model's test_step must log them (see lightning_het.hsi.model)."
        )
    details = getattr(trainer.lightning_module, "test_results", None) or {}
    if "per_class" in details:
        metrics["test/per_class_accuracy"] = [v if _is_number(v) else None for v in details["per_class"]]
    if "confusion" in details:
        metrics["test/confusion"] = details["confusion"]
    datamodule = trainer.datamodule
    if datamodule is not None and hasattr(datamodule, "class_names"):
        metrics["class_names"] = list(datamodule.class_names)
    strategy = trainer.strategy
    if hasattr(strategy, "balance_report"):
        metrics["balance"] = strategy.balance_report()
    else:  # any other strategy: every replica gets the loader's batch
        metrics["balance"] = {"batch_sizes": [], "speeds": [], "note": f"{type(strategy).__name__}: no allocation"}
    if getattr(strategy, "comm_stats", None):  # bytes between and inside nodes, the same on every replica
        metrics["comm"] = dict(strategy.comm_stats)
    epochs = list(timer.epoch_seconds)
    metrics["epoch_times_s"] = [round(s, 4) for s in epochs]
    # the first epoch also pays for warm-up (allocator, thread pools); report the mean of the others when possible
    steady = epochs[1:] if len(epochs) > 1 else epochs
    metrics["mean_epoch_time_s"] = round(sum(steady) / len(steady), 4) if steady else None
    metrics["history"] = timer.history
    metrics["fit_time_s"] = round(fit_seconds, 3)
    metrics["total_time_s"] = round(total_seconds, 3)
    metrics["world_size"] = trainer.world_size
    metrics["num_nodes"] = trainer.num_nodes
    metrics["accelerator"] = type(trainer.accelerator).__name__.replace("Accelerator", "").lower()
    metrics["global_step"] = trainer.global_step
    metrics["epochs"] = trainer.current_epoch
    return metrics


def write_metrics(trainer: pl.Trainer, metrics: dict[str, Any], output_dir: Path) -> Path:
    """Write ``metrics`` to ``<output_dir>/metrics.json`` and print the run's summary (call on global rank 0 only)."""
    path = output_dir / "metrics.json"
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(metrics, indent=2, sort_keys=True, default=_json_default) + "\n")
    except OSError as err:  # e.g. the disk filled up during the run
        raise OutputDirError(f"Cannot write '{path}' ({err.strerror or type(err).__name__}).") from None
    print(_summary(trainer, metrics, path), flush=True)
    return path


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _json_default(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def _summary(trainer: pl.Trainer, metrics: dict[str, Any], path: Path) -> str:
    strategy = trainer.strategy
    lines = [""]
    if hasattr(strategy, "balance_table"):
        lines.append(strategy.balance_table())
    mean_epoch = metrics.get("mean_epoch_time_s")
    epoch_text = f"{mean_epoch:.2f} s/epoch" if mean_epoch is not None else "no epoch"
    lines.append(
        f"test: OA {metrics['test/oa']:.4f}  AA {metrics['test/aa']:.4f}  kappa {metrics['test/kappa']:.4f}"
        f"   ({metrics['world_size']} replicas, {epoch_text}, {metrics['total_time_s']:.1f} s in all)"
    )
    if metrics.get("prediction_map"):
        lines.append("map: " + ", ".join(str(p) for p in metrics["prediction_map"].values()))
    lines.append(f"metrics: {path}")
    return "\n".join(lines)
