"""Device maps for mixed CPU/GPU jobs (parsing, backend, CPU threads) and ``MixedAccelerator``."""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.accelerators import Accelerator, CPUAccelerator, CUDAAccelerator

from lightning_het.arguments import expect, int_list, positive_int

log = logging.getLogger(__name__)

DeviceEntry = str | int | torch.device
#: a map for every node, or ``{node_rank: map}`` when nodes differ
DeviceMapArg = str | Sequence[DeviceEntry] | Mapping[int | str, str | Sequence[DeviceEntry]]

_ALLOWED_FORMS = "'cpu', 'cuda', 'cuda:<index>', 'gpu', 'gpu:<index>', an integer GPU index or a torch.device"


def _as_list(device_map: object, name: str) -> list[object]:
    """A map's entries as a list (from a comma-separated string or any non-string sequence, e.g. a ListConfig)."""
    if isinstance(device_map, (str, torch.device)):
        entries = [part.strip() for part in device_map.split(",")] if isinstance(device_map, str) else [device_map]
    elif isinstance(device_map, (bytes, Mapping)) or not hasattr(device_map, "__iter__"):
        raise ValueError(f"Expected `{name}` to be a list of devices, but got {device_map!r}.")
    else:
        entries = list(device_map)  # type: ignore[call-overload]
    expect(entries != [] and entries != [""], name, "a map of at least one device", device_map)
    return entries


def _parse_entry(entry: object, name: str) -> tuple[str, int | None]:
    """``("cpu", None)``, ``("cuda", index)`` or ``("cuda", None)`` for a bare ``"cuda"``/``"gpu"``."""
    if isinstance(entry, int) and not isinstance(entry, bool):
        expect(entry >= 0, name, "a GPU index >= 0", entry)
        return "cuda", entry
    text = str(entry) if isinstance(entry, torch.device) else entry.strip().lower() if isinstance(entry, str) else ""
    kind, sep, index = text.partition(":")
    kind = "cuda" if kind == "gpu" else kind
    if kind == "cpu" and (not sep or index == "0"):
        return "cpu", None
    if kind == "cuda" and (not sep or index.isdigit()):
        return "cuda", int(index) if sep else None
    raise ValueError(f"Expected argument `{name}` to be one of {_ALLOWED_FORMS}, but got {entry!r}.")


def parse_device_map(
    device_map: str | Sequence[DeviceEntry],
    local_world_size: int | None = None,
    cuda_device_count: int | None = None,
    *,
    name: str = "device_map",
) -> list[torch.device]:
    """One node's device map as one :class:`torch.device` per local replica (a bare ``"cuda"`` takes a free index).

    >>> parse_device_map(["cuda", "cpu", "cuda:0"], cuda_device_count=2)
    [device(type='cuda', index=1), device(type='cpu'), device(type='cuda', index=0)]
    """
    entries = _as_list(device_map, name)
    parsed = [_parse_entry(entry, f"{name}[{i}]") for i, entry in enumerate(entries)]
    if local_world_size is not None and len(parsed) != local_world_size:
        raise ValueError(
            f"You set `{name}` with {len(parsed)} entries, but the node runs {local_world_size} replicas"
            f" (Trainer(devices={local_world_size})). HINT: leave `devices` at 'auto' so that the map decides."
        )
    taken = {index for kind, index in parsed if kind == "cuda" and index is not None}
    devices, seen = [], {}
    for i, (kind, index) in enumerate(parsed):
        if kind == "cpu":
            devices.append(torch.device("cpu"))
            continue
        if index is None:  # a bare "cuda": the lowest index not taken
            index = min(set(range(len(taken) + 1)) - taken)
            taken.add(index)
        devices.append(torch.device("cuda", index))
        if cuda_device_count == 0:
            raise ValueError(
                f"You set `{name}` with CUDA replicas, but no CUDA device is visible on this host"
                f" (torch.cuda.device_count()=0, CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})."
            )
        if cuda_device_count is not None and index >= cuda_device_count:
            raise ValueError(
                f"You set `{name}[{i}]`={entries[i]!r} (-> {devices[i]}), but only {cuda_device_count} CUDA"
                " device(s) are visible on this host (indices count from 0 among the visible devices)."
            )
        first = seen.setdefault(index, i)
        if first != i:
            raise ValueError(
                f"You set `{name}` with {devices[i]} twice (`{name}[{first}]`={entries[first]!r} and"
                f" `{name}[{i}]`={entries[i]!r}): two replicas cannot share one GPU."
            )
    return devices


