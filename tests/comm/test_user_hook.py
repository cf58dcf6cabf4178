"""A user's ``ddp_comm_hook`` under ``comm="allreduce"`` (registered by the strategy on any device)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_het import AllReduce, Hierarchical, NodeLocal
from lightning_het.comm.allreduce import register_user_hook
from tests.helpers.gloo import run_gloo


def _hooked(rank: int, world_size: int) -> list[float]:
    """A user's hook (sum the gradients, times its state 2), registered on CPU; the gradient each rank ends with."""
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(1, 1, bias=False))

    def doubled(state, bucket):
        torch.distributed.all_reduce(bucket.buffer())
        future = torch.futures.Future()
        future.set_result(bucket.buffer() * state)
        return future

    register_user_hook(model, AllReduce(), doubled, 2.0, None)
    model(torch.full((1, 1), float(rank + 1))).sum().backward()
    return [float(model.module.weight.grad)]


def test_a_users_hook_runs_on_cpu_and_is_refused_where_a_mode_installs_its_own(tmp_path) -> None:
    model = nn.Linear(1, 1)  # (not wrapped: the checks come first)
    with pytest.raises(ValueError, match=r"`ddp_comm_hook`, but `comm` resolves to 'hierarchical'.*comm='allreduce'"):
        register_user_hook(model, Hierarchical(), lambda state, bucket: None, None, None)
    register_user_hook(model, NodeLocal(), None, None, None)  # no hook: nothing to check
    assert run_gloo(_hooked, 2, tmp_path) == [[6.0], [6.0]]  # inputs 1 and 2: 2 x (1 + 2), not DDP's mean 1.5


def test_a_users_wrapper_wraps_the_users_hook() -> None:
    """``ddp_comm_wrapper`` is applied to ``ddp_comm_hook`` and the wrapped hook is registered with the state."""

    class Recording:
        def register_comm_hook(self, state, hook):
            self.registered = (state, hook)

    def hook(state, bucket):
        return "hooked"

    def wrapper(inner):
        return lambda state, bucket: ("wrapped", inner(state, bucket))

    model = Recording()
    register_user_hook(model, AllReduce(), hook, "state", wrapper)
    state, registered = model.registered
    assert state == "state" and registered(state, None) == ("wrapped", "hooked")
    register_user_hook(model, AllReduce(), hook, None, None)
    assert model.registered == (None, hook)
