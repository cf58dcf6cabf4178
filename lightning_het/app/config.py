"""Structured configs (schemas) of the Hydra app, registered in Hydra's ConfigStore."""

import enum
import functools
import os
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from datetime import datetime
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf

from lightning_het.arguments import COMM_CHOICES, ArgumentError, validate_strategy_arguments
from lightning_het.config import HeterogeneousConfig
from lightning_het.options import typed_keywords

__all__ = [
    "Comm",
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


Comm = _choices("Comm", COMM_CHOICES, "``comm``: see ``docs/communication.md``.")
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


@dataclass
class StrategyConfig:
    """Schema of the ``strategy`` group: the keywords of :class:`~lightning_het.HeterogeneousStrategy`, with the
    grouped settings as flat keys (``global_sync_every``, ``profile_steps``, ``resume``, ``emulate_slowdown``, ...)
    that :meth:`to_node` maps onto the ``comm`` / ``profiling`` / ``reliability`` objects and the ``EmulatedPlatform``
    callback (their meaning: ``docs/strategy.md``; ``Any``: a type OmegaConf cannot express, checked by the
    strategy's validators)."""

    _target_: str = "lightning_het.strategy.HeterogeneousStrategy"
    global_batch_size: int | None = None
    speeds: list[float] | None = None
    min_batch_size: int = 1
    max_batch_sizes: list[int] | None = None
    max_micro_batch_sizes: Any = None
    node_ids: list[int] | None = None
    comm: Comm = Comm.auto
    global_sync_every: int | None = None
    emulate_slowdown: list[float] | None = None
    emulate_memory_cap: list[int] | None = None
    profile_steps: int = 2
    profile_warmup: int = 1
    profile_cache: Any = None
    device_map: Any = None
    cpu_threads: Any = None
    startup_timeout: float | None = None
    rebalance_every_n_epochs: int | None = None
    rebalance_threshold: float | None = None
    telemetry: bool = True
    comm_warmup_steps: int = 0
    comm_autotune_steps: int = 5
    outer_optimizer: str | None = None
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    sync_dtype: str = "float32"
    merge_weights: str = "samples"
    preemption_checkpoint: Any = None
    preemption_grace: float = 25.0
    #: ``auto`` in conf/strategy/heterogeneous.yaml: a run started again in its run directory resumes
    resume: Any = None
    #: app-level baseline switch, not a strategy keyword (see GradientAveraging)
    gradient_averaging: GradientAveraging = GradientAveraging.weighted
    # --- DDPStrategy keywords
    process_group_backend: ProcessGroupBackend | None = None
    start_method: StartMethod = StartMethod.popen
    timeout: float | None = None
    find_unused_parameters: bool = False
    ddp_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        values = {name: _plain(getattr(self, name)) for name in STRATEGY_CHECKED_FIELDS}
        try:  # the strategy's own validators: one rule for the constructor and the config
            validate_strategy_arguments(**values)
        except ArgumentError as err:
            key = f"strategy.{err.argument}"
            value = values.get(err.argument)
            raise ConfigValueError(f"You set `{key}={value}`; the strategy refuses it: {err}") from None
        if self.gradient_averaging == GradientAveraging.unweighted and self.comm != Comm.allreduce:
            _fail(
                "strategy.gradient_averaging",
                self.gradient_averaging.value,
                f"the unweighted baseline is defined for all-reduce only (got `strategy.comm={self.comm.value}`)",
                "set `strategy.comm=allreduce`",
            )
        if self.gradient_averaging == GradientAveraging.unweighted and self.start_method != StartMethod.popen:
            _fail(
                "strategy.gradient_averaging",
                self.gradient_averaging.value,
                f"the unweighted baseline needs `strategy.start_method=popen` (got {self.start_method.value})",
            )

    def to_kwargs(self) -> dict[str, Any]:
        """Constructor keywords for the strategy class."""
        skip = ("_target_", "ddp_kwargs", "gradient_averaging")
        kwargs = {name: _plain(getattr(self, name)) for name in self.__dataclass_fields__ if name not in skip}
        clash = sorted(set(self.ddp_kwargs) & set(kwargs))
        if clash:
            _fail(
                "strategy.ddp_kwargs",
                dict(self.ddp_kwargs),
                f"it repeats keys that are strategy fields: {clash}",
                f"set them directly, e.g. `strategy.{clash[0]}=...`",
            )
        kwargs.update(self.ddp_kwargs)
        return kwargs

    def to_node(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The strategy's Hydra node in the typed form (this schema's flat keys mapped onto ``comm``, ``profiling``
        and ``reliability`` objects, as nested ``_target_`` nodes) and the ``EmulatedPlatform`` keywords (empty:
        no emulation)."""
        keywords, emulation = typed_keywords(self.to_kwargs())
        node: dict[str, Any] = {"_target_": self._target_}
        for name, value in keywords.items():
            if is_dataclass(value) and not isinstance(value, type):
                value = {"_target_": f"lightning_het.{type(value).__name__}", **asdict(value)}
            node[name] = value
        return node, emulation


#: the :class:`StrategyConfig` fields that :func:`~lightning_het.arguments.validate_strategy_arguments` checks
STRATEGY_CHECKED_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(HeterogeneousConfig))


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
