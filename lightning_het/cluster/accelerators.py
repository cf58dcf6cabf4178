"""``MixedAccelerator``: one Lightning accelerator for a job whose replicas run on different device types."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import torch
from lightning.pytorch.accelerators import Accelerator, CUDAAccelerator

from lightning_het._flavour import trainer_flavour
from lightning_het.cluster.devices import DeviceMapArg, DevicePlan, node_device_maps, parse_device_map, plan_devices

log = logging.getLogger(__name__)


def _plain_entry(entry: Any) -> str | int:
    return entry if isinstance(entry, int) and not isinstance(entry, bool) else str(entry)


def _plain_map(device_map: DeviceMapArg) -> list[str | int] | dict[int, list[str | int]]:
    """A picklable, config-library-free copy (e.g. of an omegaconf ListConfig/DictConfig)."""
    if isinstance(device_map, Mapping):
        return {
            int(str(k)) if str(k).strip().isdigit() else k: [_plain_entry(e) for e in node_device_maps(v)[0]]
            for k, v in device_map.items()
        }
    return [_plain_entry(e) for e in node_device_maps(device_map)[0]]


class MixedAcceleratorMixin:
    """Flavour-independent body of :class:`MixedAccelerator` (``lightning.pytorch`` or ``pytorch_lightning``)."""

    def __init__(self, device_map: DeviceMapArg, cpu_threads: int | Sequence[int] | None = None) -> None:
        self.device_map = _plain_map(device_map)  # as given: one list for every node, or {node_rank: list}
        per_node = node_device_maps(self.device_map)  # checks keys and equal lengths
        for rank, entries in enumerate(per_node):
            name = "device_map" if not isinstance(self.device_map, Mapping) else f"device_map[{rank}]"
            parse_device_map(entries, name=name)  # syntax and duplicates; the GPU count is checked per node later
        self._local_world_size = len(per_node[0])
        if cpu_threads is not None and not isinstance(cpu_threads, int):
            cpu_threads = list(cpu_threads)
        self.cpu_threads: int | list[int] | None = cpu_threads

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device_map={self.device_map!r}, cpu_threads={self.cpu_threads!r})"

    def setup_device(self, device: torch.device) -> None:
        """Select the CUDA device of a CUDA replica; nothing for a CPU replica (no CUDA context is created)."""
        if device.type == "cuda":
            CUDAAccelerator().setup_device(device)  # Lightning's: the float32 matmul precision hint, set_device
        elif device.type != "cpu":
            raise ValueError(f"MixedAccelerator runs replicas on 'cpu' or 'cuda' devices, got {device}.")

    def setup(self, trainer: Any) -> None:
        strategy = trainer.strategy
        if getattr(strategy, "device_plan", None) is None:
            raise TypeError(
                f"MixedAccelerator places replicas through HeterogeneousStrategy, but the trainer uses"
                f" {type(strategy).__name__}, which would run every replica on {strategy.root_device}. HINT: use"
                " `strategy=HeterogeneousStrategy(device_map=...)` (or `strategy='heterogeneous'`)."
            )
        if strategy.root_device.type == "cuda":
            CUDAAccelerator().teardown()  # Lightning's way to empty the CUDA cache and the cuBLAS workspaces

    def get_device_stats(self, device: torch.device | str | int) -> dict[str, Any]:
        """``torch.cuda.memory_stats`` for a CUDA replica, Lightning's CPU stats (psutil) for a CPU replica."""
        device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        if device.type == "cuda":
            return torch.cuda.memory_stats(device)
        from lightning.pytorch.accelerators.cpu import get_cpu_stats

        return get_cpu_stats()

    def teardown(self) -> None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            CUDAAccelerator().teardown()

    def auto_device_count(self) -> int:  # type: ignore[override]  # an instance method: the count is the map's
        """Replicas per node: the length of the map (``Trainer(devices='auto')`` picks it up)."""
        return self._local_world_size

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def parse_devices(devices: int | str) -> int:
        """``Trainer(devices=...)``: a number of processes per node (the map says which device each one gets)."""
        if isinstance(devices, str) and devices.strip().isdigit():
            devices = int(devices)
        if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
            raise ValueError(
                f"With a device map, `Trainer(devices=...)` is a number of processes per node (an int > 0) or"
                f" 'auto' (the map's length), but got {devices!r}. HINT: list the devices in the map, not in `devices`."
            )
        return devices

    @staticmethod
    def get_parallel_devices(devices: int) -> list[torch.device]:
        """Placeholders (CPU); the strategy replaces them with the map's devices before any worker starts."""
        return [torch.device("cpu")] * int(devices)

    @staticmethod
    def name() -> str:
        return "mixed"

    @classmethod
    def register_accelerators(cls, accelerator_registry: Any) -> None:
        """Not registered by name: it needs a device map (pass an instance, or ``device_map`` to the strategy)."""


class MixedAccelerator(MixedAcceleratorMixin, Accelerator):
    """Accelerator for jobs that mix CPU and CUDA replicas; use it with ``HeterogeneousStrategy``."""


def mixed_accelerator_class(strategy_cls: type) -> type:
    """The ``MixedAccelerator`` for a strategy's Lightning flavour (``lightning.pytorch`` or ``pytorch_lightning``)."""
    return trainer_flavour(strategy_cls).MixedAccelerator


