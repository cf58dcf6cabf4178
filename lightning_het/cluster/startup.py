"""Process-group start-up: a rendezvous only the job can reach, a longer wait for it, and every rank's node id."""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_info

from lightning_het.cluster.rendezvous import create_store, local_sockets
from lightning_het.cluster.topology import gather_node_ids, validate_node_ids

log = logging.getLogger(__name__)

#: the least time the replicas wait for each other at start-up (``startup_timeout``'s default)
DEFAULT_STARTUP_TIMEOUT = timedelta(minutes=10)
_TORCH_DEFAULT_TIMEOUT = timedelta(minutes=30)


def rendezvous_wait(timeout: timedelta | None, startup_timeout: timedelta | float | None = None) -> timedelta:
    """How long the replicas wait for each other: ``startup_timeout`` (default 10 minutes) or, when longer, the
    collective ``timeout`` (``None``: torch's 30 minutes)."""
    startup = DEFAULT_STARTUP_TIMEOUT if startup_timeout is None else startup_timeout
    startup = timedelta(seconds=startup) if isinstance(startup, (int, float)) else startup
    return max(startup, timeout if timeout is not None else _TORCH_DEFAULT_TIMEOUT)


def store_barrier(store: dist.Store, world_size: int, wait: timedelta, key: str = "lightning_het/joined") -> None:
    """Return once all ``world_size`` ranks called it on ``store``, waiting at most ``wait``."""
    store.set_timeout(wait)
    if store.add(key, 1) == world_size:
        store.set(f"{key}/all", "1")
    store.wait([f"{key}/all"])


def started_elsewhere() -> bool:
    """Whether Lightning's own start-up applies: torchrun's agent hosts the store, or the group already exists."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true" or dist.is_initialized()


def wait_under_torchrun(wait: timedelta) -> None:
    """Under torchrun's agent store: every replica arrives (within ``wait``) before Lightning starts the group."""
    if dist.is_initialized():
        return
    world_size, env = int(os.environ["WORLD_SIZE"]), os.environ
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world_size, False, wait)
    store_barrier(store, world_size, wait, f"lightning_het/joined/{env.get('TORCHELASTIC_RESTART_COUNT', 0)}")


def init_process_group(member: Any, backend: str, timeout: timedelta | None, wait: timedelta) -> None:
    """Start the default process group on a store only the job can reach, the replicas waiting ``wait`` there."""
    env, rank, world_size = member.cluster_environment, member.global_rank, member.world_size
    device = member.root_device
    try:
        store = create_store(
            master_addr=env.main_address,
            port=env.main_port,
            rank=rank,
            world_size=world_size,
            num_nodes=member.num_nodes,
            timeout=wait,
        )
        store_barrier(store, world_size, wait)
        store.set_timeout(timeout if timeout is not None else _TORCH_DEFAULT_TIMEOUT)
        kwargs = {"timeout": timeout, "store": store, "device_id": device if device.type != "cpu" else None}
        with local_sockets(member.num_nodes):
            start_default_group(env, backend, **kwargs)
    except (dist.DistError, RuntimeError) as err:  # a replica never joined (hung or died while starting)
        if "timeout" not in str(err).lower() and "timed out" not in str(err).lower():
            raise
        from lightning_het.reliability.verdicts import WATCHDOG_EXIT_CODE, JobEnded

        print(
            f"[rank {rank}] lightning_het: not every one of the {world_size} replicas joined the rendezvous within"
            f" {wait.total_seconds():g} s (startup_timeout). Ending the job (exit status {WATCHDOG_EXIT_CODE}).",
            file=sys.stderr,
            flush=True,
        )
        raise JobEnded(WATCHDOG_EXIT_CODE) from err


def start_default_group(env: Any, backend: str, **kwargs: Any) -> None:
    """``dist.init_process_group`` as Lightning's DDP strategies call it (an NCCL group destroyed at exit)."""
    if dist.is_initialized():
        return
    rank, world_size = env.global_rank(), env.world_size()
    os.environ["MASTER_ADDR"] = env.main_address
    os.environ["MASTER_PORT"] = str(env.main_port)
    log.info(f"Initializing distributed: GLOBAL_RANK: {rank}, MEMBER: {rank + 1}/{world_size}")
    dist.init_process_group(backend, rank=rank, world_size=world_size, **kwargs)
    if backend == "nccl":
        atexit.register(_destroy_default_group)
    rank_zero_info(
        f"{'-' * 100}\ndistributed_backend={backend}\n"
        f"All distributed processes registered. Starting with {world_size} processes\n{'-' * 100}\n"
    )


def _destroy_default_group() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C must not interrupt it
    if dist.is_initialized():
        dist.destroy_process_group()
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def detect_node_ids(given: list[int] | None, world_size: int, env: Any) -> list[int]:
    """The user's ``node_ids``, else one all-gather of (node rank, host name) over the job."""
    return validate_node_ids(given, world_size) if given is not None else gather_node_ids(env)
