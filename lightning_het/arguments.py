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


def expect(ok: bool, name: str, expected: str, value: Any, hint: str = "") -> None:
    """Unless ``ok``: :class:`ArgumentError` "Expected argument `name` to be <expected>, but got <value>. <hint>"."""
    if not ok:
        raise _error(name, f"Expected argument `{name}` to be {expected}, but got {value!r}.{hint and ' HINT: '}{hint}")


def positive_int(name: str, value: Any, *, allow_none: bool = True, minimum: int = 1) -> int | None:
    """``value`` as an ``int >= minimum`` (any integer type, not ``bool``); ``None`` stays ``None`` if allowed."""
    if value is None and allow_none:
        return None
    try:
        number = None if isinstance(value, bool) else operator.index(value)  # int, NumPy integers, ...
    except TypeError:
        number = None
    expect(number is not None and number >= minimum, name, f"an integer >= {minimum}", value)
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
        real = not isinstance(v, bool) and isinstance(v, numbers.Real)  # True would count as 1, "2" as 2.0
        if not (real and math.isfinite(v) and v > 0):
            what = "finite numbers > 0.0" if real else "real numbers"
            raise _error(
                name, f"Expected argument `{name}` to hold {what}, but `{name}[{i}]` is {v!r} ({name}={values})."
            )
    if not values:
        raise _error(name, f"Expected argument `{name}` to be non-empty.")
    return [float(v) for v in values]


def int_list(name: str, values: Any, alternatives: str = "", minimum: int = 1) -> list[int] | None:
    """``values`` as a non-empty list of integers ``>= minimum`` (one per replica); ``None`` stays ``None``."""
    if values is None:
        return None
    expected = f"Expected argument `{name}` to be a list of integers >= {minimum} (one per replica) {alternatives}"
    try:
        items = None if isinstance(values, (str, bytes, int, float)) else list(values)
    except TypeError:
        items = None
    if not items:
        raise _error(name, f"{expected.rstrip()}, but got {'an empty list' if items == [] else repr(values)}.")
    checked = [positive_int(f"{name}[{i}]", v, allow_none=False, minimum=minimum) for i, v in enumerate(items)]
    return checked  # type: ignore[return-value]


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
    expect(math.isfinite(seconds) and seconds > 0, name, "a positive duration", value)
    return value if isinstance(value, timedelta) else timedelta(seconds=seconds)


def validate_resume(value: Any) -> str | bool | None:
    """``resume``: ``"auto"``, ``None`` (only a restarted elastic worker resumes) or ``False`` (never)."""
    ok = value is None or value is False or value == "auto"
    expected = "'auto' (resume from the newest emergency, preemption or last checkpoint), None (only a restarted"
    expect(ok, "resume", f"{expected} torchelastic worker resumes) or False (never)", value)
    return value


#: ``comm="node_local"``'s sync keywords and their defaults (the only values accepted in the other modes)
SYNC_DEFAULTS: dict[str, Any] = {
    "outer_optimizer": None,
    "outer_lr": 0.7,
    "outer_momentum": 0.9,
    "sync_dtype": "float32",
    "merge_weights": "samples",
}


def check_sync_args(*values: Any, comm: str = "node_local") -> None:
    """``comm="node_local"``'s sync keywords (``values``: as :data:`SYNC_DEFAULTS`), a value other than the default
    refused where nothing reads it (another ``comm``; ``outer_lr``/``outer_momentum`` without ``"nesterov"``)."""
    given = dict(zip(SYNC_DEFAULTS, values))
    outer = given["outer_optimizer"]
    expected = "None (plain averaging), one of ['nesterov'] or a callable building a torch optimizer from a list of"
    expect(outer is None or outer == "nesterov" or callable(outer), "outer_optimizer", f"{expected} tensors", outer)
    for name, rule in (("outer_lr", "> 0"), ("outer_momentum", "in [0, 1)")):
        value = given[name]
        ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
        expect(ok and (value > 0 if name == "outer_lr" else 0 <= value < 1), name, f"a finite number {rule}", value)
    for name, choices in (("sync_dtype", ["float32", "bfloat16", "int8"]), ("merge_weights", ["samples", "nodes"])):
        expect(given[name] in choices, name, f"one of {choices}", given[name])
    changed = [n for n, v in given.items() if callable(v) or v != SYNC_DEFAULTS[n]]  # a callable is never a default
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
        if name in changed and outer != "nesterov":
            what = "plain averaging, which has no outer optimizer" if outer is None else "a callable"
            raise _error(
                name,
                f"You set `{name}={given[name]!r}`, but `outer_optimizer={outer!r}` ({what}) would ignore"
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
        hint = f"did you mean `{close[0]}`?" if close else "see DDPStrategy's and DistributedDataParallel's keywords."
        if name in ("module", "device_ids"):
            hint = "the strategy sets it when it wraps the model (one device per replica); drop it."
        raise ArgumentError(
            name,
            f"`{strategy_cls.__name__}` got an unexpected keyword argument `{name}`={kwargs[name]!r}: it is not a"
            f" keyword of the strategy, of Lightning's `DDPStrategy`, nor of torch's `DistributedDataParallel`"
            f" (which receives the extra keywords). HINT: {hint}",
        )
    backend = kwargs.get("process_group_backend")
    allowed = sorted({str(b).lower() for b in dist.Backend.backend_list} - {"undefined"})  # registered ones too
    expected = f"one of {allowed} (or a backend registered with `torch.distributed.Backend.register_backend`)"
    hint = "use 'nccl' for CUDA GPUs, 'gloo' for CPUs, or leave it unset to let Lightning choose."
    ok = backend is None or (isinstance(backend, str) and backend.lower() in allowed)
    expect(ok, "process_group_backend", expected, backend, hint)
