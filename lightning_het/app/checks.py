"""Checks of a run's config and inputs made before anything is built or any replica starts (each a ``UserError``)."""

from __future__ import annotations

import logging
import os

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from lightning_het.app.config import DataConfig, StrategyConfig
from lightning_het.app.messages import UserError

__all__ = [
    "MAX_CPU_REPLICAS_PER_CORE",
    "TEST_CKPT_CHOICES",
    "absolute",
    "check_cpu_replicas",
    "check_input_files",
    "check_start_method",
    "check_test_ckpt",
    "checkpoint_to_resume",
]

log = logging.getLogger(__name__)

#: Values of ``test_ckpt``: the weights the test set and the prediction map are evaluated with.
TEST_CKPT_CHOICES = ("best", "last")


#: CPU replicas per core of a node above which the app refuses to start (between 1 and this, it warns).
MAX_CPU_REPLICAS_PER_CORE = 4


def check_start_method(strategy_cfg: StrategyConfig) -> None:
    """Refuse a start method other than ``popen``: the app reads the replicas' results in the launching process."""
    if strategy_cfg.start_method.value != "popen":
        raise UserError(
            f"You set `strategy.start_method={strategy_cfg.start_method.value}`, but the app needs `popen`: with"
            " spawn/fork the replicas' epoch times, prediction map and test details stay in the worker processes and"
            " metrics.json would miss them. HINT: leave `strategy.start_method=popen` (the default; sweeps are"
            " handled, see docs/app.md), or use HeterogeneousStrategy(start_method=...) from Python."
        )


def check_test_ckpt(cfg: DictConfig) -> str:
    """``test_ckpt`` (default ``best``), one of :data:`TEST_CKPT_CHOICES`."""
    test_ckpt = str(cfg.get("test_ckpt", "best"))
    if test_ckpt not in TEST_CKPT_CHOICES:
        raise UserError(
            f"You set `test_ckpt={test_ckpt}`, but it must be one of {list(TEST_CKPT_CHOICES)}. HINT: `test_ckpt=best`"
            " tests the weights of the best validation epoch, `test_ckpt=last` those of the last epoch."
        )
    return test_ckpt


def checkpoint_to_resume(cfg: DictConfig) -> str | None:
    """``ckpt_path`` as an absolute path (relative to where the app was started), checked before anything starts."""
    value = cfg.get("ckpt_path")
    if value in (None, ""):
        return None
    path = absolute(str(value))
    if not os.path.isfile(path):
        raise UserError(
            f"You set `ckpt_path={value}`, but there is no such file ({path}). HINT: give a checkpoint written by an"
            " earlier run, e.g. `<its output directory>/checkpoints/last.ckpt`."
        )
    problem = _unreadable_checkpoint(path)
    if problem is not None:
        raise UserError(
            f"You set `ckpt_path={value}`, but {path} is not a readable checkpoint ({problem}). HINT: it may be"
            " truncated (a run stopped while writing it) or not a checkpoint; give another one, e.g. the run's"
            " `checkpoints/last.ckpt` or an epoch checkpoint."
        )
    return path


def _unreadable_checkpoint(path: str) -> str | None:
    """Why ``path`` cannot be loaded as a checkpoint, or ``None`` when it can."""
    import zipfile

    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                bad = archive.testzip()
                if bad is not None:
                    return f"corrupt entry {bad!r}"
                if not any(name.endswith("data.pkl") for name in archive.namelist()):
                    return "a zip archive without torch's data.pkl"
            return None
        import torch

        torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # whatever the reason, it cannot be resumed from
        return f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else 'unreadable'}"
    return None


def _usable_cores() -> int:
    """Cores this process may run on (its CPU affinity, e.g. a container's or Slurm's allocation), else all."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def check_cpu_replicas(cfg: DictConfig) -> None:
    """Refuse far more CPU replicas on a node than it has cores; warn when there are more replicas than cores."""
    trainer = cfg.get("trainer")
    if not isinstance(trainer, DictConfig) or trainer.get("accelerator") != "cpu":
        return
    devices = trainer.get("devices")
    if isinstance(devices, bool) or not isinstance(devices, int):
        return
    cores = _usable_cores()
    if devices > MAX_CPU_REPLICAS_PER_CORE * cores:
        raise UserError(
            f"You set `trainer.devices={devices}` CPU replicas, but this node has {cores} usable core(s): more than"
            f" {MAX_CPU_REPLICAS_PER_CORE} replicas per core only take turns on the cores and multiply the memory"
            f" used. HINT: use `trainer.devices={cores}` (one replica per core); at most"
            f" {MAX_CPU_REPLICAS_PER_CORE * cores} are accepted on this node."
        )
    if devices > cores and os.environ.get("LOCAL_RANK", "0") == "0":
        log.warning(
            "%d CPU replicas on %d usable core(s): the replicas take turns on the cores, so epoch times measure the"
            " sharing as well as the (emulated) speeds",
            devices,
            cores,
        )


def check_input_files(data_cfg: DataConfig) -> None:
    from lightning_het.hsi.errors import RasterNotFoundError  # hsi/ imports rasterio: not for `--help`

    for role in ("image", "labels"):
        path = getattr(data_cfg, role)
        if path and not os.path.exists(absolute(path)):
            raise RasterNotFoundError(path, role)


def absolute(path: str) -> str:
    """A data path relative to where the app was started (also when ``hydra.job.chdir=true``)."""
    if HydraConfig.initialized():
        return hydra.utils.to_absolute_path(path)
    return os.path.abspath(path)
