"""Micro-batches: splitting any batch structure, the exact accumulated gradient, the out-of-memory fallback."""

from __future__ import annotations

import doctest
from collections import namedtuple
from contextlib import nullcontext
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_het import HeterogeneousStrategy
from lightning_het.data import microbatch
from lightning_het.data.microbatch import (
    MicroBatcher,
    batch_length,
    micro_batch_sizes,
    micro_batches,
    split_batch,
)
from tests.helpers.tiny import quiet_trainer

Pair = namedtuple("Pair", ["x", "y"])


def test_doctests() -> None:
    assert doctest.testmod(microbatch).failed == 0


@pytest.mark.parametrize(("b", "cap"), [(16, 3), (24, 8), (7, 7), (1, 5), (48, 5), (10, 1)])
def test_sizes_at_most_the_cap_and_as_few_as_possible(b: int, cap: int) -> None:
    sizes = micro_batch_sizes(b, cap)
    assert sum(sizes) == b and max(sizes) <= cap and len(sizes) == -(-b // cap)
    assert max(sizes) - min(sizes) <= 1


def test_split_keeps_the_structure() -> None:
    x, y = torch.arange(10.0).reshape(5, 2), torch.arange(5)
    batch = {"pair": Pair(x, y), "list": [x, "tag"], "scalar": torch.tensor(1.0)}
    assert batch_length(batch) == 5 and batch_length(["a", 3]) is None
    pieces = split_batch(batch, [3, 2])
    assert isinstance(pieces[1]["pair"], Pair) and torch.equal(pieces[1]["pair"].y, y[3:])
    assert torch.equal(pieces[0]["list"][0], x[:3]) and pieces[0]["list"][1] == "tag"
    assert pieces[1]["scalar"] is batch["scalar"]  # a 0-d tensor has no first dimension: repeated
    assert [w for _, w in micro_batches((x, y), 2)] == pytest.approx([0.4, 0.4, 0.2])


def _setup(seed: int = 0):
    torch.manual_seed(seed)
    net = nn.Linear(3, 1)
    x, y = torch.randn(16, 3), torch.randn(16, 1)
    return net, (x, y)


def _run(micro: MicroBatcher, net: nn.Module, batch, as_dict: bool = False) -> torch.Tensor:
    def step(piece):
        loss = nn.functional.mse_loss(net(piece[0]), piece[1])
        return {"loss": loss, "n": len(piece[0])} if as_dict else loss

    params = list(net.parameters())
    for p in params:  # stale gradients, which the loop zeroes between the step and its backward
        p.grad = torch.full_like(p, 7.0)
    output = micro.run(step, batch, lambda loss: loss.backward(), nullcontext, params)
    for p in params:
        p.grad = None
    micro.restore_grads(params)
    loss = output["loss"] if as_dict else output
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize("as_dict", [False, True])
def test_accumulated_gradient_is_the_whole_batch_gradient(as_dict: bool) -> None:
    net, batch = _setup()
    whole = nn.functional.mse_loss(net(batch[0]), batch[1])
    expected = torch.autograd.grad(whole, list(net.parameters()))
    loss = _run(MicroBatcher(0, cap=3), net, batch, as_dict)
    assert loss.item() == pytest.approx(whole.item(), rel=1e-6)  # the returned loss is the share's mean
    for p, g in zip(net.parameters(), expected):
        assert torch.allclose(p.grad, g, atol=1e-6)


def _run_limited(micro: MicroBatcher, limit: list[int]) -> None:
    """:func:`_run` on the 16 samples of :func:`_setup` with a network that raises ``torch.OutOfMemoryError`` itself
    on a training forward of more than ``limit[0]`` samples; the gradient must be the whole batch's."""
    net, batch = _setup()
    whole = nn.functional.mse_loss(net(batch[0]), batch[1])
    expected = torch.autograd.grad(whole, list(net.parameters()))

    def out_of_memory_above(module, args):
        if args[0].shape[0] > limit[0]:
            raise torch.OutOfMemoryError(f"out of memory: {args[0].shape[0]} samples")

    net.register_forward_pre_hook(out_of_memory_above)
    params = list(net.parameters())

    def step(piece):
        return nn.functional.mse_loss(net(piece[0]), piece[1])

    output = micro.run(step, batch, lambda loss: loss.backward(), nullcontext, params)
    micro.restore_grads(params)
    output.backward()
    for p, g in zip(params, expected):
        assert torch.allclose(p.grad, g, atol=1e-6)


def test_out_of_memory_lowers_the_cap_once_and_stays_exact() -> None:
    micro = MicroBatcher(1, cap=8)  # the first piece of 8 fails: cap 4, the rest in pieces of 4
    _run_limited(micro, [5])
    assert micro.cap == 4 and micro.lowered_from == 8 and micro.pending
    with pytest.raises(
        RuntimeError, match=r"Rank 1 ran out of memory.*cap at 4 \(lowered from 8.*`max_micro_batch_sizes\[1\]`"
    ):
        _run_limited(micro, [3])


@pytest.mark.parametrize("cap", [None, 16, 64])
def test_out_of_memory_of_a_share_run_at_once_is_caught(cap: int | None) -> None:
    """A share the cap lets run in one piece (or no cap at all) takes the short path; a real out-of-memory error from
    the model there lowers the cap, and the share runs in pieces, exactly."""
    micro = MicroBatcher(0, cap=cap)
    _run_limited(micro, [10])
    assert micro.cap == 8 and micro.lowered_from == (cap or 16)


def test_batch_norm_pieces_keep_two_samples() -> None:
    """With ``min_piece=2`` (batch norm layers) a lowered cap stays at 3 or more, and no cap of 3 or more splits a
    share of 2 samples or more into a piece of 1."""
    assert all(min(micro_batch_sizes(b, cap)) >= 2 for cap in range(3, 40) for b in range(2, 200))
    micro = MicroBatcher(0, cap=4, min_piece=2)
    assert micro.least_cap == 3 and MicroBatcher(0, cap=4).least_cap == 1
    _run_limited(micro, [3])  # a piece of 4 fails: the cap becomes 3, not 2 (which splits a share of 3 as [2, 1])
    assert micro.cap == 3
    with pytest.raises(RuntimeError, match=r"no smaller micro-batch is possible with batch norm layers"):
        MicroBatcher(0, cap=3, min_piece=2).lower(3, torch.OutOfMemoryError("out of memory"))


def test_manual_optimization_is_told_what_to_do() -> None:
    manual, batch = SimpleNamespace(automatic_optimization=False), _setup()[1]

    def step(micro: MicroBatcher) -> Any:
        return micro.training_step(lambda b: "stepped", [batch], {}, manual, lambda loss: None, nullcontext)

    assert step(MicroBatcher(0, cap=16)) == "stepped"  # the share fits: the user's step runs as given
    with pytest.raises(RuntimeError, match=r"exceeds its micro-batch cap 4.*micro_batches\(batch, cap\)"):
        step(MicroBatcher(0, cap=4))
    with pytest.raises(RuntimeError, match="must return the loss"):
        MicroBatcher(0, cap=4).run(lambda piece: None, _setup()[1], lambda loss: None, nullcontext)


class _Counted(pl.LightningModule):
    """A linear regression that counts its backward hooks."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(3, 1)
        self.before_backward = 0

    def training_step(self, batch, batch_idx):
        return nn.functional.mse_loss(self.net(batch[0]).float(), batch[1])

    def on_before_backward(self, loss) -> None:
        self.before_backward += 1

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(precision: str, caps: list[int] | None) -> _Counted:
    torch.manual_seed(0)
    model = _Counted()
    data = TensorDataset(torch.randn(48, 3), torch.randn(48, 1))
    strategy = HeterogeneousStrategy(speeds=[1.0], max_micro_batch_sizes=caps, process_group_backend="gloo")
    quiet_trainer(1, strategy, max_epochs=1, precision=precision).fit(model, DataLoader(data, batch_size=16))
    return model


@pytest.mark.parametrize(("precision", "atol"), [("32-true", 1e-6), ("bf16-mixed", 2e-3)])
def test_every_piece_backwards_through_lightning_with_the_precision_plugin(precision: str, atol: float) -> None:
    """Every piece runs through DDP's forward and Lightning's backward (its hooks, autocast and grad scaler): the
    weights are the whole batch's."""
    whole, micro = _fit(precision, None), _fit(precision, [3])
    assert micro.before_backward == 6 * 3  # three steps of 16 samples in pieces of at most 3
    for a, b in zip(whole.parameters(), micro.parameters()):
        assert torch.allclose(a, b, atol=atol)


class _Collective(_Counted):
    """Logs its loss on every step synchronised, or (``gather``) all-gathers it in ``training_step``."""

    def __init__(self, gather: bool) -> None:
        super().__init__()
        self.gather = gather
        self.pieces: list[tuple[float, int]] = []  # (loss, samples) of every piece

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.gather:
            self.all_gather(loss)
        self.log("step_loss", loss, on_step=True, on_epoch=True, sync_dist=True, batch_size=len(batch[0]))
        self.pieces.append((float(loss), len(batch[0])))
        return loss


def _fit_collective(gather: bool) -> _Collective:
    torch.manual_seed(0)
    model = _Collective(gather)
    data = TensorDataset(torch.randn(48, 3), torch.randn(48, 1))
    strategy = HeterogeneousStrategy(speeds=[1.0], max_micro_batch_sizes=[5], process_group_backend="gloo")
    quiet_trainer(1, strategy, max_epochs=1).fit(model, DataLoader(data, batch_size=16))
    return model


def test_synchronised_logging_in_micro_batches_and_other_collectives_refused() -> None:
    """``self.log(..., sync_dist=True)`` in an earlier piece synchronises nothing (the step's last piece does: the
    replicas run different numbers of pieces): the step's value is its last piece's, the epoch's the mean over every
    sample. Another collective there names the problem."""
    model = _fit_collective(gather=False)
    assert [n for _, n in model.pieces] == [4, 4, 4, 4] * 3  # 16 samples in pieces of at most 5
    metrics = model.trainer.callback_metrics
    assert float(metrics["step_loss_step"]) == pytest.approx(model.pieces[-1][0])
    mean = sum(loss * n for loss, n in model.pieces) / 48
    assert float(metrics["step_loss_epoch"]) == pytest.approx(mean, rel=1e-6)
    with pytest.raises(RuntimeError, match=r"Rank 0 called `all_gather` in `training_step`.*at most 5"):
        _fit_collective(gather=True)


class _LoggedWithoutBatchSize(_Counted):
    """Logs its loss per epoch in the common form, without ``batch_size`` (Lightning infers it from the batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.pieces: list[tuple[float, int]] = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("loss", loss, on_step=False, on_epoch=True)
        self.pieces.append((float(loss.detach()), len(batch[0])))
        return loss


def test_epoch_value_logged_without_batch_size_weighs_each_micro_batch_by_its_size() -> None:
    torch.manual_seed(0)
    model = _LoggedWithoutBatchSize()
    data = TensorDataset(torch.randn(48, 3), torch.randn(48, 1))
    strategy = HeterogeneousStrategy(speeds=[1.0], max_micro_batch_sizes=[6], process_group_backend="gloo")
    quiet_trainer(1, strategy, max_epochs=1).fit(model, DataLoader(data, batch_size=16))
    assert [n for _, n in model.pieces] == [6, 5, 5] * 3  # uneven pieces: a count per piece would show
    mean = sum(loss * n for loss, n in model.pieces) / 48
    assert float(model.trainer.callback_metrics["loss"]) == pytest.approx(mean, rel=1e-6)


class _Normalised(_Counted):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))


@pytest.mark.parametrize("cap", [1, 2])
def test_batch_norm_with_a_cap_that_leaves_one_sample_pieces_is_refused_at_setup(cap: int) -> None:
    """A share of 3 under a cap of 2 would run as [2, 1], and batch norm cannot train on 1 sample: refused at setup,
    naming the argument."""
    data = TensorDataset(torch.randn(12, 3), torch.randn(12, 1))
    strategy = HeterogeneousStrategy(speeds=[1.0], max_micro_batch_sizes=[cap], process_group_backend="gloo")
    with pytest.raises(
        ValueError, match=rf"`max_micro_batch_sizes\[0\]` is {cap}.*HINT: set `max_micro_batch_sizes\[0\]` to 3"
    ):
        quiet_trainer(1, strategy, max_epochs=1).fit(_Normalised(), DataLoader(data, batch_size=3))


def test_batch_norm_with_a_cap_of_three_trains() -> None:
    data = TensorDataset(torch.randn(20, 3), torch.randn(20, 1))
    strategy = HeterogeneousStrategy(speeds=[1.0], max_micro_batch_sizes=[3], process_group_backend="gloo")
    model = _Normalised()
    quiet_trainer(1, strategy, max_epochs=1).fit(model, DataLoader(data, batch_size=5))  # 5 samples: [3, 2]
    assert model.trainer.global_step == 4
