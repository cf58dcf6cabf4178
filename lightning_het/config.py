"""The strategy's settings (no torch): the :class:`Profiling` / :class:`Reliability` keyword objects, the frozen
:class:`HeterogeneousConfig` the parts read, and the deprecated flat keywords mapped onto the typed ones."""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from datetime import timedelta
from typing import Any, Literal

from lightning_het.allocation import allocate_batch_sizes
from lightning_het.arguments import (
    SYNC_DEFAULTS,
    ArgumentError,
    as_timeout,
    check_ddp_keywords,
    check_sync_args,
    expect,
    finite_positive_list,
    int_list,
    positive_int,
    slowdown_factors,
    validate_resume,
)
from lightning_het.comm import ALGORITHMS, FLAT_FIELDS, CommAlgorithm, algorithm_class, algorithm_for

#: seconds a replica has, from SIGTERM, to reach a step boundary, save and exit
DEFAULT_GRACE = 25.0


@dataclass(frozen=True)
class Profiling:
    """How the first steps measure the replicas' speeds, when the allocation is revised, and ``telemetry``
    (``docs/strategy.md``)."""

    steps: int = 2
    warmup: int = 1
    cache: str | os.PathLike[str] | bool | None = None
    rebalance_every_n_epochs: int | None = None
    rebalance_threshold: float | None = None
    telemetry: bool = True

    def __post_init__(self) -> None:
        positive_int("steps", self.steps, allow_none=False)
        positive_int("warmup", self.warmup, allow_none=False, minimum=0)
        choices = "a directory, True (the default directory) or None/False (off)"
        expect(isinstance(self.cache, (str, os.PathLike, bool, type(None))), "cache", choices, self.cache)
        positive_int("rebalance_every_n_epochs", self.rebalance_every_n_epochs)
        ratio = self.rebalance_threshold  # max / min step time
        ok = ratio is None or (
            not isinstance(ratio, bool) and isinstance(ratio, (int, float)) and 1 <= ratio < math.inf
        )
        expect(ok, "rebalance_threshold", "a finite number >= 1 (max / min ratio)", ratio)
        expect(isinstance(self.telemetry, bool), "telemetry", "True or False", self.telemetry)
        if not self.telemetry and (self.rebalance_every_n_epochs is not None or self.rebalance_threshold is not None):
            raise ArgumentError(
                "telemetry",
                "You set `telemetry=False`, but rebalancing (`rebalance_every_n_epochs` / `rebalance_threshold`) needs"
                " the measured step times. HINT: keep `telemetry=True` or drop the rebalancing arguments.",
            )


@dataclass(frozen=True)
class Reliability:
    """Start-up and preemption settings and ``resume`` (``docs/strategy.md``)."""

    startup_timeout: float | timedelta | None = None
    preemption_checkpoint: str | os.PathLike[str] | Literal[False] | None = None
    preemption_grace: float = DEFAULT_GRACE
    resume: Literal["auto", False] | None = None

    def __post_init__(self) -> None:
        as_timeout("startup_timeout", self.startup_timeout)
        path, grace = self.preemption_checkpoint, self.preemption_grace
        ok = path is None or path is False or (isinstance(path, (str, os.PathLike)) and bool(os.fspath(path)))
        expected = "a file or directory path, None (the default location) or False (no checkpoint on preemption)"
        expect(ok, "preemption_checkpoint", expected, path)
        ok = not isinstance(grace, bool) and isinstance(grace, (int, float)) and math.isfinite(grace) and grace > 0
        expect(ok, "preemption_grace", "finite seconds > 0", grace)
        validate_resume(self.resume)


