"""Structured configs (schemas) of the Hydra app, registered in Hydra's ConfigStore."""

import enum
import functools
import json
import os
import warnings
from dataclasses import asdict, dataclass, field, fields, is_dataclass, make_dataclass
from datetime import datetime
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf

from lightning_het.arguments import ArgumentError
from lightning_het.comm import ALGORITHMS
from lightning_het.config import DEPRECATED_KEYWORDS, HeterogeneousConfig, typed_keywords

__all__ = [
    "ConfigValueError",
    "DataConfig",
    "GradientAveraging",
    "ProcessGroupBackend",
    "SceneDtype",
    "Split",
    "StartMethod",
    "StrategyConfig",
    "SyntheticSceneConfig",
    "default_devices",
    "emulated_node_ids",
    "emulated_slowdowns",
    "equal_speeds",
    "register_configs",
    "run_id",
    "slurm_tasks",
    "validate_config",
]


class ConfigValueError(ValueError):
    """A config value has the right type but an impossible value (raised before anything is built)."""


def _choices(name: str, values: tuple[str, ...], doc: str) -> Any:
    """A ``str`` enum of ``values`` (OmegaConf checks a config value against its members)."""
    choices = enum.Enum(name, {v: v for v in values}, type=str, module=__name__, qualname=name)  # type: ignore[misc]
    choices.__doc__ = doc
    return choices


GradientAveraging = _choices("GradientAveraging", ("weighted", "unweighted"), "How replicas' gradients combine.")
StartMethod = _choices("StartMethod", ("popen", "spawn", "fork", "forkserver"), "How Lightning starts replicas.")
ProcessGroupBackend = _choices("ProcessGroupBackend", ("gloo", "nccl", "mpi", "ucc"), "``null``: Lightning's choice.")
Split = _choices("Split", ("random", "blocks"), "Stratified ``random`` or spatially disjoint ``blocks`` splits.")
SceneDtype = _choices("SceneDtype", ("uint16", "float32"), "Digital numbers or reflectance.")


def _fail(key: str, value: Any, requirement: str, hint: str = "") -> None:
    message = f"You set `{key}={value}`, but {requirement}."
    if hint:
        message += f" HINT: {hint}"
    raise ConfigValueError(message)


def _plain(value: Any) -> Any:
    """Enum members as their value, OmegaConf containers as Python ones."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


def _show(value: Any) -> str:
    """``value`` as an override writes it."""
    return value if isinstance(value, str) else json.dumps(value)


@dataclass
class ProfilingConfig:
    """Schema of ``strategy.profiling``: the fields of :class:`lightning_het.Profiling`."""

    steps: int = 2
    warmup: int = 1
    cache: Any = None
    rebalance_every_n_epochs: int | None = None
    rebalance_threshold: float | None = None
    telemetry: bool = True


@dataclass
class ReliabilityConfig:
    """Schema of ``strategy.reliability``: the fields of :class:`lightning_het.Reliability`."""

    startup_timeout: float | None = None
    preemption_checkpoint: Any = None
    preemption_grace: float = 25.0
    resume: Any = None


@dataclass
class EmulationConfig:
    """Schema of ``strategy.emulation``: the :class:`lightning_het.EmulatedPlatform` callback's keywords."""

    slowdown: list[float] | None = None
    memory_cap: list[int] | None = None


#: the comm algorithms' fields: (type, default)
_COMM_FIELDS: dict[str, tuple[Any, Any]] = {
    "sync_every": (int | None, None),
    "warmup_steps": (int, 0),
    "autotune_steps": (int, 5),
    "outer": (str | None, None),
    "outer_lr": (float, 0.7),
    "outer_momentum": (float, 0.9),
    "sync_dtype": (str, "float32"),
    "merge": (str, "samples"),
}
#: ``_target_`` of our algorithm classes -> their mode name
_MODES = {f"lightning_het.{cls.__name__}": mode for mode, cls in ALGORITHMS.items()}
_SECTIONS = {"profiling": ProfilingConfig, "reliability": ReliabilityConfig, "emulation": EmulationConfig}


