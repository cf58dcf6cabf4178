"""The job's rendezvous: a store no stranger can reach, and a per-job secret that signs the watchdog's records
(``docs/reliability.md``)."""

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
_SEPARATOR = "\n"


def ensure_job_token(environ: MutableMapping[str, str] | None = None) -> str:
    """Return the job token from ``environ`` (default ``os.environ``), generating a random one there if absent."""
    environ = os.environ if environ is None else environ
    token = environ.get(TOKEN_ENV, "")
    if not token:
        token = secrets.token_hex(32)
        environ[TOKEN_ENV] = token
    return token


def sign(token: str, key: str, payload: str) -> str:
    """``payload`` followed by its HMAC-SHA256 over ``key`` and ``payload`` (a record cannot move to another key)."""
    mac = hmac.new(token.encode(), f"{key}{_SEPARATOR}{payload}".encode(), hashlib.sha256).hexdigest()
    return f"{payload}{_SEPARATOR}{mac}"


def verify(token: str, key: str, record: str | bytes) -> str | None:
    """The payload of a record written by :func:`sign` with the same token and key, else ``None`` (forged/garbled)."""
    if isinstance(record, bytes):
        try:
            record = record.decode()
        except UnicodeDecodeError:
            return None
    payload, sep, mac = record.rpartition(_SEPARATOR)
    if not sep:
        return None
    expected = hmac.new(token.encode(), f"{key}{_SEPARATOR}{payload}".encode(), hashlib.sha256).hexdigest()
    return payload if hmac.compare_digest(mac, expected) else None


def agree_on_token(token: str) -> str:
    """Make every replica use the same token (collective: every rank of the default process group calls it)."""
    if not dist.is_initialized() or dist.get_world_size() < 2:
        return token
    digest = hashlib.sha256(token.encode()).hexdigest()
    digests: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest)
    if len(set(digests)) == 1 and token:
        return token
    shared = [token or secrets.token_hex(32)]
    dist.broadcast_object_list(shared, src=0)
    if dist.get_rank() == 0:
        log.info(
            "lightning_het: the replicas were started with different job tokens; they now use rank 0's. HINT: export"
            " the same %s on every node.",
            TOKEN_ENV,
        )
    return shared[0]


def listen_address(num_nodes: int, master_addr: str) -> str:
    """The address rank 0's store listens on: loopback for one node, else the address ``master_addr`` resolves to."""
    if num_nodes <= 1:
        return LOOPBACK
    try:
        infos = socket.getaddrinfo(master_addr, None, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        raise ValueError(
            f"You set MASTER_ADDR={master_addr!r}, but it does not resolve to an address ({err}). HINT: use the host"
            " name or IP address of node 0 as the other nodes reach it."
        ) from None
    addresses = [info[4][0] for info in infos]
    ipv4 = [a for a in addresses if ipaddress.ip_address(a).version == 4]
    return (ipv4 or addresses)[0]


def free_port(address: str = LOOPBACK) -> int:
    """A TCP port that is free on ``address`` now (the kernel's choice), e.g. a ``MASTER_PORT`` for a local job."""
    family = socket.AF_INET6 if ipaddress.ip_address(address).version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((address, 0))
        return int(sock.getsockname()[1])


def _listening_socket(address: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ipaddress.ip_address(address).version == 6 else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((address, port))
        sock.listen(socket.SOMAXCONN)
    except OSError as err:
        sock.close()
        raise RuntimeError(
            f"The job's rendezvous store cannot listen on {address}:{port} ({err}). HINT: pick another MASTER_PORT,"
            " or, on several nodes, set MASTER_ADDR to an address of node 0 itself."
        ) from None
    return sock


#: listening sockets handed to stores in this process (kept open as long as the process lives)
_sockets: list[socket.socket] = []


def create_store(
    *, master_addr: str, port: int, rank: int, world_size: int, num_nodes: int, timeout: timedelta
) -> dist.TCPStore:
    """The job's TCPStore: hosted by rank 0 on :func:`listen_address`, reached there by the other ranks."""
    address = listen_address(num_nodes, master_addr)
    if rank != 0:
        host = LOOPBACK if num_nodes <= 1 else master_addr
        return dist.TCPStore(host, port, world_size, False, timeout)
    sock = _listening_socket(address, port)
    _sockets.append(sock)
    return dist.TCPStore(
        address, port, world_size, True, timeout, wait_for_workers=False, master_listen_fd=sock.fileno()
    )


def keep_sockets_local(num_nodes: int, environ: MutableMapping[str, str] | None = None) -> list[str]:
    """Single-node jobs: keep Gloo's and NCCL's bootstrap sockets on the loopback interface (unless the user chose)."""
    environ = os.environ if environ is None else environ
    if num_nodes > 1:
        return []
    loopback = _loopback_interface()
    if loopback is None:
        return []
    names = [name for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if name not in environ]
    for name in names:
        environ[name] = loopback
    return names


@contextlib.contextmanager
def local_sockets(num_nodes: int) -> Iterator[None]:
    """While process groups are created: Gloo's and NCCL's sockets on loopback for a single-node job (see
    :func:`keep_sockets_local`); afterwards the variables are as they were (a group reads them when it is created)."""
    saved = {name: os.environ.get(name) for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
    keep_sockets_local(num_nodes)
    try:
        yield
    finally:
        restore_job_environment(saved)


#: variables a Trainer call sets in ``os.environ`` (job token, loopback interfaces), put back when the call ends
JOB_ENVIRONMENT = (TOKEN_ENV, "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def save_job_environment(environ: MutableMapping[str, str] | None = None) -> dict[str, str | None]:
    """The values of :data:`JOB_ENVIRONMENT` in ``environ`` (default ``os.environ``; ``None``: unset)."""
    environ = os.environ if environ is None else environ
    return {name: environ.get(name) for name in JOB_ENVIRONMENT}


def restore_job_environment(
    saved: dict[str, str | None] | None, environ: MutableMapping[str, str] | None = None
) -> None:
    """Put the variables of ``saved`` (from :func:`save_job_environment`) back; ``None``: nothing to do."""
    if saved is None:
        return
    environ = os.environ if environ is None else environ
    for name, value in saved.items():
        if value is None:
            environ.pop(name, None)
        else:
            environ[name] = value


def _loopback_interface() -> str | None:
    with contextlib.suppress(OSError):
        for _, name in socket.if_nameindex():
            if name == "lo" or name.startswith("lo0"):
                return name
    return None
