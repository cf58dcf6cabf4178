"""The Hydra app's command line: ``python -m lightning_het.train [overrides]``, installed as ``lightning-het-train``."""

from __future__ import annotations

import os
import sys
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from lightning_het.app import config_dir
from lightning_het.app.build import unweighted_gradients
from lightning_het.app.config import register_configs
from lightning_het.app.messages import USER_ERROR_EXIT, UserError, report, user_error_types
from lightning_het.app.run import train
from lightning_het.app.sweeps import SweepJobFailed, run_sweep_job, sweep_job_command

__all__ = ["main", "sweep_job_command", "train", "unweighted_gradients"]

register_configs()


def objective(cfg: DictConfig, metrics: dict[str, Any]) -> float | None:
    key = cfg.get("optimized_metric")
    if not key or not metrics:
        return None
    if key not in metrics:
        available = sorted(k for k, v in metrics.items() if isinstance(v, (int, float)))
        raise UserError(f"You set optimized_metric={key!r}, but the run has no such metric. HINT: one of {available}.")
    return float(metrics[key])


def _release_process_group() -> None:
    """Destroy the default process group once the run is over (not racing the interpreter's shutdown)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="train")
def _hydra_main(cfg: DictConfig) -> float | None:
    try:
        if HydraConfig.get().mode == RunMode.MULTIRUN:
            metrics = run_sweep_job(cfg)
        else:
            metrics = train(cfg)
            _release_process_group()
        return objective(cfg, metrics)
    except user_error_types() as err:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        report(err)
        sys.exit(err.status if isinstance(err, SweepJobFailed) and err.status > 0 else USER_ERROR_EXIT)


def main() -> None:
    """Console entry point (``lightning-het-train``): compose the config from the command line and run it."""
    _hydra_main()


if __name__ == "__main__":
    main()