@dataclass(frozen=True)
class HeterogeneousConfig:
    """Every setting of the strategy, normalised: the balancing keywords, the ``comm`` algorithm, the ``profiling`` and
    ``reliability`` objects and the emulation; ``None``: not given. Treat the lists as read-only."""

    global_batch_size: int | None = None
    speeds: list[float] | None = None
    min_batch_size: int = 1
    max_batch_sizes: list[int] | None = None
    max_micro_batch_sizes: list[int] | Literal["auto"] | None = None
    node_ids: list[int] | None = None
    comm: CommAlgorithm = field(default_factory=ALGORITHMS["auto"])
    profiling: Profiling = Profiling()
    reliability: Reliability = Reliability()
    emulate_slowdown: list[float] | None = None
    emulate_memory_cap: list[int] | None = None
    timeout: timedelta | None = None

    @classmethod
    def from_keywords(cls, **given: Any) -> HeterogeneousConfig:
        """``given`` (the typed form) checked and normalised; :class:`ArgumentError`."""
        out = dict(given)
        out["global_batch_size"] = positive_int("global_batch_size", out.get("global_batch_size"))
        out["speeds"] = finite_positive_list("speeds", out.get("speeds"))
        least = out["min_batch_size"] = positive_int("min_batch_size", out.get("min_batch_size", 1), allow_none=False)
        out["max_batch_sizes"] = bounds = int_list("max_batch_sizes", out.get("max_batch_sizes"))
        for i, b in enumerate(bounds or []):
            expect(b >= least, f"max_batch_sizes[{i}]", f">= `min_batch_size`={least}", b)  # type: ignore[operator]
        caps = out.get("max_micro_batch_sizes")  # "auto": measured by a short search on the first steps
        out["max_micro_batch_sizes"] = caps if caps == "auto" else int_list("max_micro_batch_sizes", caps, 'or "auto"')
        nodes = out["node_ids"] = int_list("node_ids", out.get("node_ids"), minimum=0)
        comm = out["comm"] = _comm_object(out.get("comm", "auto"))
        if comm.mode == "node_local" and nodes is not None and len(set(nodes)) < 2:
            raise ArgumentError(
                "node_ids",
                f"You set `comm='node_local'`, but `node_ids={nodes}` puts every replica on one node, so node-local"
                " steps would be exact training. HINT: declare at least two nodes (e.g. node_ids=[0, 0, 1, 1]), or"
                " use comm='allreduce'.",
            )
        out["emulate_slowdown"] = slowdown_factors("emulate_slowdown", out.get("emulate_slowdown"))
        out["emulate_memory_cap"] = int_list("emulate_memory_cap", out.get("emulate_memory_cap"))
        out["timeout"] = as_timeout("timeout", out.get("timeout"))
        return cls(**{name: value for name, value in out.items() if value is not None})

    def check_world(self, num_nodes: int, devices: int) -> None:
        """Checks that need the world size (list lengths, a global batch the bounds can hold); ``ValueError``."""
        world = num_nodes * devices
        if world < 1:
            return
        lists = ("speeds", "max_batch_sizes", "node_ids", "emulate_slowdown", "max_micro_batch_sizes")
        for name in (*lists, "emulate_memory_cap"):
            values = getattr(self, name)
            if values is not None and values != "auto" and len(values) != world:
                raise ValueError(
                    f"You set `{name}` with {len(values)} entries ({list(values)}), but the job has {world} replicas"
                    f" (num_nodes={num_nodes} x devices={devices}). HINT: give one entry per global rank."
                )
        if self.global_batch_size is not None:  # a ValueError naming the bound that cannot hold it
            speeds = self.speeds or [1.0] * world
            bounds = {"min_batch_size": self.min_batch_size, "max_batch_sizes": self.max_batch_sizes}
            allocate_batch_sizes(self.global_batch_size, speeds, **bounds)


#: old flat keyword -> (the typed keyword that replaces it, the field there)
DEPRECATED_KEYWORDS: dict[str, tuple[str, str]] = {
    **{old: ("comm", new) for old, new in FLAT_FIELDS.items()},
    **{f"emulate_{name}": ("emulation", name) for name in ("slowdown", "memory_cap")},
    **{f"profile_{name}": ("profiling", name) for name in ("steps", "warmup", "cache")},
    **{name: ("profiling", name) for name in ("rebalance_every_n_epochs", "rebalance_threshold", "telemetry")},
    **{f.name: ("reliability", f.name) for f in fields(Reliability)},
}
_OLD_NAMES = {new: old for old, new in DEPRECATED_KEYWORDS.items()}
_GROUPS: dict[str, type] = {"profiling": Profiling, "reliability": Reliability}

#: settings a Fabric loop cannot run (they need the Trainer's loop)
TRAINER_ONLY = (
    "max_micro_batch_sizes",
    "device_map",
    "cpu_threads",
    "emulate_slowdown",
    "emulate_memory_cap",
    "resume",
)
TRAINER_ONLY += ("rebalance_every_n_epochs", "rebalance_threshold", "preemption_checkpoint", "preemption_grace")


def _comm_object(comm: Any) -> CommAlgorithm:
    """``comm``: an algorithm object, or the one (with its defaults) a mode name stands for."""
    if isinstance(comm, CommAlgorithm):
        return comm
    expected = f"one of {list(ALGORITHMS)} or a comm algorithm object (e.g. lightning_het.NodeLocal(sync_every=16))"
    expect(isinstance(comm, str) and comm in ALGORITHMS, "comm", expected, comm)
    return ALGORITHMS[comm]()


