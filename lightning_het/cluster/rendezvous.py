"""The job's rendezvous: a store no stranger can reach, the process group started on it with a longer wait, and a
per-job secret that signs the watchdog's records."""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import signal
import socket
import sys
from collections.abc import Iterator, MutableMapping
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_info

log = logging.getLogger(__name__)

#: environment variable that carries the per-job secret from the launcher to the replicas (hex, >= 32 characters).
TOKEN_ENV = "LIGHTNING_HET_JOB_TOKEN"
#: the address a single-node job's store listens on.
LOOPBACK = "127.0.0.1"
_SOCKET_ENV = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
#: variables a Trainer call sets in ``os.environ`` (job token, loopback interfaces), put back when the call ends
JOB_ENVIRONMENT = (TOKEN_ENV, *_SOCKET_ENV)


def ensure_job_token(environ: MutableMapping[str, str] | None = None) -> str:
    """The job token of ``environ`` (default ``os.environ``), generated there if absent."""
    environ = os.environ if environ is None else environ
    environ[TOKEN_ENV] = environ.get(TOKEN_ENV) or secrets.token_hex(32)
    return environ[TOKEN_ENV]


def sign(token: str, key: str, payload: str) -> str:
    """``payload`` followed by its HMAC-SHA256 over ``key`` and ``payload`` (a record cannot move to another key)."""
    mac = hmac.new(token.encode(), f"{key}\n{payload}".encode(), hashlib.sha256).hexdigest()
    return f"{payload}\n{mac}"


def verify(token: str, key: str, record: str | bytes) -> str | None:
    """The payload of a record :func:`sign` wrote with the same token and key, else ``None`` (forged/garbled)."""
    record = record.decode(errors="replace") if isinstance(record, bytes) else record  # garbled: no MAC matches
    payload, sep, _ = record.rpartition("\n")
    return payload if sep and hmac.compare_digest(record.encode(), sign(token, key, payload).encode()) else None


def agree_on_token(token: str) -> str:
    """Make every replica use the same token (collective over the default process group)."""
    if not dist.is_initialized() or dist.get_world_size() < 2:
        return token
    digests: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(digests, hashlib.sha256(token.encode()).hexdigest())
    if len(set(digests)) == 1 and token:
        return token
    shared = [token or secrets.token_hex(32)]
    dist.broadcast_object_list(shared, src=0)
    if dist.get_rank() == 0:
        log.info("lightning_het: the replicas were started with different %s values; they now use rank 0's.", TOKEN_ENV)
    return shared[0]