@dataclass
class _StrategyFields:
    _target_: str = "lightning_het.strategy.HeterogeneousStrategy"
    global_batch_size: int | None = None
    speeds: list[float] | None = None
    min_batch_size: int = 1
    max_batch_sizes: list[int] | None = None
    max_micro_batch_sizes: Any = None
    node_ids: list[int] | None = None
    #: a mode name, or an algorithm node (``_target_: lightning_het.NodeLocal`` and its fields)
    comm: Any = "auto"
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
    reliability: ReliabilityConfig = field(default_factory=ReliabilityConfig)
    emulation: EmulationConfig = field(default_factory=EmulationConfig)
    device_map: Any = None
    cpu_threads: Any = None
    #: app-level baseline switch, not a strategy keyword (see GradientAveraging)
    gradient_averaging: GradientAveraging = GradientAveraging.weighted
    # --- DDPStrategy keywords
    process_group_backend: ProcessGroupBackend | None = None
    start_method: StartMethod = StartMethod.popen
    timeout: float | None = None
    find_unused_parameters: bool = False
    ddp_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        flat, given = self.to_kwargs(), self.deprecated()
        try:  # the strategy's own checks: one rule for the constructor and the config
            node, emulation = self.to_node(warn=False)
            own = HeterogeneousConfig.__dataclass_fields__
            checked = {n: v for n, v in node.items() if n in own and not isinstance(v, dict)}
            HeterogeneousConfig.from_keywords(**checked, **{f"emulate_{k}": v for k, v in emulation.items()})
        except ArgumentError as err:
            name = err.argument
            key = ".".join(DEPRECATED_KEYWORDS[name]) if name in DEPRECATED_KEYWORDS and name not in given else name
            raise ConfigValueError(
                f"You set `strategy.{key}={flat.get(name)}`; the strategy refuses it: {err}"
            ) from None
        if self.gradient_averaging == GradientAveraging.unweighted and flat["comm"] != "allreduce":
            _fail(
                "strategy.gradient_averaging",
                self.gradient_averaging.value,
                f"the unweighted baseline is defined for all-reduce only (got `strategy.comm={flat['comm']}`)",
                "set `strategy.comm=allreduce`",
            )
        if self.gradient_averaging == GradientAveraging.unweighted and self.start_method != StartMethod.popen:
            _fail(
                "strategy.gradient_averaging",
                self.gradient_averaging.value,
                f"the unweighted baseline needs `strategy.start_method=popen` (got {self.start_method.value})",
            )

    def _typed(self, old: str) -> Any:
        """The value of the typed key the deprecated flat key ``old`` stands for."""
        group, name = DEPRECATED_KEYWORDS[old]
        if group == "comm":
            comm = _plain(self.comm)
            return comm.get(name, _COMM_FIELDS[name][1]) if isinstance(comm, dict) else _COMM_FIELDS[name][1]
        return _plain(getattr(getattr(self, group), name))

    def deprecated(self) -> dict[str, Any]:
        """The deprecated flat keys (``strategy.global_sync_every=4``, ...) set to another value than the typed
        key's (an unresolved ``${...}``: built in Python, not composed, so not set)."""
        values = {old: _plain(getattr(self, old)) for old in DEPRECATED_KEYWORDS}
        unset = {old for old, v in values.items() if isinstance(v, str) and v.startswith("${")}
        return {old: v for old, v in values.items() if old not in unset and v != self._typed(old)}

    def to_kwargs(self) -> dict[str, Any]:
        """The strategy's keywords in the flat form (each grouped setting as its deprecated flat keyword; ``comm``
        as its mode name unless it is another class's node)."""
        skip = {"_target_", "ddp_kwargs", "gradient_averaging", *_SECTIONS, *DEPRECATED_KEYWORDS}
        kwargs = {f.name: _plain(getattr(self, f.name)) for f in fields(self) if f.name not in skip}
        comm = kwargs["comm"]
        if (
            isinstance(comm, dict)
            and comm.get("_target_") in _MODES
            and not any(isinstance(v, dict) for v in comm.values())
        ):
            kwargs["comm"] = _MODES[comm["_target_"]]
        kwargs |= {old: self._typed(old) for old in DEPRECATED_KEYWORDS} | self.deprecated()
        clash = sorted(set(self.ddp_kwargs) & set(kwargs))
        if clash:
            _fail(
                "strategy.ddp_kwargs",
                dict(self.ddp_kwargs),
                f"it repeats keys that are strategy fields: {clash}",
                f"set them directly, e.g. `strategy.{clash[0]}=...`",
            )
        return kwargs | dict(self.ddp_kwargs)

    def to_node(self, warn: bool = True) -> tuple[dict[str, Any], dict[str, Any]]:
        """The strategy's Hydra node in the typed form (``comm``, ``profiling`` and ``reliability`` as nested
        ``_target_`` nodes) and the ``EmulatedPlatform`` keywords (empty: no emulation). The deprecated flat keys
        win over the typed ones, with a ``FutureWarning`` naming the typed keys."""
        given = self.deprecated()
        if warn and given and os.environ.get("LOCAL_RANK", "0") == "0":  # once per node, not once per replica
            old = ", ".join(f"`strategy.{n}={_show(v)}`" for n, v in given.items())
            new = ", ".join(f"`strategy.{'.'.join(DEPRECATED_KEYWORDS[n])}={_show(v)}`" for n, v in given.items())
            warnings.warn(f"{old}: deprecated config keys; use {new}.", FutureWarning, stacklevel=2)
        flat = self.to_kwargs()
        comm = flat["comm"]
        if isinstance(comm, dict):  # another class's node (or with nested nodes): instantiated as it is
            flat = {n: v for n, v in flat.items() if DEPRECATED_KEYWORDS.get(n, ("",))[0] != "comm"} | {"comm": "auto"}
        keywords, emulation = typed_keywords(flat)
        node: dict[str, Any] = {"_target_": self._target_, **keywords}
        if isinstance(comm, dict):
            node["comm"] = comm
        for name, value in keywords.items():
            if is_dataclass(value) and not isinstance(value, type):
                node[name] = {"_target_": f"lightning_het.{type(value).__name__}", **asdict(value)}
        return node, emulation


