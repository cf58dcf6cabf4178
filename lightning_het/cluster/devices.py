"""Device maps for mixed CPU/GPU jobs: parsing, backend choice and CPU threads (``docs/mixed_devices.md``; pure)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

DeviceEntry = str | int | torch.device
#: a map for every node, or ``{node_rank: map}`` when nodes differ
DeviceMapArg = str | Sequence[DeviceEntry] | Mapping[int | str, str | Sequence[DeviceEntry]]

_ALLOWED_FORMS = "'cpu', 'cuda', 'cuda:<index>', 'gpu', 'gpu:<index>', an integer GPU index or a torch.device"


def _as_list(device_map: object, name: str) -> list[object]:
    """A map's entries as a list (from a comma-separated string or any non-string sequence, e.g. a ListConfig)."""
    if isinstance(device_map, str):
        entries: list[object] = [part.strip() for part in device_map.split(",")]
    elif isinstance(device_map, torch.device):
        entries = [device_map]
    elif isinstance(device_map, (bytes, Mapping)) or not hasattr(device_map, "__iter__"):
        raise ValueError(
            f"Expected argument `{name}` to be a list of devices (e.g. ['cuda:0', 'cpu']), but got {device_map!r}."
        )
    else:
        entries = list(device_map)  # type: ignore[call-overload]
    if not entries or entries == [""]:
        raise ValueError(f"Expected argument `{name}` to hold at least one device, but got {device_map!r}.")
    return entries


def _parse_entry(entry: object, name: str) -> tuple[str, int | None]:
    """``("cpu", None)``, ``("cuda", index)`` or ``("cuda", None)`` for a bare ``"cuda"``/``"gpu"``."""
    if isinstance(entry, bool):
        raise ValueError(f"Expected argument `{name}` to be one of {_ALLOWED_FORMS}, but got {entry!r}.")
    if isinstance(entry, int):
        if entry < 0:
            raise ValueError(f"Expected argument `{name}` to be a GPU index >= 0, but got {entry!r}.")
        return "cuda", entry
    if isinstance(entry, torch.device):
        text = str(entry)
    elif isinstance(entry, str):
        text = entry.strip().lower()
    else:
        raise ValueError(f"Expected argument `{name}` to be one of {_ALLOWED_FORMS}, but got {entry!r}.")
    kind, sep, index_text = text.partition(":")
    kind = "cuda" if kind == "gpu" else kind
    if kind == "cpu" and (not sep or index_text == "0"):
        return "cpu", None
    if kind == "cuda":
        if not sep:
            return "cuda", None
        if index_text.isdigit():
            return "cuda", int(index_text)
    raise ValueError(f"Expected argument `{name}` to be one of {_ALLOWED_FORMS}, but got {entry!r}.")


def _visible_devices_hint() -> str:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return f"CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else "CUDA_VISIBLE_DEVICES unset"


def parse_device_map(
    device_map: str | Sequence[DeviceEntry],
    local_world_size: int | None = None,
    cuda_device_count: int | None = None,
    *,
    allow_shared_cuda: bool = False,
    name: str = "device_map",
) -> list[torch.device]:
    """Parse one node's device map into one :class:`torch.device` per local replica.

    Example:
        >>> parse_device_map(["cuda", "cpu", "cuda:0"], cuda_device_count=2)
        [device(type='cuda', index=1), device(type='cpu'), device(type='cuda', index=0)]
    """
    entries = _as_list(device_map, name)
    parsed = [_parse_entry(entry, f"{name}[{i}]") for i, entry in enumerate(entries)]
    if local_world_size is not None and len(parsed) != local_world_size:
        raise ValueError(
            f"You set `{name}` with {len(parsed)} entries ({[str(e) for e in entries]}), but the node runs"
            f" {local_world_size} replicas (Trainer(devices={local_world_size})). HINT: give one device per local"
            f" replica, or leave `devices` at 'auto' so that the map decides."
        )
    explicit = {index for kind, index in parsed if kind == "cuda" and index is not None}
    next_free = 0
    devices: list[torch.device] = []
    for kind, index in parsed:
        if kind == "cpu":
            devices.append(torch.device("cpu"))
            continue
        if index is None:
            while next_free in explicit:
                next_free += 1
            index = next_free
            explicit.add(index)
        devices.append(torch.device("cuda", index))
    _check_cuda(devices, entries, name, cuda_device_count, allow_shared_cuda)
    return devices


