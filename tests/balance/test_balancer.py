"""The balancer's agreement on micro-batch caps: at fixed steps, the same on every replica, not at every step."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from torch import nn

from lightning_het import HeterogeneousStrategy
from lightning_het.balance.balancer import CAPS_AGREED_EVERY, Balancer


def test_caps_agreed_every_few_steps_and_at_the_epoch_end() -> None:
    balancer = Balancer(HeterogeneousStrategy(max_micro_batch_sizes=[8, 64]).config)
    balancer.place(0, 2, torch.device("cpu"), 2)
    gathered: list[int] = []
    step = 0

    def all_gather(values: list[float]) -> list[list[float]]:
        gathered.append(step)
        return [values, [64.0, 0.0]]

    balancer.all_gather_floats = all_gather  # type: ignore[method-assign]
    assert balancer.micro is not None
    for step in range(40):
        if step == 3:  # an out-of-memory error in step 3 halves rank 0's cap; rank 1 learns it at the next agreement
            balancer.micro.lower(8, torch.OutOfMemoryError("emulated"))
        balancer.agree_caps(step, 40)
        if step == CAPS_AGREED_EVERY - 2:
            assert balancer.allocation.micro_caps is None and balancer.micro.pending
    assert gathered == [CAPS_AGREED_EVERY - 1, 2 * CAPS_AGREED_EVERY - 1, 39]  # and the epoch's last step
    assert balancer.allocation.micro_caps == [4, 64] and not balancer.micro.pending


def _norm_model(synced: bool) -> nn.Module:
    norm = nn.SyncBatchNorm(4) if synced else nn.BatchNorm1d(4)
    return nn.Sequential(nn.Linear(3, 4), norm, nn.Linear(4, 1))


def test_sync_batchnorm_is_refused_with_micro_batching_only() -> None:
    def placed(**keywords) -> Balancer:
        balancer = Balancer(HeterogeneousStrategy(**keywords).config)
        balancer.place(0, 2, torch.device("cpu"), 1)
        return balancer

    micro = placed(max_micro_batch_sizes=[8, 64])
    with pytest.raises(
        ValueError, match=r"SyncBatchNorm layer\(s\) \(1\).*HINT: drop `Trainer\(sync_batchnorm=True\)`"
    ):
        micro.check_normalisation(_norm_model(synced=True))
    with pytest.raises(ValueError, match="emulate_memory_cap"):
        placed(emulate_memory_cap=[8, 64]).check_normalisation(_norm_model(synced=True))
    micro.check_normalisation(_norm_model(synced=False))  # per-replica batch norm: warned about, not refused
    assert micro.batchnorm_layers == ["1"]
    norms = nn.Sequential(
        nn.BatchNorm2d(2), nn.LazyBatchNorm3d(), nn.InstanceNorm1d(2), nn.LayerNorm(2), nn.GroupNorm(1, 2)
    )
    micro.check_normalisation(norms)  # every kind of batch norm torch has; the other normalisations are no concern
    assert micro.batchnorm_layers == ["0", "1"]
    plain = placed()
    plain.check_normalisation(_norm_model(synced=True))  # one forward per step on every replica: fine
    assert plain.batchnorm_layers == []


def test_measured_caps_below_what_batch_norm_needs_end_every_replica() -> None:
    """``"auto"`` with batch norm: a replica that cannot hold a micro-batch of 3 (the least cap that never leaves a
    piece of 1) ends the fit with the same message on every replica (after the caps' all-gather)."""
    from lightning_het.balance.memory import EmulatedMemoryCap

    balancer = Balancer(HeterogeneousStrategy(max_micro_batch_sizes="auto").config)
    balancer.place(0, 1, torch.device("cpu"), 1)
    balancer.allocation.global_batch_size = 8
    module = _norm_model(synced=False)
    balancer.check_normalisation(module)
    assert balancer.micro is not None and balancer.micro.least_cap == 3
    EmulatedMemoryCap(0, 2).install(module)
    x = torch.randn(8, 3)
    with pytest.raises(RuntimeError, match=r"not even a training step of 3 sample\(s\) \(the model's batch norm"):
        balancer.measure_caps(lambda piece: module(piece).pow(2).mean(), x, nullcontext, module)