def _deprecated_field(old: str) -> tuple[str, Any, Any]:
    """The deprecated flat key ``old``: a view of the typed key (``${...}``) that an override replaces."""
    group, name = DEPRECATED_KEYWORDS[old]
    if group == "comm":
        kind, default = _COMM_FIELDS[name]
        return old, kind, field(default=f"${{oc.select:.comm.{name},{'null' if default is None else default}}}")
    return old, _SECTIONS[group].__dataclass_fields__[name].type, field(default=f"${{.{group}.{name}}}")


StrategyConfig = make_dataclass(
    "StrategyConfig", [_deprecated_field(old) for old in DEPRECATED_KEYWORDS], bases=(_StrategyFields,)
)
StrategyConfig.__module__ = __name__
StrategyConfig.__doc__ = """Schema of the ``strategy`` group: the keywords of ``HeterogeneousStrategy``
(``comm`` a mode name or an algorithm node; ``profiling``, ``reliability``; ``emulation``: the ``EmulatedPlatform``
callback the app adds), and the deprecated flat keys (``global_sync_every``, ``emulate_slowdown``, ...) as views of the
typed keys that an override replaces (:meth:`to_node`, with a warning)."""


@dataclass
class SyntheticSceneConfig:
    """Schema of ``data.synthetic``: the arguments of :func:`lightning_het.hsi.synthetic.make_synthetic_scene`."""

    height: int = 64
    width: int = 64
    bands: int = 32
    classes: int = 6
    seed: int = 0
    noise: float = 0.02
    region_scale: float = 6.0
    boundary_mixing: float = 0.8
    unlabelled_fraction: float = 0.15
    dtype: SceneDtype = SceneDtype.uint16
    pixel_size: float = 20.0
    crs: str = "EPSG:32616"


