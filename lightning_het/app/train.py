"""The Hydra app: ``python -m lightning_het.train [overrides]``, installed as ``lightning-het-train``.

:func:`train` does the work for one composed config (data module, model, strategy, trainer; fit, test, prediction
map; ``metrics.json`` from global rank 0). :func:`main` is the command line: Hydra composes the config from the
``conf/`` tree (:func:`lightning_het.app.config_dir`), and user errors end with one ``error: ...`` line and exit
status 2.

Under ``-m`` (multirun) each sweep job runs as a separate single run, ``python -m lightning_het.train <the job's
overrides> hydra.run.dir=<the job's directory>``: Lightning's popen launcher re-executes the command line for every
extra replica, and re-executing a *multirun* command line would start the whole sweep again in every replica. See
``docs/app.md`` ("Sweeps").

Exit status: 0 on success, 1 when Hydra cannot compose the config (its own message), 2 for a bad value or input file.
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig, ListConfig
from omegaconf.errors import OmegaConfBaseException

import lightning_het  # noqa: F401  (registers strategy="heterogeneous", in every process that runs this module)
from lightning_het.app import config_dir
from lightning_het.app.config import DataConfig, GradientAveraging, StrategyConfig, register_configs, validate_config
from lightning_het.errors import RasterNotFoundError
from lightning_het.reliability.output_dir import OutputDirError, check_output_dir

if TYPE_CHECKING:  # Lightning is imported only when a run starts, so that `--help` and config errors stay fast
    import lightning.pytorch as pl

    from lightning_het.app.callbacks import EpochTimer

__all__ = ["main", "sweep_job_command", "train", "unweighted_gradients"]

log = logging.getLogger(__name__)

register_configs()

#: Exit status of a run stopped by a user error (bad key, value or file); Hydra's own composition errors exit with 1.
USER_ERROR_EXIT = 2
#: Keys of the test metrics every ``metrics.json`` carries (fractions in [0, 1]).
REQUIRED_METRICS = ("test/oa", "test/aa", "test/kappa")
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


class UserError(Exception):
    """An error in the user's config or input, reported as one ``error:`` line (exit status 2)."""


