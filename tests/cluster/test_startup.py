"""Process-group start-up: what it leaves in the environment when Lightning's own tests drive it by hand."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch.distributed as dist
from lightning.fabric import Fabric
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

import lightning_het.cluster.rendezvous as rendezvous
from lightning_het import HeterogeneousFabricStrategy, HeterogeneousStrategy
from lightning_het.cluster.rendezvous import local_sockets
from lightning_het.cluster.topology import build_node_groups

SOCKETS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def _sockets() -> dict[str, str | None]:
    return {name: os.environ.get(name) for name in SOCKETS}


def test_local_sockets_sets_loopback_only_inside(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth9")  # the user's choice stands
    with local_sockets(1):
        assert os.environ["GLOO_SOCKET_IFNAME"] == "lo" and os.environ["NCCL_SOCKET_IFNAME"] == "eth9"
    assert _sockets() == {"GLOO_SOCKET_IFNAME": None, "NCCL_SOCKET_IFNAME": "eth9"}
    with local_sockets(2):  # several nodes: the interface that reaches them is the user's to choose
        assert "GLOO_SOCKET_IFNAME" not in os.environ


@pytest.mark.parametrize("flavour", ["trainer", "fabric"])
def test_setup_environment_by_hand_leaves_no_socket_variable(monkeypatch, flavour):
    """As Lightning's own DDP tests do: `setup_environment()` without a fit or a teardown. The default group (on the
    job-only store) and the node groups are created with Gloo's sockets on loopback; the variables are gone again
    afterwards. Trainer and Fabric alike."""
    for name in SOCKETS:
        monkeypatch.delenv(name, raising=False)
    seen = []
    real_init, real_subgroups = rendezvous.start_default_group, dist.new_subgroups_by_enumeration

    def init(*args, **kwargs):
        seen.append(_sockets())
        return real_init(*args, **kwargs)

    def subgroups(*args, **kwargs):
        seen.append(_sockets())
        return real_subgroups(*args, **kwargs)

    monkeypatch.setattr(rendezvous, "start_default_group", init)
    monkeypatch.setattr(dist, "new_subgroups_by_enumeration", subgroups)
    if flavour == "trainer":
        trainer = Trainer(accelerator="cpu", devices=1, strategy=HeterogeneousStrategy(), max_epochs=1, logger=False)
        trainer.strategy.connect(BoringModel())
        strategy = trainer.strategy
    else:
        strategy = Fabric(accelerator="cpu", devices=1, strategy=HeterogeneousFabricStrategy()).strategy
    try:
        strategy.setup_environment()
        assert dist.is_initialized()
        build_node_groups([0], 0)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert len(seen) == 3 and all(s["GLOO_SOCKET_IFNAME"] == "lo" for s in seen), seen
    assert _sockets() == dict.fromkeys(SOCKETS)


@pytest.mark.parametrize("num_nodes", [1, 2])
def test_local_sockets_restores_after_an_error(monkeypatch, num_nodes):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    with pytest.raises(RuntimeError, match="boom"), local_sockets(num_nodes):
        raise RuntimeError("boom")
    assert "GLOO_SOCKET_IFNAME" not in os.environ


def test_the_rendezvous_waits_startup_timeout_or_the_longer_collective_timeout():
    assert rendezvous.rendezvous_wait(timedelta(seconds=5)) == rendezvous.DEFAULT_STARTUP_TIMEOUT
    assert rendezvous.rendezvous_wait(timedelta(seconds=5), 30) == timedelta(seconds=30)
    assert rendezvous.rendezvous_wait(timedelta(seconds=60), 30) == timedelta(seconds=60)  # the longer timeout
    assert rendezvous.rendezvous_wait(None, 30) == timedelta(minutes=30)  # torch's default timeout


def test_store_barrier_waits_for_every_rank_then_times_out():
    store = dist.HashStore()
    rendezvous.store_barrier(store, 1, timedelta(seconds=1))  # alone: through at once
    with pytest.raises(RuntimeError, match=r"(?i)timeout"):
        rendezvous.store_barrier(store, 2, timedelta(milliseconds=300), key="two")  # the other rank never comes


def test_the_group_gets_the_collective_timeout_after_the_longer_wait(monkeypatch):
    """The replicas wait ``startup_timeout`` for each other on the job's store; the default group and the store
    then time out after ``timeout`` (no private setter: the group is created with it)."""
    seen = {}
    real_init = rendezvous.start_default_group

    def init(env, backend, **kwargs):
        seen.update(kwargs, store_timeout=kwargs["store"].timeout)
        return real_init(env, backend, **kwargs)

    real_barrier = rendezvous.store_barrier
    monkeypatch.setattr(rendezvous, "start_default_group", init)
    monkeypatch.setattr(rendezvous, "store_barrier", lambda *a, **k: seen.update(wait=a[2]) or real_barrier(*a, **k))
    trainer = Trainer(
        accelerator="cpu", devices=1, strategy=HeterogeneousStrategy(timeout=5, startup_timeout=40), logger=False
    )
    trainer.strategy.connect(BoringModel())
    try:
        trainer.strategy.setup_environment()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert trainer.strategy.process_group_timeout == timedelta(seconds=5)
    assert seen["wait"] == timedelta(seconds=40)
    assert seen["timeout"] == seen["store_timeout"] == timedelta(seconds=5)