def _grouped(flat: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    groups: dict[str, dict[str, Any]] = {}
    for name, value in flat.items():
        if name in DEPRECATED_KEYWORDS:
            group, field = DEPRECATED_KEYWORDS[name]
            groups.setdefault(group, {})[field] = value
    return groups


def new_form(old: Mapping[str, Any], comm: Any = "auto") -> str:
    """The typed form of the deprecated keywords ``old`` (with ``comm``, the mode name they went with)."""
    groups = _grouped(old)
    cls = algorithm_class(comm if isinstance(comm, str) else "auto", groups.get("comm", {}))
    names = {"comm": cls.__name__, "emulation": "EmulatedPlatform"} | {g: c.__name__ for g, c in _GROUPS.items()}
    forms = {g: f"{names[g]}({', '.join(f'{k}={v!r}' for k, v in values.items())})" for g, values in groups.items()}
    return ", ".join(f"Trainer(callbacks=[{form}])" if g == "emulation" else f"{g}={form}" for g, form in forms.items())


def typed_keywords(flat: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Flat keywords in the typed form, same meaning: the strategy's and the ``EmulatedPlatform``'s (empty: none); comm
    settings the mode does not read are dropped (schedules with a ``UserWarning``); errors name the flat keyword."""
    out = {name: value for name, value in flat.items() if name not in DEPRECATED_KEYWORDS}
    groups, comm = _grouped(flat), out.get("comm", "auto")
    if "comm" in groups:
        given = {old: flat[old] for old in FLAT_FIELDS if old in flat}
        _comm_object(comm)  # checked in every mode
        positive_int("global_sync_every", given.get("global_sync_every"))
        positive_int("comm_warmup_steps", given.get("comm_warmup_steps", 0), allow_none=False, minimum=0)
        check_sync_args(*(given.get(name, default) for name, default in SYNC_DEFAULTS.items()), comm=comm)
        for name in ("global_sync_every", "comm_warmup_steps"):
            if given.get(name) and comm != "node_local":
                message = f"`{name}={given[name]}` only applies to `comm='node_local'`; it is ignored with"
                warnings.warn(f"{message} `comm={comm!r}`.", UserWarning, stacklevel=2)
        groups["comm"] = given
    builders = {"comm": lambda **given: algorithm_for(comm, **given), **_GROUPS}
    for group, build in builders.items():
        try:
            if group in groups:
                out[group] = build(**groups[group])
        except ArgumentError as err:  # told with the flat keyword the caller used
            name = _OLD_NAMES.get((group, err.argument), err.argument)
            raise ArgumentError(name, str(err).replace(f"`{err.argument}`", f"`{name}`")) from None
    return out, {k: v for k, v in groups.get("emulation", {}).items() if v is not None}


def strategy_config(
    owner: type, keywords: Mapping[str, Any], fabric: bool = False
) -> tuple[HeterogeneousConfig, dict[str, Any]]:
    """A strategy's validated config from its constructor's ``locals()``, and DDP's keywords; one warning names the
    typed form of the old flat keywords; both forms, or (``fabric``) a Trainer-only setting, raise ``ArgumentError``."""
    comm, groups, rest = keywords["comm"], {group: keywords[group] for group in _GROUPS}, dict(keywords["kwargs"])
    explicit = {n: keywords[n] for n in HeterogeneousConfig.__dataclass_fields__ if n in keywords and n not in groups}
    old = {name: rest.pop(name) for name in list(rest) if name in DEPRECATED_KEYWORDS}
    objects = {"comm": None if isinstance(comm, str) else comm, **groups}
    for group, cls in _GROUPS.items():
        ok = objects[group] is None or isinstance(objects[group], cls)
        expect(ok, group, f"a `lightning_het.{cls.__name__}` or None", objects[group])
    for name, value in old.items():
        group, field = DEPRECATED_KEYWORDS[name]
        if objects.get(group) is not None:
            raise ArgumentError(
                name,
                f"You passed `{group}={objects[group]!r}` and the deprecated `{name}={value!r}`. HINT: set `{field}` on"
                f" the `{group}` object only.",
            )
    typed, emulation = typed_keywords({"comm": comm, **old})
    given = {**explicit, "comm": typed["comm"], **{f"emulate_{field}": value for field, value in emulation.items()}}
    given |= {group: typed.get(group, objects[group]) or cls() for group, cls in _GROUPS.items()}
    if fabric:
        flat = {name: rest.pop(name) for name in TRAINER_ONLY if name in rest} | given
        for group, cls in _GROUPS.items():  # the grouped settings set, by their flat names
            flat |= {_OLD_NAMES[group, k]: v for k, v in vars(given[group]).items() if v != getattr(cls, k)}
        refused = [n for n in TRAINER_ONLY if flat.get(n) is not None]
        if refused:
            raise ArgumentError(
                refused[0],
                f"{owner.__name__} cannot run {', '.join(f'`{n}={flat[n]!r}`' for n in refused)}: settings that need"
                " the Trainer's loop. HINT: use `lightning.Trainer(strategy=HeterogeneousStrategy(...))`, or leave"
                " them at their defaults; for memory caps, split each batch with"
                " `lightning_het.data.microbatch.micro_batches(batch, cap)` (docs/balancing.md).",
            )
        given["profiling"] = replace(given["profiling"], telemetry=False)
    config = HeterogeneousConfig.from_keywords(**given, timeout=rest.get("timeout"))
    check_ddp_keywords(owner, [*explicit, "comm", *groups], rest)
    if old:
        names = ", ".join(f"`{n}={v!r}`" for n, v in old.items())
        message = f"{owner.__name__}: {names} {'is' if len(old) == 1 else 'are'} deprecated; use {new_form(old, comm)}."
        warnings.warn(message, DeprecationWarning, stacklevel=3)
    if config.timeout is not None:
        rest["timeout"] = config.timeout
    return config, rest