# ----------------------------------------------------------------------------------------------------------- train
def train(cfg: DictConfig) -> dict[str, Any]:
    """Train, evaluate and map one composed config; write ``metrics.json`` from global rank 0.

    Args:
        cfg: the composed application config (``conf/train.yaml`` plus overrides). ``cfg.output_dir`` must resolve
            (outside a Hydra run, set it explicitly).

    Returns:
        The metrics written to ``metrics.json`` (every rank computes the same dictionary; only rank 0 writes it).

    Raises:
        UserError: for a config whose target cannot be built.
        lightning_het.app.config.ConfigValueError: for an impossible config value.
        FileNotFoundError: for a missing input file (a :class:`~lightning_het.errors.RasterNotFoundError`).
        ValueError: for bad input data or strategy arguments (the message names the file, key or value).
    """
    started = time.perf_counter()
    import lightning.pytorch as pl

    from lightning_het.app.callbacks import EpochTimer
    from lightning_het.hsi.prediction import PredictionMapWriter

    _quiet_known_warnings()
    strategy_cfg, data_cfg = validate_config(cfg)
    if strategy_cfg.start_method.value != "popen":
        raise UserError(
            f"You set `strategy.start_method={strategy_cfg.start_method.value}`, but the app needs `popen`: with"
            " spawn/fork the replicas' epoch times, prediction map and test details stay in the worker processes and"
            " metrics.json would miss them. HINT: leave `strategy.start_method=popen` (the default; sweeps are"
            " handled, see docs/app.md), or use HeterogeneousStrategy(start_method=...) from Python."
        )
    _check_cpu_replicas(cfg)
    test_ckpt = str(cfg.get("test_ckpt", "best"))
    if test_ckpt not in TEST_CKPT_CHOICES:
        raise UserError(
            f"You set `test_ckpt={test_ckpt}`, but it must be one of {list(TEST_CKPT_CHOICES)}. HINT: `test_ckpt=best`"
            " tests the weights of the best validation epoch, `test_ckpt=last` those of the last epoch."
        )
    output_dir = Path(str(cfg.output_dir)).absolute()
    _check_input_files(data_cfg)  # before anything is built: a typo in a path fails at once
    if os.environ.get("LOCAL_RANK", "0") == "0":  # unwritable, missing or full: one line, exit 2, no replica started
        check_output_dir(output_dir)
    ckpt_path = _checkpoint_to_resume(cfg)
    _configure_console_logging()

    if cfg.get("seed") is not None:
        pl.seed_everything(int(cfg.seed), workers=True, verbose=False)

    datamodule = _build_datamodule(data_cfg)
    model = _instantiate("model", cfg.model)
    if strategy_cfg.gradient_averaging == GradientAveraging.unweighted:
        unweighted_gradients(model)
    strategy = _build_strategy(strategy_cfg)
    timer = EpochTimer()
    callbacks: list[pl.Callback] = [timer]
    if cfg.get("prediction_map", True):
        callbacks.append(PredictionMapWriter(output_dir, name="prediction_map"))
    callbacks += _build_callbacks(cfg)
    trainer: pl.Trainer = _instantiate(
        "trainer",
        cfg.trainer,
        strategy=strategy,
        callbacks=callbacks,
        logger=_build_loggers(cfg),
        enable_checkpointing=_checkpointing(cfg, callbacks),
    )

    trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
    fit_seconds = time.perf_counter() - started
    tested = _test_checkpoint(trainer, test_ckpt)
    test_results = trainer.test(model, datamodule=datamodule, verbose=False, ckpt_path=tested.get("path"))
    prediction = _write_prediction_map(cfg, trainer, model, datamodule)

    metrics = _collect_metrics(trainer, test_results, timer, fit_seconds, time.perf_counter() - started)
    metrics["test_ckpt"] = tested
    metrics["prediction_map"] = prediction
    metrics["output_dir"] = str(output_dir)
    if trainer.is_global_zero:
        path = output_dir / "metrics.json"
        try:
            output_dir.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(metrics, indent=2, sort_keys=True, default=_json_default) + "\n")
        except OSError as err:  # e.g. the disk filled up during the run
            raise OutputDirError(f"Cannot write '{path}' ({err.strerror or type(err).__name__}).") from None
        print(_summary(trainer, metrics, path), flush=True)
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
    quiet = _process_label() is not None
    # lightning.* and the standalone pytorch_lightning/lightning_fabric packages each log through their own handler
    names = [""] + [n for n in logging.Logger.manager.loggerDict if n.split(".")[0] in _LIGHTNING_LOGGER_ROOTS]
    root_prints = any(_is_console(h) for h in logging.getLogger().handlers)
    for name in names:
        logger = logging.getLogger(name)
        if name and root_prints and logger.propagate:
            # the record also reaches the root logger's console handler (Hydra's): print it once, there
            for handler in [h for h in logger.handlers if _is_console(h)]:
                logger.removeHandler(handler)
        for handler in logger.handlers:
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                if not any(isinstance(f, _DropAdverts) for f in handler.filters):
                    handler.addFilter(_DropAdverts())
                if quiet:
                    handler.setLevel(logging.WARNING)


def _instantiate(group: str, node: DictConfig | dict[str, Any], **kwargs: Any) -> Any:
    """``hydra.utils.instantiate`` with an error that names the config group and the real cause.

    Arguments reach the object as plain ``dict``/``list`` (``_convert_="all"``), so that hyperparameters saved in
    checkpoints load with ``torch.load(weights_only=True)``, which Lightning uses when resuming.
    """
    target = node.get("_target_", "?")
    log.info("Instantiating %s <%s>", group, target)
    try:
        return hydra.utils.instantiate(node, _convert_="all", **kwargs)
    except hydra.errors.InstantiationException as err:
        cause = err.__cause__
        if cause is None:
            raise UserError(f"{group}: {err}") from err
        if isinstance(cause, (ValueError, FileNotFoundError)):
            raise UserError(f"{group} ({target}): {cause}") from err
        raise UserError(f"{group} ({target}): {type(cause).__name__}: {cause}") from err


