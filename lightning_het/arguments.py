"""The validators of the strategy's keywords, shared by its constructor and the app's schema (no torch)."""

from __future__ import annotations

import difflib
import inspect
import math
import numbers
import operator
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any


class ArgumentError(ValueError):
    """A strategy keyword has an impossible value; ``argument`` names the keyword (without an index)."""

    def __init__(self, argument: str, message: str) -> None:
        super().__init__(message)
        self.argument = argument


def _error(name: str, message: str) -> ArgumentError:
    return ArgumentError(name.split("[", 1)[0], message)


def positive_int(name: str, value: Any, *, allow_none: bool = True, minimum: int = 1) -> int | None:
    """``value`` as an ``int >= minimum`` (any integer type, not ``bool``); ``None`` stays ``None`` if allowed."""
    if value is None and allow_none:
        return None
    try:
        number = None if isinstance(value, bool) else operator.index(value)  # int, NumPy integers, ...
    except TypeError:
        number = None
    if number is None or number < minimum:
        raise _error(name, f"Expected argument `{name}` to be an integer >= {minimum}, but got {value!r}.")
    return number


def finite_positive_list(name: str, values: Sequence[float] | None) -> list[float] | None:
    """``values`` as a non-empty list of finite floats ``> 0``; ``None`` stays ``None``."""
    if values is None:
        return None
    expected = f"Expected argument `{name}` to be a sequence of numbers"
    if isinstance(values, (str, bytes)):  # "1,3" would otherwise be read character by character
        raise _error(name, f"{expected}, but got the string {values!r}.")
    if isinstance(values, Mapping):  # a dict would otherwise be read as its keys
        hint = f"HINT: list the values in rank order, e.g. {list(values.values())!r}."
        raise _error(name, f"{expected} (one per replica), but got the mapping {values!r}. {hint}")
    try:
        values = list(values)  # e.g. an omegaconf ListConfig
    except TypeError:
        raise _error(name, f"{expected}, but got {values!r}.") from None
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, numbers.Real):  # True would count as 1, "2" as 2.0
            raise _error(name, f"Expected argument `{name}` to hold real numbers, but `{name}[{i}]` is {v!r}.")
        if not math.isfinite(v) or v <= 0:
            raise _error(
                name,
                f"Expected argument `{name}` to hold finite numbers > 0.0, but `{name}[{i}]` is {v!r}"
                f" ({name}={values}).",
            )
    if not values:
        raise _error(name, f"Expected argument `{name}` to be non-empty.")
    return [float(v) for v in values]


def int_list(name: str, values: Any, alternatives: str = "") -> list[int] | None:
    """``values`` as a non-empty list of integers ``>= 1`` (one per replica); ``None`` stays ``None``."""
    if values is None:
        return None
    expected = f"Expected argument `{name}` to be a list of integers >= 1 (one per replica){' ' * bool(alternatives)}"
    if isinstance(values, (str, bytes, int, float)):
        raise _error(name, f"{expected}{alternatives}, but got {values!r}.")
    try:
        items = list(values)
    except TypeError:
        raise _error(name, f"{expected}{alternatives}, but got {values!r}.") from None
    if not items:
        raise _error(name, f"{expected}{alternatives}, but got an empty list.")
    return [positive_int(f"{name}[{i}]", v, allow_none=False) for i, v in enumerate(items)]  # type: ignore[misc]


def slowdown_factors(name: str, values: Any) -> list[float] | None:
    """Emulated slowdowns: one finite factor ``>= 1`` per replica; ``None`` stays ``None``."""
    slowdown = finite_positive_list(name, values)
    if slowdown is not None and any(f < 1.0 for f in slowdown):
        raise _error(
            name,
            f"Expected argument `{name}` to hold factors >= 1 (a replica can only be slowed down), but got {slowdown}.",
        )
    return slowdown