def listen_address(num_nodes: int, master_addr: str) -> str:
    """Where rank 0's store listens: loopback for one node, else the address ``master_addr`` resolves to."""
    if num_nodes <= 1:
        return LOOPBACK
    try:
        infos = socket.getaddrinfo(master_addr, None, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        raise ValueError(f"MASTER_ADDR={master_addr!r} does not resolve to an address ({err}).") from None
    return min((info[4][0] for info in infos), key=lambda a: ipaddress.ip_address(a).version != 4)  # IPv4 first


def _socket(address: str) -> socket.socket:
    family = socket.AF_INET6 if ipaddress.ip_address(address).version == 6 else socket.AF_INET
    return socket.socket(family, socket.SOCK_STREAM)


def free_port(address: str = LOOPBACK) -> int:
    """A TCP port that is free on ``address`` now (the kernel's choice), e.g. a ``MASTER_PORT`` for a local job."""
    with _socket(address) as sock:
        sock.bind((address, 0))
        return int(sock.getsockname()[1])


def create_store(
    master_addr: str, port: int, rank: int, world_size: int, num_nodes: int, timeout: timedelta
) -> dist.TCPStore:
    """The job's TCPStore: hosted by rank 0 on :func:`listen_address`, reached there by the other ranks."""
    address = listen_address(num_nodes, master_addr)
    if rank != 0:
        return dist.TCPStore(LOOPBACK if num_nodes <= 1 else master_addr, port, world_size, False, timeout)
    sock = _socket(address)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((address, port))
        sock.listen(socket.SOMAXCONN)
    except OSError as err:
        sock.close()
        raise RuntimeError(f"The job's rendezvous store cannot listen on {address}:{port} ({err}).") from None
    fd = sock.detach()  # the listening socket stays open as long as the process lives
    return dist.TCPStore(address, port, world_size, True, timeout, wait_for_workers=False, master_listen_fd=fd)


def keep_sockets_local(num_nodes: int, environ: MutableMapping[str, str] | None = None) -> None:
    """Single-node jobs: Gloo's and NCCL's bootstrap sockets on the loopback interface (unless the user chose)."""
    environ = os.environ if environ is None else environ
    with contextlib.suppress(OSError):
        loopback = next((n for _, n in socket.if_nameindex() if n == "lo" or n.startswith("lo0")), None)
        for name in _SOCKET_ENV if num_nodes <= 1 and loopback else ():
            environ.setdefault(name, loopback)


@contextlib.contextmanager
def local_sockets(num_nodes: int) -> Iterator[None]:
    """While process groups are created: :func:`keep_sockets_local`, the variables put back afterwards."""
    saved = save_job_environment()
    keep_sockets_local(num_nodes)
    try:
        yield
    finally:
        restore_job_environment(saved)


def save_job_environment() -> dict[str, str | None]:
    """The values of :data:`JOB_ENVIRONMENT` in ``os.environ`` (``None``: unset)."""
    return {name: os.environ.get(name) for name in JOB_ENVIRONMENT}


def restore_job_environment(saved: dict[str, str | None] | None) -> None:
    """Put the variables of ``saved`` (from :func:`save_job_environment`) back; ``None``: nothing to do."""
    for name, value in (saved or {}).items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


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


def started_elsewhere(wait: timedelta) -> bool:
    """Whether Lightning's own start-up applies (the group exists, or torchrun's agent hosts the store: then every
    replica arrives there first, within ``wait``)."""
    env = os.environ
    if dist.is_initialized() or env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return dist.is_initialized()
    world_size = int(env["WORLD_SIZE"])
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world_size, False, wait)
    store_barrier(store, world_size, wait, f"lightning_het/joined/{env.get('TORCHELASTIC_RESTART_COUNT', 0)}")
    return True


def init_process_group(member: Any, backend: str, timeout: timedelta | None, wait: timedelta) -> None:
    """Start the default process group on a store only the job can reach, the replicas waiting ``wait`` there."""
    env, rank, world_size, nodes = member.cluster_environment, member.global_rank, member.world_size, member.num_nodes
    device = member.root_device
    try:
        store = create_store(env.main_address, env.main_port, rank, world_size, nodes, wait)
        store_barrier(store, world_size, wait)
        store.set_timeout(timeout if timeout is not None else _TORCH_DEFAULT_TIMEOUT)
        kwargs = {"timeout": timeout, "store": store, "device_id": device if device.type != "cpu" else None}
        with local_sockets(nodes):
            start_default_group(env, backend, **kwargs)
    except (dist.DistError, RuntimeError) as err:  # a replica never joined (hung or died while starting)
        if "timeout" not in str(err).lower() and "timed out" not in str(err).lower():
            raise
        print(
            f"[rank {rank}] lightning_het: not every one of the {world_size} replicas joined the rendezvous within"
            f" {wait.total_seconds():g} s (startup_timeout). Ending the job (exit status 124).",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(124) from err  # the watchdog's exit status (the job ended: no traceback)


def start_default_group(env: Any, backend: str, **kwargs: Any) -> None:
    """``dist.init_process_group`` as Lightning's DDP strategies call it (an NCCL group destroyed at exit)."""
    rank, world_size = env.global_rank(), env.world_size()
    os.environ.update(MASTER_ADDR=env.main_address, MASTER_PORT=str(env.main_port))
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