def _build_datamodule(data_cfg: DataConfig) -> Any:
    kwargs = data_cfg.to_kwargs()
    for key in ("image", "labels"):
        if kwargs.get(key):
            kwargs[key] = _absolute(kwargs[key])
    datamodule = _instantiate("data", {"_target_": data_cfg._target_, **kwargs})
    # fail fast, in this process only, before any replica starts: missing files, mismatched grids
    datamodule.prepare_data()
    return datamodule


def _build_callbacks(cfg: DictConfig) -> list[Any]:
    """The ``callbacks`` group's callbacks (a mapping of name -> config, ``null`` entries skipped), then any given as
    ``trainer.callbacks`` (a list of configs): all of them are kept, none replaces another."""
    built = [
        _instantiate(f"callbacks.{name}", node)
        for name, node in (cfg.get("callbacks") or {}).items()
        if node is not None
    ]
    extra = cfg.trainer.get("callbacks")
    if extra:
        nodes = extra if isinstance(extra, ListConfig) else [extra]
        built += [_instantiate("trainer.callbacks", node) for node in nodes]
    return built


def _build_loggers(cfg: DictConfig) -> list[Any] | bool:
    """The ``logger`` group's loggers plus a ``trainer.logger`` config (one or a list); ``False`` when there is none,
    or when ``trainer.logger=false`` switches logging off altogether."""
    extra = cfg.trainer.get("logger")
    if extra is False:
        return False
    built = [_instantiate(f"logger.{name}", node) for name, node in (cfg.get("logger") or {}).items() if node]
    if isinstance(extra, (DictConfig, ListConfig)):
        nodes = extra if isinstance(extra, ListConfig) else [extra]
        built += [_instantiate("trainer.logger", node) for node in nodes]
    return built or False


def _checkpointing(cfg: DictConfig, callbacks: list[Any]) -> bool:
    """``trainer.enable_checkpointing``, or when it is null, whether a ``ModelCheckpoint`` is among the callbacks (so
    that ``callbacks=none`` writes no checkpoint at all, rather than Lightning's default one)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    value = cfg.trainer.get("enable_checkpointing")
    return any(isinstance(c, ModelCheckpoint) for c in callbacks) if value is None else bool(value)


def _checkpoint_to_resume(cfg: DictConfig) -> str | None:
    """``ckpt_path`` as an absolute path (relative to where the app was started), checked before anything starts."""
    value = cfg.get("ckpt_path")
    if value in (None, ""):
        return None
    path = _absolute(str(value))
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
    """Why ``path`` cannot be loaded as a checkpoint, or ``None`` when it can.

    A checkpoint in torch's zip format is checked without unpickling it (its archive and every member's CRC: catches
    truncated and overwritten files); any other file is loaded once with ``torch.load`` on the CPU.
    """
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


#: Values of ``test_ckpt``: the weights the test set and the prediction map are evaluated with.
TEST_CKPT_CHOICES = ("best", "last")


def _test_checkpoint(trainer: pl.Trainer, choice: str) -> dict[str, Any]:
    """Which weights to test (``test_ckpt``), as recorded in ``metrics.json``; ``path`` goes to ``trainer.test``.

    ``best``: the best checkpoint of the first ``ModelCheckpoint`` that monitors a metric and saved one (Lightning's
    ``ckpt_path="best"``, resolved here so that the record names the file); without one, the last epoch's weights.
    """
    record: dict[str, Any] = {"requested": choice, "used": "last", "path": None}
    if choice != "best":
        return record
    for callback in trainer.checkpoint_callbacks:
        best = getattr(callback, "best_model_path", "")
        if getattr(callback, "monitor", None) and best:
            score = callback.best_model_score
            record.update(
                used="best",
                path=str(best),
                monitor=callback.monitor,
                score=None if score is None else float(score),
            )
            return record
    record["note"] = "no checkpoint of a monitored metric (e.g. callbacks=none): the last epoch's weights"
    log.warning("test_ckpt=best, but %s; testing the last epoch's weights", record["note"].split(":")[0])
    return record


#: CPU replicas per core of a node above which the app refuses to start (between 1 and this, it warns).
MAX_CPU_REPLICAS_PER_CORE = 4


def _usable_cores() -> int:
    """Cores this process may run on (its CPU affinity, e.g. a container's or Slurm's allocation), else all."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _check_cpu_replicas(cfg: DictConfig) -> None:
    """Refuse far more CPU replicas on a node than it has cores; warn when there are more replicas than cores.

    A few more replicas than cores is what the default run does on a small machine (3 emulated replicas on 2 cores:
    they take turns, which only slows the run down); ``trainer.devices=64`` on 2 cores is a typo or a misunderstanding
    (64 processes, each with its own copy of the model and data) and is refused before any process starts.
    """
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