def _check_cuda(
    devices: list[torch.device], entries: list, name: str, cuda_device_count: int | None, allow_shared_cuda: bool
) -> None:
    """The map's CUDA replicas exist on this host and (unless allowed) do not share a GPU."""
    cuda_positions = [i for i, d in enumerate(devices) if d.type == "cuda"]
    if cuda_positions and cuda_device_count is not None:
        if cuda_device_count < 1:
            raise ValueError(
                f"You set `{name}`={[str(e) for e in entries]} with {len(cuda_positions)} CUDA replica(s), but no CUDA"
                f" device is visible on this host (torch.cuda.device_count()=0, torch {torch.__version__},"
                f" {_visible_devices_hint()}). HINT: run on a GPU node with a CUDA build of torch, or map the replicas"
                " to 'cpu'."
            )
        for i in cuda_positions:
            if devices[i].index is not None and devices[i].index >= cuda_device_count:
                raise ValueError(
                    f"You set `{name}[{i}]`={entries[i]!r} (-> {devices[i]}), but only {cuda_device_count} CUDA"
                    f" device(s) are visible on this host ({_visible_devices_hint()}); the map has"
                    f" {len(cuda_positions)} CUDA replica(s). HINT: indices count from 0 among the visible devices;"
                    " use fewer CUDA replicas or map the others to 'cpu'."
                )
    if not allow_shared_cuda:
        seen: dict[int | None, int] = {}
        for i in cuda_positions:
            first = seen.setdefault(devices[i].index, i)
            if first != i:
                raise ValueError(
                    f"You set `{name}` with {devices[i]} twice (`{name}[{first}]`={entries[first]!r} and"
                    f" `{name}[{i}]`={entries[i]!r}): two replicas cannot share one GPU. HINT: give each CUDA replica"
                    " its own index, or map the extra replica to 'cpu'."
                )