def node_device_maps(device_map: DeviceMapArg, num_nodes: int | None = None, *, name: str = "device_map") -> list[list]:
    """The raw map of every node: ``[map] * num_nodes`` for one shared map, or the values of ``{node_rank: map}``."""
    if not isinstance(device_map, Mapping):
        return [list(_as_list(device_map, name)) for _ in range(num_nodes or 1)]
    per_node: dict[int, list] = {}
    for key, value in device_map.items():
        if isinstance(key, bool) or not str(key).strip().isdigit():
            raise ValueError(f"Expected the keys of `{name}` to be node ranks (integers >= 0), but got {key!r}.")
        per_node[int(str(key))] = _as_list(value, f"{name}[{key!r}]")
    ranks = sorted(per_node)
    if not ranks or ranks != list(range(num_nodes if num_nodes is not None else len(ranks))):
        expected = num_nodes if num_nodes is not None else len(ranks)
        raise ValueError(f"You set `{name}` for node ranks {ranks}, but the job has {expected} node(s).")
    lengths = {rank: len(entries) for rank, entries in per_node.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"You set `{name}` with different numbers of replicas per node ({lengths}).")
    return [per_node[rank] for rank in ranks]


def parse_node_maps(
    device_map: DeviceMapArg, num_nodes: int | None = None, local_world_size: int | None = None, counts: Any = None
) -> list[list[torch.device]]:
    """Every node's map parsed (``counts``: ``{node_rank: visible CUDA devices}`` where known)."""
    named, counts = isinstance(device_map, Mapping), counts or {}
    return [
        parse_device_map(m, local_world_size, counts.get(r), name=f"device_map[{r}]" if named else "device_map")
        for r, m in enumerate(node_device_maps(device_map, num_nodes))
    ]


def choose_backend(devices: Sequence[torch.device], requested: str | None = None) -> str:
    """The ``torch.distributed`` backend for a job whose replicas run on ``devices`` (every replica of every node)."""
    kinds = sorted({d.type for d in devices})
    if not requested:
        return "nccl" if kinds == ["cuda"] else "gloo"
    backend = str(requested).strip().lower()
    counts = ", ".join(f"{sum(d.type == k for d in devices)} {k.upper()}" for k in kinds)
    given = f"You set `process_group_backend`={requested!r}, but the job"
    if len(kinds) > 1 and backend != "gloo":
        raise ValueError(f"{given} mixes CPU and CUDA replicas ({counts}): only Gloo can reduce across both.")
    if kinds != ["cuda"] and "nccl" in backend:
        raise ValueError(f"{given} has CPU replicas ({counts}); NCCL only communicates CUDA tensors.")
    return backend


def available_cpu_cores() -> int:
    """Cores this process may run on (its CPU affinity, e.g. a SLURM allocation), else ``os.cpu_count()``."""
    return max(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1, 1)


def plan_cpu_threads(
    devices: Sequence[torch.device], cpu_cores: int, cpu_threads: int | Sequence[int] | None = None
) -> list[int]:
    """Intra-op threads of each local replica of one node (one per CUDA replica, the rest shared by the CPU ones).

    >>> plan_cpu_threads([torch.device("cuda", 0), torch.device("cpu"), torch.device("cpu")], cpu_cores=16)
    [1, 8, 7]
    """
    if isinstance(cpu_threads, int):
        threads = positive_int("cpu_threads", cpu_threads, allow_none=False)
        cpu_threads = [1 if d.type == "cuda" else threads for d in devices]  # type: ignore[misc]
    elif isinstance(cpu_threads, (str, bytes)) or (cpu_threads is not None and not hasattr(cpu_threads, "__iter__")):
        raise ValueError(f"Expected `cpu_threads`: an integer or one integer per local replica: {cpu_threads!r}")
    if cpu_threads is not None:
        counts = int_list("cpu_threads", cpu_threads) or []
        if len(counts) != len(devices):
            raise ValueError(
                f"You set `cpu_threads`={counts} with {len(counts)} entries, but the node runs {len(devices)}"
            )
        if sum(counts) > cpu_cores:
            message = f"`cpu_threads`={counts} asks for {sum(counts)} threads on a node with {cpu_cores} available"
            warnings.warn(f"{message} cores.", stacklevel=2)
        return counts
    cpu_ranks = [i for i, d in enumerate(devices) if d.type != "cuda"]
    counts, free = [1] * len(devices), cpu_cores - (len(devices) - len(cpu_ranks))
    if cpu_ranks and free < len(cpu_ranks):
        warnings.warn(
            f"The node has {cpu_cores} available cores for {len(devices) - len(cpu_ranks)} CUDA replica(s) and"
            f" {len(cpu_ranks)} CPU replica(s): every CPU replica gets 1 thread.",
            stacklevel=2,
        )
        free = len(cpu_ranks)
    for j, rank in enumerate(cpu_ranks):
        counts[rank] = free // len(cpu_ranks) + (j < free % len(cpu_ranks))
    return counts


