"""A job's identity: what must match for a checkpoint to be an exact continuation of this fit.

``resume="auto"`` resumes only a checkpoint whose ``checkpoint["lightning_het"]["job"]`` equals this fit's
:func:`job_identity` (see ``docs/reliability.md``). The identity is a flat mapping of readable settings, of plain types
(it loads with ``torch.load(..., weights_only=True)``), so that a difference names the setting.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

#: the comm modes whose optimizer steps are the same (exact gradient of the global batch)
_EXACT_MODES = ("allreduce", "hierarchical")
#: the ``node_local`` settings that change its trajectory
_NODE_LOCAL_SETTINGS = ("global_sync_every", "comm_warmup_steps", "outer_lr", "outer_momentum", "sync_dtype",
                        "merge_weights")  # fmt: skip


def _plain(value: Any) -> Any:
    """``value`` as a plain, comparable type (a tensor's number, a tuple's list, anything else's ``repr``)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return repr(value)


def model_signature(module: torch.nn.Module) -> str:
    """The module's class and a digest of its state's names, shapes and dtypes (not its values)."""
    entries = [f"{name}:{tuple(t.shape)}:{t.dtype}" for name, t in module.state_dict().items()]
    digest = hashlib.sha1("\n".join(entries).encode()).hexdigest()[:12]
    return f"{type(module).__name__} {digest}"


def job_identity(
    module: torch.nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    schedulers: Sequence[Any],
    settings: Mapping[str, Any],
) -> dict[str, Any]:
    """This fit's identity: the model's :func:`model_signature`, every optimizer's class and its param groups'
    hyperparameters as configured (a scheduler's ``initial_lr`` for ``lr``), every scheduler's class, and
    ``settings`` (the other settings that change the trajectory). Call it once the optimizers exist, before a
    checkpoint's state is loaded into them."""
    identity: dict[str, Any] = {"model": model_signature(module)}
    for index, optimizer in enumerate(optimizers):
        identity[f"optimizer {index}"] = type(optimizer).__name__
        for number, group in enumerate(optimizer.param_groups):
            for key, value in sorted(group.items()):
                if key in ("params", "initial_lr") or (key == "lr" and "initial_lr" in group):
                    continue
                identity[f"optimizer {index} group {number} {key}"] = _plain(value)
            if "initial_lr" in group:
                identity[f"optimizer {index} group {number} lr"] = _plain(group["initial_lr"])
    for index, scheduler in enumerate(schedulers):
        identity[f"scheduler {index}"] = type(scheduler).__name__
    identity.update({key: _plain(value) for key, value in settings.items()})
    return identity


def trajectory_settings(config: Any, mode: str, trainer: Any) -> dict[str, Any]:
    """The strategy's and the Trainer's settings that change the trajectory (not the replicas, their speeds or the
    micro-batching, which do not): the comm mode (``"exact"`` for ``allreduce`` and ``hierarchical``) and, in
    ``node_local``, its settings; gradient accumulation and clipping; the precision."""
    settings: dict[str, Any] = {"comm": "exact" if mode in _EXACT_MODES else mode}
    if mode == "node_local":
        outer = getattr(config, "outer_optimizer", None)
        settings["outer_optimizer"] = outer if outer is None or isinstance(outer, str) else repr(outer)
        settings.update({key: getattr(config, key, None) for key in _NODE_LOCAL_SETTINGS})
    settings["accumulate_grad_batches"] = int(trainer.accumulate_grad_batches)
    settings["gradient_clip_val"] = trainer.gradient_clip_val
    settings["gradient_clip_algorithm"] = trainer.gradient_clip_algorithm
    settings["precision"] = str(trainer.precision)
    return settings


def identity_differences(saved: Mapping[str, Any] | None, now: Mapping[str, Any]) -> list[str]:
    """What differs between a checkpoint's identity ``saved`` and this fit's ``now``, one ``"<setting> <saved> ->
    <now>"`` each (``None``: a checkpoint written without one). Pure."""
    if saved is None:
        return ["no job identity (written by another strategy or an older lightning-het)"]
    missing = object()
    return [
        f"{key} {saved.get(key)!r} -> {now.get(key)!r}"
        for key in dict.fromkeys([*now, *saved])
        if saved.get(key, missing) != now.get(key, missing)
    ]
