"""Builds a run's parts from the composed config: data module, model wrapper, strategy, callbacks, loggers, trainer.

Every object comes from ``hydra.utils.instantiate``; a config that cannot be built ends as a
:class:`~lightning_het.app.messages.UserError` naming the config group and the real cause.
"""

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


def build_datamodule(data_cfg: DataConfig) -> Any:
    kwargs = data_cfg.to_kwargs()
    for key in ("image", "labels"):
        if kwargs.get(key):
            kwargs[key] = absolute(kwargs[key])
    datamodule = instantiate("data", {"_target_": data_cfg._target_, **kwargs})
    # fail fast, in this process only, before any replica starts: missing files, mismatched grids
    datamodule.prepare_data()
    return datamodule


def _build_strategy(strategy_cfg: StrategyConfig) -> Any:
    return instantiate("strategy", {"_target_": strategy_cfg._target_, **strategy_cfg.to_kwargs()})


def build_trainer(cfg: DictConfig, strategy_cfg: StrategyConfig, callbacks: list[Any]) -> pl.Trainer:
    """The ``trainer`` config's trainer with the strategy, ``callbacks`` then the config's own ones, and the loggers."""
    strategy = _build_strategy(strategy_cfg)
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
    """The ``callbacks`` group's callbacks (a mapping of name -> config, ``null`` entries skipped), then any given as
    ``trainer.callbacks`` (a list of configs): all of them are kept, none replaces another."""
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
    """The ``logger`` group's loggers plus a ``trainer.logger`` config (one or a list); ``False`` when there is none,
    or when ``trainer.logger=false`` switches logging off altogether."""
    extra = cfg.trainer.get("logger")
    if extra is False:
        return False
    built = [instantiate(f"logger.{name}", node) for name, node in (cfg.get("logger") or {}).items() if node]
    if isinstance(extra, (DictConfig, ListConfig)):
        nodes = extra if isinstance(extra, ListConfig) else [extra]
        built += [instantiate("trainer.logger", node) for node in nodes]
    return built or False


def _checkpointing(cfg: DictConfig, callbacks: list[Any]) -> bool:
    """``trainer.enable_checkpointing``, or when it is null, whether a ``ModelCheckpoint`` is among the callbacks (so
    that ``callbacks=none`` writes no checkpoint at all, rather than Lightning's default one)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    value = cfg.trainer.get("enable_checkpointing")
    return any(isinstance(c, ModelCheckpoint) for c in callbacks) if value is None else bool(value)


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