@dataclass(frozen=True)
class DevicePlan:
    """Where every replica of a job runs, the backend they share and this node's thread counts."""

    local_devices: tuple[torch.device, ...]
    global_devices: tuple[torch.device, ...]
    backend: str
    threads: tuple[int, ...]

    @property
    def mixed(self) -> bool:
        """Whether the job has both CPU and CUDA replicas (then no rank binds a device to the default group)."""
        return len({d.type for d in self.global_devices}) > 1


def plan_devices(
    device_map: DeviceMapArg,
    *,
    node_rank: int,
    num_nodes: int,
    local_world_size: int,
    cuda_device_count: int,
    requested_backend: str | None = None,
    cpu_threads: int | Sequence[int] | None = None,
    cpu_cores: int | None = None,
) -> DevicePlan:
    """Resolve a device map for this node and the whole job (every check that can run before the workers start)."""
    expect(0 <= node_rank < num_nodes, "node_rank", f"in [0, {num_nodes}) (NODE_RANK / cluster env)", node_rank)
    parsed = parse_node_maps(device_map, num_nodes, local_world_size, {node_rank: cuda_device_count})
    everyone, local = tuple(d for node in parsed for d in node), tuple(parsed[node_rank])
    threads = plan_cpu_threads(local, cpu_cores if cpu_cores is not None else available_cpu_cores(), cpu_threads)
    return DevicePlan(local, everyone, choose_backend(everyone, requested_backend), tuple(threads))


class MixedAcceleratorMixin:
    """Flavour-independent body of :class:`MixedAccelerator` (``lightning.pytorch`` or ``pytorch_lightning``)."""

    def __init__(self, device_map: DeviceMapArg, cpu_threads: int | Sequence[int] | None = None) -> None:
        parse_node_maps(device_map)  # keys, equal lengths, syntax and duplicates; each node's GPU count: later
        per_node = node_device_maps(device_map)
        # as given (one list for every node, or {node_rank: list}), free of config-library types
        plain = [[e if isinstance(e, int) and not isinstance(e, bool) else str(e) for e in m] for m in per_node]
        self.device_map: list | dict = dict(enumerate(plain)) if isinstance(device_map, Mapping) else plain[0]
        self._local_world_size = len(per_node[0])
        self.cpu_threads = cpu_threads if cpu_threads is None or isinstance(cpu_threads, int) else list(cpu_threads)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device_map={self.device_map!r}, cpu_threads={self.cpu_threads!r})"

    def setup_device(self, device: torch.device) -> None:
        if device.type == "cuda":
            CUDAAccelerator().setup_device(device)  # Lightning's: the float32 matmul precision hint, set_device

    def setup(self, trainer: Any) -> None:
        strategy = trainer.strategy
        if getattr(strategy, "device_plan", None) is None:
            raise TypeError(
                f"MixedAccelerator places replicas through HeterogeneousStrategy, but the trainer uses"
                f" {type(strategy).__name__}. HINT: use `strategy=HeterogeneousStrategy(device_map=...)`."
            )
        if strategy.root_device.type == "cuda":
            CUDAAccelerator().teardown()  # Lightning's way to empty the CUDA cache and the cuBLAS workspaces

    def get_device_stats(self, device: torch.device | str | int) -> dict[str, Any]:
        device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        return (CUDAAccelerator() if device.type == "cuda" else CPUAccelerator()).get_device_stats(device)

    def teardown(self) -> None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            CUDAAccelerator().teardown()

    def auto_device_count(self) -> int:  # type: ignore[override]  # replicas per node: the map's length
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
            raise ValueError(f"With a device map, `devices` is a process count per node or 'auto', got {devices!r}.")
        return devices

    @staticmethod
    def get_parallel_devices(devices: int) -> list[torch.device]:  # placeholders: the strategy sets the map's
        return [torch.device("cpu")] * int(devices)

    @staticmethod
    def name() -> str:
        return "mixed"


class MixedAccelerator(MixedAcceleratorMixin, Accelerator):
    """Accelerator for jobs that mix CPU and CUDA replicas; use it with ``HeterogeneousStrategy``."""


def apply_local_settings(strategy: Any) -> None:
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
def unbound_process_group(strategy: Any) -> Iterator[None]:
    """Around ``setup_distributed`` in a mixed job: no rank binds a device to the default group (hides CUDA)."""
    plan: DevicePlan | None = getattr(strategy, "device_plan", None)
    devices = strategy.parallel_devices
    if plan is not None and plan.mixed:
        strategy.parallel_devices = [torch.device("cpu")] * len(devices)
    try:
        yield
    finally:
        strategy.parallel_devices = devices


def device_labels(strategy: Any) -> list[str]:
    """The device of every global rank, as text (node-major ranks under a map; the local devices repeated otherwise)."""
    plan: DevicePlan | None = getattr(strategy, "device_plan", None)
    if plan is not None:
        return [str(d) for d in plan.global_devices]
    return [str(d) for d in (strategy.parallel_devices or [])] * max(int(strategy.num_nodes or 1), 1)