@dataclass
class DataConfig:
    """Schema of the ``data`` group: the keywords of :class:`~lightning_het.hsi.HyperspectralDataModule`."""

    _target_: str = "lightning_het.hsi.datamodule.HyperspectralDataModule"
    #: raster or .mat file; null: synthetic scene. MISSING so that a YAML ``???`` stays mandatory.
    image: str | None = MISSING
    #: single-band integer raster on the image's grid, 0 = unlabelled, 1..C = classes
    labels: str | None = MISSING
    synthetic: SyntheticSceneConfig | None = None
    patch_size: int = 5
    split: Split = Split.random
    train_fraction: float = 0.3
    train_per_class: int | None = None
    val_fraction: float = 0.1
    val_per_class: int | None = None
    block_size: int = 16
    #: an int, ``auto`` (min(30, bands - 1)) or null (every band); ``Any``: OmegaConf has no int-or-string type
    pca_components: Any = None
    standardize: bool = True
    num_classes: int | None = None
    class_names: list[str] | None = None
    image_key: str | None = None
    labels_key: str | None = None
    seed: int = 0
    in_memory: bool | None = None
    memory_budget: int | None = None
    global_batch_size: int = 64
    eval_batch_size: int | None = None
    num_workers: int = 0
    pin_memory: bool = False

    def __post_init__(self) -> None:
        if self.image is not None and self.synthetic is not None:
            _fail(
                "data.image",
                self.image,
                "`data.synthetic` is set too; a synthetic scene is generated only when there is no image",
                "use `data=geotiff data.image=... data.labels=...` (which sets `data.synthetic=null`)",
            )

    def to_kwargs(self) -> dict[str, Any]:
        """Constructor keywords for the data module (plain Python values, no ``_target_``)."""
        node = OmegaConf.to_container(OmegaConf.structured(self), resolve=True, enum_to_str=True)
        assert isinstance(node, dict)
        node.pop("_target_")
        return node


def _single_node_cpu_world(root: DictConfig | None) -> int | None:
    """World size of a single-node CPU job with an integer ``trainer.devices``, else ``None``."""
    trainer = None if root is None else root.get("trainer")  # none when a group is composed on its own
    if not isinstance(trainer, DictConfig) or trainer.get("accelerator") != "cpu" or trainer.get("num_nodes", 1) != 1:
        return None
    return _world(root)


def _world(root: DictConfig | None) -> int | None:
    """``trainer.devices x trainer.num_nodes`` when both are integers, else ``None``."""
    if root is None or not isinstance(root.get("trainer"), DictConfig):
        return None
    devices, nodes = root.trainer.get("devices"), root.trainer.get("num_nodes", 1)
    if isinstance(devices, bool) or not isinstance(devices, int) or not isinstance(nodes, int) or devices < 1:
        return None
    return devices * nodes


def emulated_slowdowns(max_slowdown: float | None, *, _root_: DictConfig | None = None) -> list[float] | None:
    """Default ``strategy.emulate_slowdown``: geometric factors from 1 to ``max_slowdown`` over the replicas.

    >>> root = OmegaConf.create({"trainer": {"accelerator": "cpu", "devices": 3, "num_nodes": 1}})
    >>> emulated_slowdowns(4, _root_=root)
    [1.0, 2.0, 4.0]
    """
    world = _single_node_cpu_world(_root_)
    if max_slowdown is None or world is None or world < 2:
        return None
    return [round(float(max_slowdown) ** (r / (world - 1)), 3) for r in range(world)]


def emulated_node_ids(nodes: int, *, _root_: DictConfig | None = None) -> list[int] | None:
    """Default ``strategy.node_ids`` of ``strategy=node_local``: split a single-node CPU job into emulated nodes.

    >>> root = OmegaConf.create({"trainer": {"accelerator": "cpu", "devices": 3, "num_nodes": 1}})
    >>> emulated_node_ids(2, _root_=root)
    [0, 0, 1]
    """
    world = _single_node_cpu_world(_root_)
    if world is None or world < 2:
        return None
    nodes = max(1, min(int(nodes), world))
    base, extra = divmod(world, nodes)
    return [node for node in range(nodes) for _ in range(base + (1 if node < extra else 0))]


def equal_speeds(*, _root_: DictConfig | None = None) -> list[float] | None:
    """``strategy.speeds`` of ``strategy=equal_split``: ``[1.0] * (trainer.devices x trainer.num_nodes)``."""
    if _root_ is None or not isinstance(_root_.get("trainer"), DictConfig):
        return None  # composing a group on its own
    world = _world(_root_)
    if world is None:
        raise ConfigValueError(
            f"You chose `strategy=equal_split` with `trainer.devices={_root_.trainer.get('devices')}`, but equal speeds"
            " need the number of replicas. HINT: set `trainer.devices` to an integer (e.g. `trainer.devices=4`)."
        )
    return [1.0] * world


