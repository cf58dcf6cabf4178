"""The strategy's grouped settings (:class:`Profiling`, :class:`Reliability`; no torch), and the mapping of the typed
keywords (and of the deprecated flat ones) onto the flat settings :class:`~lightning_het.config.HeterogeneousConfig`
validates.

>>> Profiling(steps=3, rebalance_threshold=1.1)
Profiling(steps=3, warmup=1, cache=None, rebalance_every_n_epochs=None, rebalance_threshold=1.1, telemetry=True)
>>> Reliability(preemption_grace=0)
Traceback (most recent call last):
...
lightning_het.arguments.ArgumentError: Expected argument `preemption_grace` to be finite seconds > 0, but got 0.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Collection, Mapping
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any, Literal

from lightning_het.arguments import (
    SYNC_DEFAULTS,
    ArgumentError,
    as_timeout,
    check_sync_args,
    positive_int,
    threshold,
    validate_grace,
    validate_preemption_checkpoint,
    validate_resume,
)
from lightning_het.comm.algorithms import ALGORITHMS, FLAT_FIELDS, CommAlgorithm, algorithm_class, algorithm_for
from lightning_het.config import DEFAULT_GRACE, KEYWORD_DEFAULTS


@dataclass(frozen=True)
class Profiling:
    """How the first training steps measure the replicas' speeds, and when the allocation is revised.

    ``steps``: trial steps per trial split; ``warmup``: untimed equal-split steps first; ``cache``: a directory (or
    ``True``: the default one) keeping each replica's fitted cost; ``rebalance_every_n_epochs`` /
    ``rebalance_threshold``: re-derive the speeds from the measured step times at epoch ends; ``telemetry``: time every
    step of every replica and write the balance report (needed by rebalancing). See ``docs/strategy.md``."""

    steps: int = 2
    warmup: int = 1
    cache: str | os.PathLike[str] | bool | None = None
    rebalance_every_n_epochs: int | None = None
    rebalance_threshold: float | None = None
    telemetry: bool = True

    def __post_init__(self) -> None:
        positive_int("steps", self.steps, allow_none=False)
        positive_int("warmup", self.warmup, allow_none=False, minimum=0)
        if self.cache is not None and not isinstance(self.cache, (str, os.PathLike, bool)):
            raise ArgumentError(
                "cache",
                f"Expected argument `cache` to be a directory, True (the default directory) or None/False (off), but"
                f" got {self.cache!r}.",
            )
        positive_int("rebalance_every_n_epochs", self.rebalance_every_n_epochs)
        threshold("rebalance_threshold", self.rebalance_threshold)
        if not isinstance(self.telemetry, bool):
            raise ArgumentError(
                "telemetry", f"Expected argument `telemetry` to be True or False, but got {self.telemetry!r}."
            )
        if not self.telemetry and (self.rebalance_every_n_epochs is not None or self.rebalance_threshold is not None):
            raise ArgumentError(
                "telemetry",
                "You set `telemetry=False`, but rebalancing (`rebalance_every_n_epochs` / `rebalance_threshold`) needs"
                " the measured step times. HINT: keep `telemetry=True` or drop the rebalancing arguments.",
            )


@dataclass(frozen=True)
class Reliability:
    """Start-up and preemption settings. ``startup_timeout``: seconds (or a ``timedelta``) the replicas wait for each
    other at start-up; ``preemption_checkpoint``: where rank 0 saves on ``SIGTERM`` (``None``: beside the first
    ``ModelCheckpoint``; ``False``: none); ``preemption_grace``: seconds from the signal to save and exit; ``resume``:
    ``"auto"`` (resume from this job's checkpoint with the most progress), ``None`` (only a restarted torchelastic
    worker) or ``False``. See ``docs/reliability.md``."""

    startup_timeout: float | timedelta | None = None
    preemption_checkpoint: str | os.PathLike[str] | Literal[False] | None = None
    preemption_grace: float = DEFAULT_GRACE
    resume: Literal["auto", False] | None = None

    def __post_init__(self) -> None:
        as_timeout("startup_timeout", self.startup_timeout)
        validate_preemption_checkpoint(self.preemption_checkpoint)
        validate_grace(self.preemption_grace)
        validate_resume(self.resume)


#: old flat keyword -> (the typed keyword that replaces it, the field there)
DEPRECATED_KEYWORDS: dict[str, tuple[str, str]] = {
    **{old: ("comm", new) for old, new in FLAT_FIELDS.items()},
    "emulate_slowdown": ("emulation", "slowdown"),
    "emulate_memory_cap": ("emulation", "memory_cap"),
    "profile_steps": ("profiling", "steps"),
    "profile_warmup": ("profiling", "warmup"),
    "profile_cache": ("profiling", "cache"),
    "rebalance_every_n_epochs": ("profiling", "rebalance_every_n_epochs"),
    "rebalance_threshold": ("profiling", "rebalance_threshold"),
    "telemetry": ("profiling", "telemetry"),
    "startup_timeout": ("reliability", "startup_timeout"),
    "preemption_checkpoint": ("reliability", "preemption_checkpoint"),
    "preemption_grace": ("reliability", "preemption_grace"),
    "resume": ("reliability", "resume"),
}

_GROUP_CLASSES: dict[str, type] = {"profiling": Profiling, "reliability": Reliability}


def _flat(group: str, value: Any) -> dict[str, Any]:
    """A ``Profiling`` / ``Reliability`` object as the old flat keywords it stands for."""
    by_field = {new: old for old, (g, new) in DEPRECATED_KEYWORDS.items() if g == group}
    return {by_field[f.name]: getattr(value, f.name) for f in fields(value)}


def _call(name: str, values: Mapping[str, Any]) -> str:
    return f"{name}({', '.join(f'{k}={v!r}' for k, v in values.items())})"


def new_form(old: Mapping[str, Any], comm: Any = "auto") -> str:
    """The typed form of the deprecated keywords ``old`` (with ``comm``, the mode name they went with)."""
    groups: dict[str, dict[str, Any]] = {}
    for name, value in old.items():
        group, field = DEPRECATED_KEYWORDS[name]
        groups.setdefault(group, {})[field] = value
    parts = []
    if "comm" in groups:
        cls = algorithm_class(comm if isinstance(comm, str) else "auto", groups["comm"])
        parts.append(f"comm={_call(cls.__name__, groups['comm'])}")
    for group in ("profiling", "reliability"):
        if group in groups:
            parts.append(f"{group}={_call(_GROUP_CLASSES[group].__name__, groups[group])}")
    if "emulation" in groups:
        parts.append(f"Trainer(callbacks=[{_call('EmulatedPlatform', groups['emulation'])}])")
    return ", ".join(parts)


def flat_keywords(
    owner: str,
    explicit: Mapping[str, Any],
    comm: Any,
    profiling: Profiling | None,
    reliability: Reliability | None,
    kwargs: Mapping[str, Any],
    *,
    allowed: Collection[str] = KEYWORD_DEFAULTS,
) -> dict[str, Any]:
    """The strategy's keywords as the flat settings :meth:`HeterogeneousConfig.split_keywords` reads (plus the rest of
    ``kwargs``, ``DDPStrategy``'s). The deprecated flat keywords in ``kwargs`` keep their meaning, with one
    ``DeprecationWarning`` naming the typed form; a setting given both ways, or (``allowed``: the owner's) one the
    owner cannot run, raises :class:`ArgumentError`."""
    rest = dict(kwargs)
    old = {name: rest.pop(name) for name in list(rest) if name in DEPRECATED_KEYWORDS and name in allowed}
    flat = dict(explicit)
    objects: dict[str, Any] = {}
    if isinstance(comm, CommAlgorithm):
        objects["comm"] = comm
        flat |= comm.keywords()
    else:
        flat["comm"] = comm
    for group, value in (("profiling", profiling), ("reliability", reliability)):
        if value is None:
            continue
        if not isinstance(value, _GROUP_CLASSES[group]):
            cls = _GROUP_CLASSES[group].__name__
            raise ArgumentError(
                group, f"Expected argument `{group}` to be a `lightning_het.{cls}` or None, but got {value!r}."
            )
        objects[group] = value
        flat |= _flat(group, value)
    for name in old:
        group = DEPRECATED_KEYWORDS[name][0]
        if group in objects:
            raise ArgumentError(
                name,
                f"You passed `{group}={objects[group]!r}` and the deprecated `{name}={old[name]!r}`. HINT: set"
                f" `{DEPRECATED_KEYWORDS[name][1]}` on the `{group}` object only.",
            )
    refused = sorted(n for n in flat if n not in allowed and n != "telemetry" and flat[n] != KEYWORD_DEFAULTS[n])
    if refused:
        raise ArgumentError(
            refused[0],
            f"{owner} cannot run {', '.join(f'`{n}={flat[n]!r}`' for n in refused)}: it needs the Trainer's loop."
            " HINT: use `lightning.Trainer(strategy=HeterogeneousStrategy(...))`, or leave it at its default.",
        )
    flat = {n: v for n, v in flat.items() if n in allowed}
    if old:
        names = ", ".join(f"`{n}={v!r}`" for n, v in old.items())
        verb = "is" if len(old) == 1 else "are"
        warnings.warn(
            f"{owner}: {names} {verb} deprecated; use {new_form(old, comm)}.", DeprecationWarning, stacklevel=3
        )
    return flat | old | rest


def typed_keywords(flat: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Flat keywords (the deprecated ones among them, e.g. a config file's) in the typed form, with the same meaning:
    the strategy's keywords, and the ``EmulatedPlatform`` keywords (empty: no emulation). The comm settings the mode
    does not read are dropped, as the strategy ignores them (``global_sync_every`` / ``comm_warmup_steps``: with the
    same ``UserWarning``; a node-local sync setting other than its default: the same ``ArgumentError``).

    >>> typed_keywords({"comm": "node_local", "global_sync_every": 4, "profile_steps": 3, "emulate_slowdown": [1, 2]})
    ... # doctest: +ELLIPSIS
    ({'comm': NodeLocal(sync_every=4, ...), 'profiling': Profiling(steps=3, ...)}, {'slowdown': [1, 2]})
    """
    out = {name: value for name, value in flat.items() if name not in DEPRECATED_KEYWORDS}
    groups: dict[str, dict[str, Any]] = {}
    for name, value in flat.items():
        if name in DEPRECATED_KEYWORDS:
            group, field = DEPRECATED_KEYWORDS[name]
            groups.setdefault(group, {})[field] = value
    comm = out.get("comm", "auto")
    if "comm" in groups:
        if not isinstance(comm, str) or comm not in ALGORITHMS:
            raise ArgumentError("comm", f"Expected argument `comm` to be one of {list(ALGORITHMS)}, but got {comm!r}.")
        given = {old: flat[old] for old in FLAT_FIELDS if old in flat}
        check_sync_args(*(given.get(name, default) for name, default in SYNC_DEFAULTS.items()), comm=comm)
        for name in ("global_sync_every", "comm_warmup_steps"):
            if given.get(name) and comm != "node_local":
                message = (
                    f"`{name}={given[name]}` only applies to `comm='node_local'`; it is ignored with `comm={comm!r}`."
                )
                warnings.warn(message, UserWarning, stacklevel=2)
        out["comm"] = algorithm_for(comm, **given)
    for group in ("profiling", "reliability"):
        if group in groups:
            out[group] = _GROUP_CLASSES[group](**groups[group])
    emulation = {k: v for k, v in groups.get("emulation", {}).items() if v is not None}
    return out, emulation


assert set(ALGORITHMS) == {"auto", "allreduce", "hierarchical", "node_local"}
