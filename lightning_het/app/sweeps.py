"""Sweeps (``-m``): each multirun job runs as a separate single run of the app in the job's directory."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from lightning_het.app.messages import UserError, process_label

__all__ = ["SweepJobFailed", "run_sweep_job", "sweep_job_command"]

log = logging.getLogger(__name__)

#: Hydra overrides that only make sense for the sweep itself; they are not passed on to a sweep job's single run.
_SWEEP_ONLY_KEYS = (
    "hydra.mode",
    "hydra/launcher",
    "hydra/sweeper",
    "hydra.launcher",
    "hydra.sweeper",
    "hydra.sweep",
    "hydra.run",
    "hydra.output_subdir",
    "hydra.job.id",
    "hydra.job.num",
)


def sweep_job_command(hydra_cfg: DictConfig, python: str | None = None) -> list[str]:
    """The single-run command line that reproduces one multirun job in its own directory."""
    command = [python or sys.executable, "-m", "lightning_het.train"]
    for source in hydra_cfg.runtime.config_sources:
        uri = source.path if source.schema == "file" else f"{source.schema}://{source.path}"
        if source.provider == "main":
            command.append(f"--config-path={uri}")
        elif source.provider == "command-line":
            command.append(f"--config-dir={uri}")
    command.append(f"--config-name={hydra_cfg.job.config_name}")
    command += list(hydra_cfg.overrides.task)
    command += [o for o in hydra_cfg.overrides.hydra if not _is_sweep_only(o)]
    run_dir = str(hydra_cfg.runtime.output_dir).replace("\\", "\\\\").replace('"', '\\"')
    command += [f'hydra.run.dir="{run_dir}"', "hydra.output_subdir=null"]
    return command


def _is_sweep_only(override: str) -> bool:
    """Whether a Hydra override only concerns the sweep (not passed on to a job's single run).

    Example:
        >>> _is_sweep_only("hydra.sweep.dir=out"), _is_sweep_only("hydra/launcher=basic"), _is_sweep_only("seed=1")
        (True, True, False)
    """
    key = override.split("=", 1)[0].lstrip("+~").strip()
    return any(key == k or key.startswith(k + ".") for k in _SWEEP_ONLY_KEYS)


def run_sweep_job(cfg: DictConfig) -> dict[str, Any]:
    """Run this multirun job as a separate single run in the job's directory and return its metrics."""
    hydra_cfg = HydraConfig.get()
    command = sweep_job_command(hydra_cfg)
    output_dir = Path(hydra_cfg.runtime.output_dir)
    log.info("Sweep job %s: %s", hydra_cfg.job.num, " ".join(command))
    print(
        f"[sweep job {hydra_cfg.job.num}] {' '.join(hydra_cfg.overrides.task) or '(no overrides)'} -> {output_dir}",
        flush=True,
    )
    process = subprocess.Popen(command, cwd=hydra.utils.get_original_cwd())
    try:
        status = process.wait()
    except BaseException:
        _stop(process)
        raise
    if status != 0:
        raise SweepJobFailed(
            f"sweep job {hydra_cfg.job.num} ({' '.join(hydra_cfg.overrides.task)}) failed with exit status {status};"
            f" its messages are above, its files in {output_dir}",
            status,
        )
    path = output_dir / "metrics.json"
    if process_label() is not None:
        # another task of a job that SLURM (submitit) started on several tasks: rank 0's task reports the metrics
        return json.loads(path.read_text()) if path.is_file() else {}
    if not path.is_file():
        raise UserError(f"sweep job {hydra_cfg.job.num} finished but wrote no {path}")
    return json.loads(path.read_text())


class SweepJobFailed(UserError):
    """A sweep job's single run exited with a non-zero status (its own message is already printed)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