def as_timeout(name: str, value: Any) -> timedelta | None:
    """A timeout given as seconds or a ``timedelta``, as a positive ``timedelta``; ``None`` stays ``None``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, timedelta)):
        raise _error(
            name,
            f"Expected argument `{name}` to be seconds (a number) or a datetime.timedelta, but got {value!r}"
            f" ({type(value).__name__}).",
        )
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if not math.isfinite(seconds) or seconds <= 0:
        raise _error(name, f"Expected argument `{name}` to be a positive duration, but got {value!r}.")
    return value if isinstance(value, timedelta) else timedelta(seconds=seconds)


def validate_resume(value: Any) -> str | bool | None:
    """``resume``: ``"auto"``, ``None`` (only a restarted elastic worker resumes) or ``False`` (never)."""
    if value is None or value is False or value == "auto":
        return value
    raise _error(
        "resume",
        "Expected argument `resume` to be 'auto' (resume from the newest emergency, preemption or last checkpoint),"
        f" None (only a restarted torchelastic worker resumes) or False (never), but got {value!r}.",
    )


#: ``comm="node_local"``'s sync keywords and their defaults (the only values accepted in the other modes)
SYNC_DEFAULTS: dict[str, Any] = {
    "outer_optimizer": None,
    "outer_lr": 0.7,
    "outer_momentum": 0.9,
    "sync_dtype": "float32",
    "merge_weights": "samples",
}


def check_sync_args(
    outer_optimizer: Any,
    outer_lr: Any,
    outer_momentum: Any,
    sync_dtype: Any,
    merge_weights: Any,
    *,
    comm: str = "node_local",
) -> None:
    """``comm="node_local"``'s sync keywords; a value other than the default is refused where nothing reads it (another
    ``comm`` mode; ``outer_lr`` / ``outer_momentum`` without ``outer_optimizer="nesterov"``)."""
    if not (outer_optimizer is None or outer_optimizer == "nesterov" or callable(outer_optimizer)):
        raise _error(
            "outer_optimizer",
            "Expected argument `outer_optimizer` to be None (plain averaging), one of ['nesterov'] or a"
            f" callable building a torch optimizer from a list of tensors, but got {outer_optimizer!r}.",
        )
    for name, value, rule in (("outer_lr", outer_lr, "> 0"), ("outer_momentum", outer_momentum, "in [0, 1)")):
        ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
        if not ok or (value <= 0 if name == "outer_lr" else not 0 <= value < 1):
            raise _error(name, f"Expected argument `{name}` to be a finite number {rule}, but got {value!r}.")
    for name, value, choices in (
        ("sync_dtype", sync_dtype, ["float32", "bfloat16", "int8"]),
        ("merge_weights", merge_weights, ["samples", "nodes"]),
    ):
        if value not in choices:
            raise _error(name, f"Expected argument `{name}` to be one of {choices}, but got {value!r}.")
    given = dict(zip(SYNC_DEFAULTS, (outer_optimizer, outer_lr, outer_momentum, sync_dtype, merge_weights)))
    # a callable is never a default
    changed = [
        n for n, v in given.items() if not (v is SYNC_DEFAULTS[n] or (not callable(v) and v == SYNC_DEFAULTS[n]))
    ]
    if comm != "node_local" and changed:
        name = changed[0]
        resolves = " (which resolves to 'hierarchical' or 'allreduce', never to 'node_local')" if comm == "auto" else ""
        raise _error(
            name,
            f"You set `{name}={given[name]!r}`, but it only applies to `comm='node_local'`, and `comm={comm!r}`"
            f"{resolves} would ignore it. HINT: pass comm='node_local' (with `node_ids` or several nodes), or drop"
            f" `{name}`.",
        )
    for name in ("outer_lr", "outer_momentum"):
        if name in changed and outer_optimizer != "nesterov":
            what = "plain averaging, which has no outer optimizer" if outer_optimizer is None else "a callable"
            raise _error(
                name,
                f"You set `{name}={given[name]!r}`, but `outer_optimizer={outer_optimizer!r}` ({what}) would ignore"
                f" it: it sets the optimizer of `outer_optimizer='nesterov'` only. HINT: pass"
                f" outer_optimizer='nesterov', or set the learning rate and momentum in your callable.",
            )


def _named_parameters(function: Callable[..., Any]) -> set[str]:
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p.name for p in inspect.signature(function).parameters.values() if p.kind in kinds} - {"self"}


def check_ddp_keywords(strategy_cls: type, own: Sequence[str], kwargs: dict[str, Any]) -> None:
    """Each keyword passed on to ``DDPStrategy`` must be one of its or ``DistributedDataParallel``'s parameters, and
    ``process_group_backend`` a backend torch knows (:class:`ArgumentError` with the closest known name)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    bases = ("DDPStrategy", "ModelParallelStrategy")
    ddp_cls = next((c for c in strategy_cls.__mro__ if c.__name__ in bases), None)
    known = _named_parameters(ddp_cls.__init__) if ddp_cls is not None else set()  # type: ignore[misc]
    if ddp_cls is None or ddp_cls.__name__ == "DDPStrategy":
        known |= _named_parameters(DistributedDataParallel.__init__) - {"module", "device_ids"}  # set by Lightning
    for name in [name for name in kwargs if name not in known]:
        close = difflib.get_close_matches(name, sorted(known | set(own)), n=1)
        if name in ("module", "device_ids"):
            hint = "the strategy sets it when it wraps the model (one device per replica); drop it."
        elif close:
            hint = f"did you mean `{close[0]}`?"
        else:
            hint = "see the keywords of `DDPStrategy` and of `DistributedDataParallel`."
        raise ArgumentError(
            name,
            f"`{strategy_cls.__name__}` got an unexpected keyword argument `{name}`={kwargs[name]!r}: it is not a"
            f" keyword of the strategy, of Lightning's `DDPStrategy`, nor of torch's `DistributedDataParallel`"
            f" (which receives the extra keywords). HINT: {hint}",
        )
    backend = kwargs.get("process_group_backend")
    if backend is not None:
        allowed = sorted({str(b).lower() for b in dist.Backend.backend_list} - {"undefined"})  # registered ones too
        if not isinstance(backend, str) or backend.lower() not in allowed:
            raise ArgumentError(
                "process_group_backend",
                f"Expected argument `process_group_backend` to be one of {allowed} (or a backend registered with"
                f" `torch.distributed.Backend.register_backend`), but got {backend!r}. HINT: use 'nccl' for CUDA"
                " GPUs, 'gloo' for CPUs, or leave it unset to let Lightning choose.",
            )
