"""Callbacks that the app adds to every run (besides the user's ``callbacks`` group)."""

from __future__ import annotations

import math
import time
from typing import Any

import lightning.pytorch as pl

__all__ = ["EpochTimer"]


class EpochTimer(pl.Callback):
    """Records each training epoch's wall time and epoch-level metrics; rank 0 prints one line per epoch."""

    def __init__(self) -> None:
        self.epoch_seconds: list[float] = []
        self.history: list[dict[str, Any]] = []
        self._start = 0.0

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start = time.perf_counter()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        seconds = time.perf_counter() - self._start
        self.epoch_seconds.append(seconds)
        row: dict[str, Any] = {"epoch": trainer.current_epoch, "seconds": round(seconds, 4)}
        row.update({k: _scalar(v) for k, v in trainer.callback_metrics.items() if "/" in k})
        self.history.append(row)
        if trainer.is_global_zero:
            shown = ", ".join(f"{k} {v:.4f}" for k, v in row.items() if k not in ("epoch", "seconds") and _is_number(v))
            print(f"epoch {row['epoch']:>3}  {seconds:7.2f} s  {shown}", flush=True)


def _scalar(value: Any) -> Any:
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)
