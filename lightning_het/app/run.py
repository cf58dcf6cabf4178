"""One run of the app: train, test and map one composed config, and write ``metrics.json`` (:func:`train`)."""

from __future__ import annotations

import logging
import os
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig

import lightning_het  # noqa: F401  (registers strategy="heterogeneous", in every process that runs this module)
from lightning_het.app.build import build_datamodule, build_trainer, instantiate, unweighted_gradients
from lightning_het.app.checks import (
    check_cpu_replicas,
    check_input_files,
    check_start_method,
    check_test_ckpt,
    checkpoint_to_resume,
)
from lightning_het.app.config import GradientAveraging, validate_config
from lightning_het.app.messages import process_label
from lightning_het.app.outputs import collect_metrics, write_metrics, write_prediction_map
from lightning_het.reliability.output_dir import check_output_dir

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["train"]

log = logging.getLogger(__name__)


def train(cfg: DictConfig) -> dict[str, Any]:
    """Train, evaluate and map one composed config; write ``metrics.json`` from global rank 0."""
    started = time.perf_counter()
    import lightning.pytorch as pl

    from lightning_het.app.callbacks import EpochTimer
    from lightning_het.hsi.prediction import PredictionMapWriter

    _quiet_known_warnings()
    strategy_cfg, data_cfg = validate_config(cfg)
    check_start_method(strategy_cfg)
    check_cpu_replicas(cfg)
    test_ckpt = check_test_ckpt(cfg)
    output_dir = Path(str(cfg.output_dir)).absolute()
    check_input_files(data_cfg)  # before anything is built: a typo in a path fails at once
    if os.environ.get("LOCAL_RANK", "0") == "0":  # unwritable, missing or full: one line, exit 2, no replica started
        check_output_dir(output_dir)
    ckpt_path = checkpoint_to_resume(cfg)
    _configure_console_logging()

    if cfg.get("seed") is not None:
        pl.seed_everything(int(cfg.seed), workers=True, verbose=False)

    datamodule = build_datamodule(data_cfg)
    model = instantiate("model", cfg.model)
    if strategy_cfg.gradient_averaging == GradientAveraging.unweighted:
        unweighted_gradients(model)
    timer = EpochTimer()
    callbacks: list[pl.Callback] = [timer]
    if cfg.get("prediction_map", True):
        callbacks.append(PredictionMapWriter(output_dir, name="prediction_map"))
    trainer = build_trainer(cfg, strategy_cfg, callbacks)

    trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
    fit_seconds = time.perf_counter() - started
    tested = _test_checkpoint(trainer, test_ckpt)
    test_results = trainer.test(model, datamodule=datamodule, verbose=False, ckpt_path=tested.get("path"))
    prediction = write_prediction_map(cfg, trainer, model, datamodule)

    metrics = collect_metrics(trainer, test_results, timer, fit_seconds, time.perf_counter() - started)
    metrics["test_ckpt"] = tested
    metrics["prediction_map"] = prediction
    metrics["output_dir"] = str(output_dir)
    if trainer.is_global_zero:
        write_metrics(trainer, metrics, output_dir)
    return metrics


def _quiet_known_warnings() -> None:
    """Silence warnings that are wrong or irrelevant for this app (each line says why)."""
    # Lightning 2.6 calls a pytree API that torch 2.13 deprecates; nothing to act on here
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
    # the strategy evaluates every sample exactly once (unpadded shares), which this generic advice does not know
    warnings.filterwarnings("ignore", message=r".*Using `DistributedSampler` with the dataloaders")
    # patches come from memory; extra loader workers would only compete with the replicas for the CPU cores
    warnings.filterwarnings("ignore", message=r".*does not have many workers")


_LIGHTNING_LOGGER_ROOTS = ("lightning", "pytorch_lightning", "lightning_fabric")


class _DropAdverts(logging.Filter):
    """Drop Lightning's product tips from the console (they are not about this run)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("\N{ELECTRIC LIGHT BULB} Tip:")


def _is_console(handler: logging.Handler) -> bool:
    return isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler)


def _configure_console_logging() -> None:
    """Rank 0 logs to the console at INFO; the other replicas only warnings (their log files keep everything)."""
    quiet = process_label() is not None
    # lightning.* and the standalone pytorch_lightning/lightning_fabric packages each log through their own handler
    names = [""] + [n for n in logging.Logger.manager.loggerDict if n.split(".")[0] in _LIGHTNING_LOGGER_ROOTS]
    root_prints = any(_is_console(h) for h in logging.getLogger().handlers)
    for name in names:
        logger = logging.getLogger(name)
        consoles = [h for h in logger.handlers if _is_console(h)]
        if name and root_prints and (logger.propagate or consoles):
            # print each record once, through the root logger's handlers (Hydra's console and the job's log file):
            # Lightning imported before Hydra set up logging (importing lightning_het imports it) gave its logger a
            # console handler of its own and stopped it propagating
            for handler in consoles:
                logger.removeHandler(handler)
            logger.propagate = True
        for handler in logger.handlers:
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                if not any(isinstance(f, _DropAdverts) for f in handler.filters):
                    handler.addFilter(_DropAdverts())
                if quiet:
                    handler.setLevel(logging.WARNING)


def _test_checkpoint(trainer: pl.Trainer, choice: str) -> dict[str, Any]:
    """Which weights to test (``test_ckpt``), as recorded in ``metrics.json``; ``path`` goes to ``trainer.test``."""
    record: dict[str, Any] = {"requested": choice, "used": "last", "path": None}
    if choice != "best":
        return record
    for callback in trainer.checkpoint_callbacks:
        best = getattr(callback, "best_model_path", "")
        if getattr(callback, "monitor", None) and best:
            score = callback.best_model_score
            record.update(
                used="best", path=str(best), monitor=callback.monitor, score=None if score is None else float(score)
            )
            return record
    record["note"] = "no checkpoint of a monitored metric (e.g. callbacks=none): the last epoch's weights"
    log.warning("test_ckpt=best, but %s; testing the last epoch's weights", record["note"].split(":")[0])
    return record
