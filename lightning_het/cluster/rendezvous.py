"""The job's rendezvous: a store no stranger can reach, and a per-job secret that signs the watchdog's records."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import socket
from collections.abc import Iterator, MutableMapping
from datetime import timedelta
from typing import Any

import torch.distributed as dist

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
    if not environ.get(TOKEN_ENV):
        environ[TOKEN_ENV] = secrets.token_hex(32)
    return environ[TOKEN_ENV]


def _mac(token: str, key: str, payload: str) -> str:
    return hmac.new(token.encode(), f"{key}\n{payload}".encode(), hashlib.sha256).hexdigest()


def sign(token: str, key: str, payload: str) -> str:
    """``payload`` followed by its HMAC-SHA256 over ``key`` and ``payload`` (a record cannot move to another key)."""
    return f"{payload}\n{_mac(token, key, payload)}"


def verify(token: str, key: str, record: str | bytes) -> str | None:
    """The payload of a record :func:`sign` wrote with the same token and key, else ``None`` (forged/garbled)."""
    record = record.decode(errors="replace") if isinstance(record, bytes) else record  # garbled: no MAC matches
    payload, sep, mac = record.rpartition("\n")
    return payload if sep and hmac.compare_digest(mac, _mac(token, key, payload)) else None


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
    """The address rank 0's store listens on: loopback for one node, else the address ``master_addr`` resolves to."""
    if num_nodes <= 1:
        return LOOPBACK
    try:
        infos = socket.getaddrinfo(master_addr, None, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        raise ValueError(f"MASTER_ADDR={master_addr!r} does not resolve to an address ({err}).") from None
    addresses = [info[4][0] for info in infos]
    ipv4 = [a for a in addresses if ipaddress.ip_address(a).version == 4]
    return (ipv4 or addresses)[0]


def _socket(address: str) -> socket.socket:
    family = socket.AF_INET6 if ipaddress.ip_address(address).version == 6 else socket.AF_INET
    return socket.socket(family, socket.SOCK_STREAM)


def free_port(address: str = LOOPBACK) -> int:
    """A TCP port that is free on ``address`` now (the kernel's choice), e.g. a ``MASTER_PORT`` for a local job."""
    with _socket(address) as sock:
        sock.bind((address, 0))
        return int(sock.getsockname()[1])


_sockets: list[socket.socket] = []  # listening sockets handed to stores (open as long as the process lives)


def create_store(
    *, master_addr: str, port: int, rank: int, world_size: int, num_nodes: int, timeout: timedelta
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
    _sockets.append(sock)
    return dist.TCPStore(
        address, port, world_size, True, timeout, wait_for_workers=False, master_listen_fd=sock.fileno()
    )


def keep_sockets_local(num_nodes: int, environ: MutableMapping[str, str] | None = None) -> list[str]:
    """Single-node jobs: Gloo's and NCCL's bootstrap sockets on the loopback interface (unless the user chose)."""
    environ = os.environ if environ is None else environ
    loopback = None
    with contextlib.suppress(OSError):
        loopback = next((n for _, n in socket.if_nameindex() if n == "lo" or n.startswith("lo0")), None)
    if num_nodes > 1 or loopback is None:
        return []
    names = [name for name in _SOCKET_ENV if name not in environ]
    for name in names:
        environ[name] = loopback
    return names


@contextlib.contextmanager
def local_sockets(num_nodes: int) -> Iterator[None]:
    """While process groups are created: :func:`keep_sockets_local`, the variables put back afterwards."""
    saved = {name: os.environ.get(name) for name in _SOCKET_ENV}
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
