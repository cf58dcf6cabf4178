"""Builds a run's parts from the composed config: data module, model wrapper, strategy, callbacks, loggers, trainer."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import hydra
from omegaconf import DictConfig, ListConfig

from lightning_het.app.checks import absolute
from lightning_het.app.config import DataConfig, StrategyConfig
from lightning_het.app.messages import UserError

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["build_datamodule", "build_trainer", "instantiate", "unweighted_gradients"]

log = logging.getLogger(__name__)


def instantiate(group: str, node: DictConfig | dict[str, Any], **kwargs: Any) -> Any:
    """``hydra.utils.instantiate`` with an error that names the config group and the real cause.

    ``_convert_="all"`` passes plain ``dict``/``list``, so saved hyperparameters load with ``weights_only=True``.
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


def build_datamodule(data_cfg: DataConfig) -> Any:
    kwargs = data_cfg.to_kwargs()
    for key in ("image", "labels"):
        if kwargs.get(key):
            kwargs[key] = absolute(kwargs[key])
    datamodule = instantiate("data", {"_target_": data_cfg._target_, **kwargs})
    # fail fast, in this process only, before any replica starts: missing files, mismatched grids
    datamodule.prepare_data()
    return datamodule


def build_trainer(cfg: DictConfig, strategy_cfg: StrategyConfig, callbacks: list[Any]) -> pl.Trainer:
    """The ``trainer`` config's trainer with the strategy, ``callbacks`` then the config's own ones, and the loggers."""
    node, emulation = strategy_cfg.to_node()  # the typed form (comm=NodeLocal(...), ...) of the flat config keys
    if node["_target_"] == "lightning_het.HeterogeneousFSDPStrategy":  # the DDP keys at their defaults: not passed
        ddp = {"comm": "lightning_het.Auto", "device_map": None, "cpu_threads": None, "start_method": "popen"}
        ddp["find_unused_parameters"] = False
        plain = {k: v.get("_target_") if isinstance(v, dict) else v for k, v in node.items()}
        node = {k: v for k, v in node.items() if k not in ddp or plain[k] != ddp[k]}
    strategy = instantiate("strategy", node)
    if emulation:  # `strategy.emulate_slowdown` / `strategy.emulate_memory_cap`: the EmulatedPlatform callback
        from lightning_het.emulation import EmulatedPlatform

        callbacks = [EmulatedPlatform(**emulation), *callbacks]
    callbacks = callbacks + _build_callbacks(cfg)
    return instantiate(
        "trainer",
        cfg.trainer,
        strategy=strategy,
        callbacks=callbacks,
        logger=_build_loggers(cfg),
        enable_checkpointing=_checkpointing(cfg, callbacks),
    )


def _build_callbacks(cfg: DictConfig) -> list[Any]:
    """The ``callbacks`` group's callbacks (``null`` skipped), then any ``trainer.callbacks`` configs: all kept."""
    built = [
        instantiate(f"callbacks.{name}", node)
        for name, node in (cfg.get("callbacks") or {}).items()
        if node is not None
    ]
    extra = cfg.trainer.get("callbacks")
    if extra:
        nodes = extra if isinstance(extra, ListConfig) else [extra]
        built += [instantiate("trainer.callbacks", node) for node in nodes]
    return built


def _build_loggers(cfg: DictConfig) -> list[Any] | bool:
    """The ``logger`` group's loggers plus ``trainer.logger`` configs; ``False`` when none or switched off."""
    extra = cfg.trainer.get("logger")
    if extra is False:
        return False
    built = [instantiate(f"logger.{name}", node) for name, node in (cfg.get("logger") or {}).items() if node]
    if isinstance(extra, (DictConfig, ListConfig)):
        nodes = extra if isinstance(extra, ListConfig) else [extra]
        built += [instantiate("trainer.logger", node) for node in nodes]
    return built or False


def _checkpointing(cfg: DictConfig, callbacks: list[Any]) -> bool:
    """``trainer.enable_checkpointing``, or when null, whether a ``ModelCheckpoint`` is among the callbacks."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    value = cfg.trainer.get("enable_checkpointing")
    return any(isinstance(c, ModelCheckpoint) for c in callbacks) if value is None else bool(value)


def unweighted_gradients(model: pl.LightningModule) -> pl.LightningModule:
    """Make ``model`` train with the 2020 code's *unweighted* gradient average (a baseline, biased).

    Dividing the loss by ``strategy.loss_scale`` (``W * b_r / B``) cancels the strategy's weighting, so the update is
    ``(1 / W) sum_r g_r``. Valid with ``comm="allreduce"``; the wrapper is not picklable for ``spawn``.
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
