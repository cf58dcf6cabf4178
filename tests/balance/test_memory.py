"""Measured memory caps: the search schedule (against every cap), resized batches, trial steps that leave no trace."""

from __future__ import annotations

import doctest
import random
from contextlib import nullcontext

import numpy as np
import pytest
import torch
from torch import nn

from lightning_het.balance import memory
from lightning_het.balance.memory import SEARCH_RESOLUTION, EmulatedMemoryCap, cap_search, measure_cap, resize_batch
from lightning_het.balance.profiler import ProfileCache


def test_doctests() -> None:
    assert doctest.testmod(memory).failed == 0


@pytest.mark.parametrize("start", [1, 3, 8, 24, 100])
def test_search_never_above_and_within_one_step_below(start: int) -> None:
    for cap in range(1, 150):
        for upper in (cap, cap + 1, 2 * cap, 256):
            found, trials = cap_search(lambda n, cap=cap: n <= cap, start, upper)
            best = min(cap, upper)
            assert found <= best and best - found <= max(1, int(found * SEARCH_RESOLUTION))
            assert trials <= 13


def test_search_when_nothing_fits() -> None:
    assert cap_search(lambda n: False, 8, 48) == (0, 4)


def test_resize_batch_repeats_samples_in_any_structure() -> None:
    x = torch.arange(6.0).reshape(3, 2)
    resized = resize_batch({"x": x, "pair": (x[:, 0], "tag")}, 7)
    assert resized["x"].shape == (7, 2) and torch.equal(resized["x"][3], x[0])
    assert resized["pair"][0].shape == (7,) and resized["pair"][1] == "tag"


class _Module(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Dropout(0.5), nn.Linear(4, 1))
        self.logged = 0

    def log(self, *args, **kwargs) -> None:
        self.logged += 1

    def training_step(self, batch):
        random.random()  # the Python and NumPy random states move too
        np.random.rand()
        loss = self.net(batch[0]).pow(2).mean()
        self.log("loss", loss)
        return {"loss": loss}


def test_measure_cap_leaves_the_training_state_as_it_was() -> None:
    module = _Module()
    batch = (torch.randn(10, 3),)
    for p in module.parameters():
        p.grad = torch.ones_like(p)
    buffers = {k: v.clone() for k, v in module.state_dict().items()}
    rng, python_rng, numpy_rng = torch.get_rng_state(), random.getstate(), np.random.get_state()
    emulation = EmulatedMemoryCap(0, 6)  # raised from inside the model's forward, as a device out of memory
    emulation.install(module)
    failed: list[int] = []

    def step(batch):
        try:
            return module.training_step(batch)
        except torch.OutOfMemoryError:
            failed.append(1)
            raise

    cap, trials = measure_cap(step, batch, upper=40, no_sync=nullcontext, module=module, accelerator=False)
    assert cap == 6 and trials <= 8 and 0 < len(failed) < trials  # some trials ran out of memory, some fitted
    assert all(torch.equal(v, module.state_dict()[k]) for k, v in buffers.items())
    assert torch.equal(torch.get_rng_state(), rng) and module.logged == 0
    assert random.getstate() == python_rng and all(
        np.array_equal(a, b) for a, b in zip(np.random.get_state(), numpy_rng)
    )
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in module.parameters())
    margin, _ = measure_cap(module.training_step, batch, upper=40, no_sync=nullcontext, module=module, accelerator=True)
    assert margin == 5  # 10 % kept free on an accelerator


def test_cap_in_the_profile_cache(tmp_path) -> None:
    cache = ProfileCache(tmp_path)
    assert cache.get("k")["cap"] is None
    cache.put("k", cap=12)
    assert cache.get("k")["cap"] == 12 and cache.get("k")["cost"] is None


def test_emulated_cap_raises_inside_the_forward_of_training_only() -> None:
    """The emulated error comes from the model's forward (a pre-hook on the module and its direct submodules), for a
    training forward over the cap only, and goes once removed."""
    module, calls = _Module(), []
    module.net.register_forward_hook(lambda *args: calls.append("net"))
    emulation = EmulatedMemoryCap(2, 4)
    emulation.install(module)
    module.training_step((torch.randn(4, 3),))
    with pytest.raises(torch.OutOfMemoryError, match=r"rank 2 cannot hold 5 samples \(emulate_memory_cap 4\)"):
        module.training_step((torch.randn(5, 3),))
    assert calls == ["net"]  # the failing call never ran the network
    with torch.no_grad():
        module.net(torch.randn(5, 3))  # evaluation: not limited
    emulation.cap = 8
    module.training_step((torch.randn(5, 3),))
    emulation.cap = 4
    emulation.install(None)
    module.training_step((torch.randn(5, 3),))
    emulation.install(module)
    emulation.install(None)  # what the strategy's teardown does: the hooks are gone
    module.training_step((torch.randn(5, 3),))


def test_measure_cap_never_tries_fewer_samples_than_batch_norm_needs() -> None:
    """With ``least=3`` (batch norm: pieces of 2 or more) no trial step runs fewer than 3 samples (batch norm cannot
    train on 1); when 3 do not fit, the cap is 0, for the replicas to end on together."""
    module, tried, emulation = _Module(), [], EmulatedMemoryCap(0, 2)
    emulation.install(module)

    def step(batch):
        tried.append(len(batch[0]))
        return module.training_step(batch)

    batch = (torch.randn(10, 3),)
    kwargs = {"upper": 40, "no_sync": nullcontext, "module": module, "accelerator": False, "least": 3}
    assert measure_cap(step, batch, **kwargs)[0] == 0 and min(tried) >= 3
    assert measure_cap(step, batch, **{**kwargs, "least": 1})[0] == 2  # without batch norm's bound: 2 fits
    emulation.cap = 4
    assert measure_cap(step, batch, **{**kwargs, "accelerator": True})[0] == 3  # the margin keeps 3, not int(3.6)