def mixed_accelerator_kwargs(
    strategy_cls: type, device_map: DeviceMapArg | None, cpu_threads: int | Sequence[int] | None, kwargs: dict[str, Any]
) -> dict[str, Any]:
    """The strategy's ``DDPStrategy`` keywords, with ``accelerator=MixedAccelerator(device_map)`` given a map."""
    if device_map is None:
        if cpu_threads is not None:
            raise ValueError(
                f"You set `cpu_threads`={cpu_threads!r} without a `device_map`. HINT: threads are planned per mapped"
                " replica; for a CPU-only job use e.g. `device_map=['cpu', 'cpu']`, or set OMP_NUM_THREADS."
            )
        return kwargs
    for clash in ("accelerator", "parallel_devices"):
        if kwargs.get(clash) is not None:
            raise ValueError(
                f"You set both `device_map` and `{clash}`={kwargs[clash]!r}. HINT: the device map decides where each"
                f" replica runs; drop `{clash}`."
            )
    return {**kwargs, "accelerator": mixed_accelerator_class(strategy_cls)(device_map, cpu_threads=cpu_threads)}


class DeviceStrategy(Protocol):
    """What the device functions use of the strategy; ``parallel_devices`` is the one attribute they set."""

    parallel_devices: list[torch.device] | None

    @property
    def accelerator(self) -> Any: ...
    @property
    def cluster_environment(self) -> Any: ...
    @property
    def precision_plugin(self) -> Any: ...
    @property
    def num_nodes(self) -> int: ...
    @property
    def num_processes(self) -> int: ...
    @property
    def process_group_backend(self) -> str | None: ...
    @property
    def local_rank(self) -> int: ...
    @property
    def global_rank(self) -> int: ...
    @property
    def root_device(self) -> torch.device: ...


def _check_precision(strategy: DeviceStrategy, plan: DevicePlan) -> None:
    plugin = getattr(strategy, "precision_plugin", None)
    names = {c.__name__ for c in type(plugin).__mro__}
    has_cpu = any(d.type == "cpu" for d in plan.global_devices)
    if "MixedPrecision" in names and has_cpu and getattr(plugin, "precision", None) == "16-mixed":
        raise ValueError(
            "You set `precision='16-mixed'` with CPU replicas in the device map: float16 autocast and its gradient"
            " scaler are CUDA-only. HINT: use `precision='bf16-mixed'` (autocast on each replica's own device) or"
            " '32-true'."
        )


def configure_devices(strategy: DeviceStrategy) -> DevicePlan | None:
    """Resolve the accelerator's device map for this node and set the strategy's ``parallel_devices``."""
    accelerator = strategy.accelerator
    if not isinstance(accelerator, MixedAcceleratorMixin):
        return None
    environment = strategy.cluster_environment
    plan = plan_devices(
        accelerator.device_map,
        node_rank=environment.node_rank() if environment is not None else 0,
        num_nodes=strategy.num_nodes,
        local_world_size=strategy.num_processes,
        cuda_device_count=torch.cuda.device_count(),  # NVML-based under Lightning: creates no CUDA context
        requested_backend=strategy.process_group_backend,
        cpu_threads=accelerator.cpu_threads,
    )
    _check_precision(strategy, plan)
    strategy.parallel_devices = list(plan.local_devices)
    log.debug(f"device map: local {[str(d) for d in plan.local_devices]}, backend {plan.backend}")
    return plan


def apply_local_settings(strategy: DeviceStrategy) -> None:
    """In each worker: this replica's intra-op threads, and its own autocast device under ``bf16-mixed``."""
    plan: DevicePlan | None = getattr(strategy, "device_plan", None)
    if plan is None:
        return
    threads = plan.threads[strategy.local_rank]
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    plugin = getattr(strategy, "precision_plugin", None)
    if hasattr(plugin, "device") and getattr(plugin, "precision", None) == "bf16-mixed":
        plugin.device = strategy.root_device.type  # Lightning chose "cuda" for a non-CPU accelerator
    log.info(f"replica {strategy.global_rank}: {strategy.root_device}, {threads} intra-op thread(s)")


@contextmanager
def unbound_process_group(strategy: DeviceStrategy) -> Iterator[None]:
    """Around ``setup_distributed``: in a mixed job, no rank binds a device to the default process group.

    A bound device makes torch create later subgroups by splitting the bound backend, unbound ranks create them
    normally: in one job the two paths would not meet. Hiding the CUDA devices keeps every rank unbound.
    """
    plan: DevicePlan | None = getattr(strategy, "device_plan", None)
    if plan is None or plan.bind_device_id:
        yield
        return
    devices = strategy.parallel_devices
    strategy.parallel_devices = [torch.device("cpu")] * len(devices)
    try:
        yield
    finally:
        strategy.parallel_devices = devices


def device_labels(strategy: DeviceStrategy) -> list[str]:
    """The device of every global rank, as text (node-major ranks under a map; the local devices repeated otherwise)."""
    plan: DevicePlan | None = getattr(strategy, "device_plan", None)
    if plan is not None:
        return [str(d) for d in plan.global_devices]
    local = [str(d) for d in (strategy.parallel_devices or [])]
    return local * max(int(strategy.num_nodes or 1), 1)