def _check_input_files(data_cfg: DataConfig) -> None:
    for role in ("image", "labels"):
        path = getattr(data_cfg, role)
        if path and not os.path.exists(_absolute(path)):
            raise RasterNotFoundError(path, role)


def _absolute(path: str) -> str:
    """A data path relative to where the app was started (also when ``hydra.job.chdir=true``)."""
    if HydraConfig.initialized():
        return hydra.utils.to_absolute_path(path)
    return os.path.abspath(path)


def unweighted_gradients(model: pl.LightningModule) -> pl.LightningModule:
    """Make ``model`` train with the 2020 code's *unweighted* gradient average (a baseline, biased).

    :class:`~lightning_het.HeterogeneousStrategy` multiplies each replica's loss by its ``loss_scale = W * b_r / B``
    before DDP's mean all-reduce, which yields the exact global-batch gradient ``sum_r (b_r / B) g_r``. Dividing the
    loss returned by ``training_step`` by that same public ``strategy.loss_scale`` cancels the weighting, so the update
    becomes ``(1 / W) sum_r g_r``: every replica's mean gradient counts equally, whatever its batch size. Logged losses
    are unchanged (they are logged inside ``training_step``). Valid with ``comm="allreduce"``.

    Args:
        model: the LightningModule; its ``training_step`` is wrapped in place (popen launches only: the wrapper is
            not picklable for ``spawn``).

    Returns:
        The same model.
    """
    original = model.training_step

    def training_step(*args: Any, **kwargs: Any) -> Any:
        output = original(*args, **kwargs)
        scale = float(getattr(model.trainer.strategy, "loss_scale", 1.0) or 1.0)
        if scale == 1.0:
            return output
        if isinstance(output, dict) and "loss" in output:
            return {**output, "loss": output["loss"] / scale}
        return output / scale

    model.training_step = training_step  # type: ignore[method-assign]
    return model


def _build_strategy(strategy_cfg: StrategyConfig) -> Any:
    return _instantiate("strategy", {"_target_": strategy_cfg._target_, **strategy_cfg.to_kwargs()})


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


# --------------------------------------------------------------------------------------------- outputs
def _write_prediction_map(cfg: DictConfig, trainer: pl.Trainer, model: Any, datamodule: Any) -> dict[str, str] | None:
    """Predict every pixel of the scene on all replicas; rank 0 writes the class map (GeoTIFF + PNG)."""
    if not cfg.get("prediction_map", True):
        return None
    from lightning_het.hsi.prediction import PredictionMapWriter

    writer = next(c for c in trainer.callbacks if isinstance(c, PredictionMapWriter))
    trainer.predict(model, datamodule=datamodule, return_predictions=False)
    return {path.suffix.lstrip("."): str(path) for path in writer.paths}