def node_device_maps(device_map: DeviceMapArg, num_nodes: int | None = None, *, name: str = "device_map") -> list[list]:
    """The raw map of every node: ``[map] * num_nodes`` for one shared map, or the values of ``{node_rank: map}``."""
    if not isinstance(device_map, Mapping):
        entries = _as_list(device_map, name)
        return [list(entries) for _ in range(num_nodes or 1)]
    per_node: dict[int, list] = {}
    for key, value in device_map.items():
        text = str(key).strip()
        if isinstance(key, bool) or not text.isdigit():
            raise ValueError(
                f"Expected the keys of `{name}` to be node ranks (integers >= 0), but got {key!r}."
                " HINT: use {0: [...], 1: [...]} or one list for every node."
            )
        per_node[int(text)] = _as_list(value, f"{name}[{key!r}]")
    if not per_node:
        raise ValueError(f"Expected argument `{name}` to hold at least one node, but got {dict(device_map)!r}.")
    ranks = sorted(per_node)
    expected = list(range(num_nodes)) if num_nodes is not None else list(range(len(ranks)))
    if ranks != expected:
        raise ValueError(
            f"You set `{name}` for node ranks {ranks}, but the job has {num_nodes if num_nodes is not None else '?'}"
            f" node(s) (ranks {expected}). HINT: give exactly one map per node rank."
        )
    lengths = {rank: len(entries) for rank, entries in per_node.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(
            f"You set `{name}` with different numbers of replicas per node ({lengths}); Lightning runs the same number"
            " of processes on every node. HINT: pad the smaller maps with 'cpu' replicas."
        )
    return [per_node[rank] for rank in ranks]


def is_mixed(devices: Sequence[torch.device]) -> bool:
    """Whether ``devices`` holds both CPU and CUDA replicas."""
    kinds = {d.type for d in devices}
    return "cpu" in kinds and "cuda" in kinds


def choose_backend(devices: Sequence[torch.device], requested: str | None = None) -> str:
    """The ``torch.distributed`` backend for a job whose replicas run on ``devices`` (every replica of every node)."""
    if not devices:
        raise ValueError("Expected at least one replica device to choose a process-group backend, got none.")
    kinds = sorted({d.type for d in devices})
    counts = ", ".join(f"{sum(d.type == k for d in devices)} {k.upper()}" for k in kinds)
    if not requested:
        return "nccl" if kinds == ["cuda"] else "gloo"
    backend = str(requested).strip().lower()
    if kinds == ["cuda"]:
        return backend
    if is_mixed(devices) and backend != "gloo":
        raise ValueError(
            f"You set `process_group_backend`={requested!r}, but the job mixes CPU and CUDA replicas ({counts}): only"
            " Gloo can reduce a CPU tensor on one rank with a CUDA tensor on another. HINT: leave"
            " `process_group_backend` unset (Gloo is chosen) or set it to 'gloo'."
        )
    if "nccl" in backend:
        raise ValueError(
            f"You set `process_group_backend`={requested!r}, but the job has CPU replicas ({counts}); NCCL only"
            " communicates CUDA tensors. HINT: leave `process_group_backend` unset or use 'gloo'."
        )
    return backend


def available_cpu_cores() -> int:
    """Cores this process may run on (its CPU affinity, e.g. a SLURM allocation), else ``os.cpu_count()``."""
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except (AttributeError, OSError):  # not Linux
        return max(os.cpu_count() or 1, 1)


def plan_cpu_threads(
    devices: Sequence[torch.device], cpu_cores: int, cpu_threads: int | Sequence[int] | None = None
) -> list[int]:
    """Intra-op threads (``torch.set_num_threads``) of each local replica of one node.

    Example:
        >>> plan_cpu_threads([torch.device("cuda", 0), torch.device("cpu"), torch.device("cpu")], cpu_cores=16)
        [1, 8, 7]
    """
    if isinstance(cpu_cores, bool) or not isinstance(cpu_cores, int) or cpu_cores < 1:
        raise ValueError(f"Expected argument `cpu_cores` to be an integer >= 1, but got {cpu_cores!r}.")
    n = len(devices)
    if cpu_threads is not None:
        if isinstance(cpu_threads, int) and not isinstance(cpu_threads, bool):
            counts = [1 if d.type == "cuda" else cpu_threads for d in devices]
            given = [cpu_threads]
        elif isinstance(cpu_threads, (str, bytes)) or not hasattr(cpu_threads, "__iter__"):
            raise ValueError(
                f"Expected argument `cpu_threads` to be an integer or one integer per local replica, but got"
                f" {cpu_threads!r}."
            )
        else:
            counts = given = list(cpu_threads)
            if len(counts) != n:
                raise ValueError(
                    f"You set `cpu_threads`={counts} with {len(counts)} entries, but the node runs {n} replicas"
                    f" ({[str(d) for d in devices]}). HINT: give one count per local replica, or a single integer for"
                    " every CPU replica."
                )
        for i, c in enumerate(given):
            if isinstance(c, bool) or not isinstance(c, int) or c < 1:
                where = "`cpu_threads`" if isinstance(cpu_threads, int) else f"`cpu_threads[{i}]`"
                raise ValueError(f"Expected {where} to be an integer >= 1, but got {c!r}.")
        if sum(counts) > cpu_cores:
            warnings.warn(
                f"`cpu_threads`={counts} asks for {sum(counts)} threads on a node with {cpu_cores} available cores;"
                " the replicas will compete for cores and CPU replicas will run (and be profiled) slower.",
                stacklevel=2,
            )
        return [int(c) for c in counts]
    n_cuda = sum(d.type == "cuda" for d in devices)
    cpu_ranks = [i for i, d in enumerate(devices) if d.type != "cuda"]
    counts = [1] * n
    if cpu_ranks:
        free = cpu_cores - n_cuda
        if free < len(cpu_ranks):
            warnings.warn(
                f"The node has {cpu_cores} available cores for {n_cuda} CUDA replica(s) (one core each) and"
                f" {len(cpu_ranks)} CPU replica(s); every CPU replica gets 1 thread and the processes will compete for"
                " cores. HINT: use fewer CPU replicas per node.",
                stacklevel=2,
            )
            free = len(cpu_ranks)
        share, extra = divmod(free, len(cpu_ranks))
        for j, rank in enumerate(cpu_ranks):
            counts[rank] = share + (1 if j < extra else 0)
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
        """Whether the job has both CPU and CUDA replicas (on any node)."""
        return is_mixed(self.global_devices)

    @property
    def bind_device_id(self) -> bool:
        """Whether a process may bind its device to the default process group (``init_process_group(device_id=)``)."""
        # binding changes how later subgroups are created, so it must be the same on every rank: not in mixed jobs
        return not self.mixed


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
    if not 0 <= node_rank < num_nodes:
        raise ValueError(f"Expected `node_rank` in [0, {num_nodes}), but got {node_rank} (NODE_RANK / cluster env).")
    per_node = node_device_maps(device_map, num_nodes)
    parsed = [
        parse_device_map(
            entries,
            local_world_size,
            cuda_device_count if rank == node_rank else None,
            name="device_map" if not isinstance(device_map, Mapping) else f"device_map[{rank}]",
        )
        for rank, entries in enumerate(per_node)
    ]
    everyone = tuple(d for node in parsed for d in node)
    backend = choose_backend(everyone, requested_backend)
    local = tuple(parsed[node_rank])
    threads = plan_cpu_threads(local, cpu_cores if cpu_cores is not None else available_cpu_cores(), cpu_threads)
    return DevicePlan(local_devices=local, global_devices=everyone, backend=backend, threads=tuple(threads))