def default_devices(accelerator: str) -> int | str:
    """Default ``trainer.devices``: 3 CPU replicas (the laptop demo), every device of any other accelerator."""
    if accelerator == "cpu":
        return 3
    if accelerator == "auto":
        return "auto"
    return -1


def slurm_tasks(devices: Any) -> int:
    """``trainer.devices`` as a SLURM task count (``${lh.slurm_tasks:${trainer.devices}}``); it must be an integer."""
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ConfigValueError(
            f"You chose `hydra/launcher=slurm` with `trainer.devices={devices}`, but SLURM needs the number of tasks"
            " (replicas) per node. HINT: set `trainer.devices` to an integer, e.g. `trainer.devices=4`."
        )
    return devices


def run_id() -> str:
    """A run-directory name that every process of one job agrees on."""
    env = os.environ
    job, step = env.get("SLURM_JOB_ID"), env.get("SLURM_STEP_ID")
    if job and step and env.get("SLURM_NTASKS", "1").isdigit() and int(env.get("SLURM_NTASKS", "1")) > 1:
        return f"slurm-{job}.{step}"
    torchrun = env.get("TORCHELASTIC_RUN_ID")
    if torchrun and torchrun != "none":
        return f"torchrun-{torchrun}"
    return _now_stamp()


@functools.cache
def _now_stamp() -> str:
    return datetime.now().strftime("%Y-%m-%d_%H-%M-%S")  # once per process


def register_configs() -> None:
    """Store the schemas in Hydra's ConfigStore (``strategy/schema``, ``data/schema``) and register the resolvers."""
    for resolver in (emulated_slowdowns, emulated_node_ids, equal_speeds, default_devices, run_id, slurm_tasks):
        OmegaConf.register_new_resolver(f"lh.{resolver.__name__}", resolver, replace=True)
    store = ConfigStore.instance()
    store.store(group="strategy", name="schema", node=StrategyConfig)
    store.store(group="data", name="schema", node=DataConfig)


def validate_config(cfg: DictConfig) -> tuple[StrategyConfig, DataConfig]:
    """Resolve and range-check the ``strategy`` and ``data`` nodes of a composed config."""
    missing = sorted(_missing_keys(cfg, skip=("hydra",)))
    if missing:
        example = " ".join(f"{k}=..." for k in missing)
        raise ConfigValueError(
            f"You did not set {', '.join(f'`{k}`' for k in missing)}, which the chosen configs require (`???`)."
            f" HINT: add {example} to the command line."
        )
    strategy = OmegaConf.to_object(cfg.strategy)
    data = OmegaConf.to_object(cfg.data)
    if not isinstance(strategy, StrategyConfig) or not isinstance(data, DataConfig):
        raise ConfigValueError(
            "The `strategy` and `data` configs must extend their schemas (`defaults: [schema, _self_]`), but got"
            f" {type(strategy).__name__} and {type(data).__name__}. HINT: start your own YAML file in conf/strategy or"
            " conf/data with that defaults list."
        )
    return strategy, data


def _missing_keys(node: DictConfig | ListConfig, prefix: str = "", skip: tuple[str, ...] = ()) -> list[str]:
    """Full keys of the mandatory (``???``) values under ``node``, without resolving any interpolation."""
    found: list[str] = []
    keys = node.keys() if isinstance(node, DictConfig) else range(len(node))
    for key in keys:
        if key in skip:
            continue
        full = f"{prefix}{key}" if isinstance(node, DictConfig) else f"{prefix.rstrip('.')}[{key}]"
        if OmegaConf.is_interpolation(node, key):
            continue
        if OmegaConf.is_missing(node, key):
            found.append(full)
            continue
        child = node[key]  # neither an interpolation nor missing: a value, a container or None, as stored
        if isinstance(child, (DictConfig, ListConfig)):
            found += _missing_keys(child, full + ".")
    return found