def _collect_metrics(
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


# --------------------------------------------------------------------------------------------- sweeps
def sweep_job_command(hydra_cfg: DictConfig, python: str | None = None) -> list[str]:
    """The single-run command line that reproduces one multirun job in its own directory.

    Args:
        hydra_cfg: ``HydraConfig.get()`` inside the job.
        python: the interpreter (default: ``sys.executable``).

    Returns:
        ``[python, "-m", "lightning_het.train", --config-path/--config-dir/--config-name as in the sweep, the job's
        overrides, the sweep's non-sweep Hydra overrides, hydra.run.dir=<job dir>, hydra.output_subdir=null]``.
    """
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
    key = override.split("=", 1)[0].lstrip("+~").strip()
    return any(key == k or key.startswith(k + ".") for k in _SWEEP_ONLY_KEYS)


def _run_sweep_job(cfg: DictConfig) -> dict[str, Any]:
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
    if _process_label() is not None:
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


# --------------------------------------------------------------------------------------------- command line
def _objective(cfg: DictConfig, metrics: dict[str, Any]) -> float | None:
    key = cfg.get("optimized_metric")
    if not key or not metrics:
        return None
    if key not in metrics:
        available = sorted(k for k, v in metrics.items() if isinstance(v, (int, float)))
        raise UserError(f"You set optimized_metric={key!r}, but the run has no such metric. HINT: one of {available}.")
    return float(metrics[key])


def _user_error_types() -> tuple[type[BaseException], ...]:
    """Exceptions that are the user's to fix (config, values, files): one ``error:`` line, no traceback."""
    types: tuple[type[BaseException], ...] = (
        UserError,
        ValueError,
        FileNotFoundError,
        OmegaConfBaseException,
        HydraException,
    )
    if "lightning.fabric" in sys.modules:  # Lightning's own config errors can only come once Lightning is imported
        from lightning.fabric.utilities.exceptions import MisconfigurationException

        types += (MisconfigurationException,)
    return types


def _error_text(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    if isinstance(err, OmegaConfBaseException):
        first = text.splitlines()[0]
        key = getattr(err, "full_key", None)
        if "Missing mandatory value" in first and key:
            return f"You did not set `{key}`, which this config requires. HINT: add `{key}=...` to the command line."
        return f"{first} (key: {key})" if key else first
    return text


def _process_label() -> str | None:
    """``None`` in the job's first process (global rank 0 or not distributed), else a label such as ``rank 2``.

    Read from the environment that the launchers set (``RANK`` from torchrun, ``SLURM_PROCID`` from srun, ``NODE_RANK``
    and ``LOCAL_RANK`` from Lightning's own launcher), so that it also works before the trainer exists.
    """
    env = os.environ
    if env.get("RANK", "").isdigit():
        return None if env["RANK"] == "0" else f"rank {env['RANK']}"
    if env.get("SLURM_PROCID", "").isdigit() and env.get("SLURM_NTASKS", "1") != "1":
        return None if env["SLURM_PROCID"] == "0" else f"rank {env['SLURM_PROCID']}"
    node, local = env.get("NODE_RANK", "0"), env.get("LOCAL_RANK", "0")
    if node in ("", "0") and local in ("", "0"):
        return None
    return f"node {node} local rank {local}"


def _report(err: BaseException) -> None:
    label = _process_label()
    prefix = "error: " if label is None else f"error: [{label}] "
    lines = _error_text(err).splitlines() or [type(err).__name__]
    sys.stderr.write(prefix + "\n       ".join(lines) + "\n")
    sys.stderr.flush()


def _release_process_group() -> None:
    """Destroy the default process group once the run is over, as torch asks programs to before they exit (leaving it
    to interpreter shutdown races the backend's threads against the destruction of its objects)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="train")
def _hydra_main(cfg: DictConfig) -> float | None:
    try:
        if HydraConfig.get().mode == RunMode.MULTIRUN:
            metrics = _run_sweep_job(cfg)
        else:
            metrics = train(cfg)
            _release_process_group()
        return _objective(cfg, metrics)
    except _user_error_types() as err:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        _report(err)
        sys.exit(err.status if isinstance(err, SweepJobFailed) and err.status > 0 else USER_ERROR_EXIT)


def main() -> None:
    """Console entry point (``lightning-het-train``): compose the config from the command line and run it.

    Exit status: 0 on success, 1 for a config Hydra cannot compose (bad key, type or choice, with Hydra's message),
    2 for a bad value or input file (one ``error: ...`` line on stderr; set ``HYDRA_FULL_ERROR=1`` for the traceback).
    """
    _hydra_main()


if __name__ == "__main__":
    main()
