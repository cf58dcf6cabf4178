"""Tiny models, data and a reference single-process trainer shared by the multi-process tests.

The Lightning package (*flavour*) of ``pl`` and :data:`HeterogeneousStrategy` here, and so of every helper job's
trainer and modules, is ``lightning.pytorch``, or the standalone ``pytorch_lightning`` when the environment variable
:data:`FLAVOUR_ENV` says so (a test runs a job on that flavour with ``job_env({FLAVOUR_ENV: "pytorch_lightning"})``;
the replicas inherit it).
"""

from __future__ import annotations

import importlib
import os
import time

import torch
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_het
from lightning_het import ProportionalDistributedSampler

#: environment variable naming the Lightning package of the helper jobs: ``lightning`` (default) or
#: ``pytorch_lightning``
FLAVOUR_ENV = "LIGHTNING_HET_TEST_FLAVOUR"
#: the Lightning packages a helper job can run on
FLAVOURS = ("lightning", "pytorch_lightning")
FLAVOUR = os.environ.get(FLAVOUR_ENV, "lightning")
if FLAVOUR not in FLAVOURS:
    raise ValueError(f"{FLAVOUR_ENV}={FLAVOUR!r}: expected one of {FLAVOURS}")
pl = importlib.import_module("pytorch_lightning" if FLAVOUR == "pytorch_lightning" else "lightning.pytorch")
#: the Trainer strategy class of that package
HeterogeneousStrategy = (
    importlib.import_module("lightning_het.pl").HeterogeneousStrategy
    if FLAVOUR == "pytorch_lightning"
    else lightning_het.HeterogeneousStrategy
)


def quiet_trainer(devices: int, strategy, **kwargs) -> pl.Trainer:
    """A ``lightning.pytorch`` CPU Trainer with no logger, checkpoints, progress bar or model summary (``kwargs`` go
    to the Trainer)."""
    import lightning.pytorch

    return lightning.pytorch.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def make_dataset(n: int = 60, features: int = 4, seed: int = 123) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    w = torch.arange(1.0, features + 1.0)
    y = (x @ w + 0.1 * torch.randn(n, generator=g)).unsqueeze(1)
    return TensorDataset(x, y)


def make_net(features: int = 4, seed: int = 7) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(features, 8), nn.Tanh(), nn.Linear(8, 1))


def burn(seconds: float) -> None:
    """Compute (spin) until this process has used ``seconds`` of CPU time: work that ``emulate_slowdown`` stretches,
    unlike a sleep (time off the CPU, as when a replica is descheduled on shared cores)."""
    start = time.process_time()
    while time.process_time() - start < seconds:
        pass


def _loader_parts(batch) -> list:
    """The ``(x, y)`` of each training loader in ``batch``: one, or one per loader of a dict or list that Lightning
    combined."""
    if isinstance(batch, dict):
        return list(batch.values())
    return list(batch) if isinstance(batch[0], (list, tuple)) else [batch]


class TinyRegressor(pl.LightningModule):
    """MSE regression; records the batch size of every training step it runs (``cost_per_sample_s``: seconds slept
    per sample in each step)."""

    def __init__(
        self,
        lr: float = 0.05,
        cost_per_sample_s: float = 0.0,
        slow_factor: float = 1.0,
        slow_rank: int = -1,
        manual: bool = False,
        without_loss: bool = False,
        momentum: float = 0.9,
    ) -> None:
        super().__init__()
        self.momentum = momentum
        self.cost_per_sample_s = cost_per_sample_s
        self.net = make_net()
        self.lr = lr
        self.slow_factor = slow_factor
        self.slow_rank = slow_rank
        self.seen_batch_sizes: list[int] = []
        self.val_seen = 0
        self.val_mse = torchmetrics.MeanSquaredError()
        self.automatic_optimization = not manual
        self.without_loss = without_loss  # training_step returns a dict without "loss" (a user mistake)

    def training_step(self, batch, batch_idx):
        parts = _loader_parts(batch)
        loss = sum(nn.functional.mse_loss(self.net(x), y) for x, y in parts)
        x = torch.cat([x for x, _ in parts])
        if self.cost_per_sample_s:
            # a step whose cost is proportional to its batch; `slow_factor` times heavier on `slow_rank`
            factor = self.slow_factor if self.global_rank == self.slow_rank else 1.0
            time.sleep(self.cost_per_sample_s * x.shape[0] * factor)
        self.log("train/loss", loss, on_step=False, on_epoch=True, batch_size=x.shape[0], sync_dist=True)
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
        return {"mse": loss} if self.without_loss else loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_seen += int(x.shape[0])
        self.val_mse(self.net(x), y)
        self.log("val/mse", self.val_mse, on_epoch=True)

    def on_train_batch_start(self, batch, batch_idx):
        sizes = [int(x.shape[0]) for x, _ in _loader_parts(batch)]
        self.seen_batch_sizes.append(sizes[0] if len(sizes) == 1 else sizes)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


def reference_weights(
    dataset,
    global_batch: int,
    epochs: int,
    seed: int,
    lr: float = 0.05,
    shuffle: bool = True,
    accumulate: int = 1,
    order_sampler=None,
):
    """One process, plain torch, training on the same global batches the distributed run draws (the tail as a last,
    smaller batch; ``order_sampler``: the user's sampler whose order is cut into batches).

    With ``accumulate > 1`` each optimizer step averages the gradients of ``accumulate`` consecutive global batches,
    as Lightning's ``accumulate_grad_batches`` does (a trailing partial group still steps at epoch end).
    """
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    sampler = ProportionalDistributedSampler(
        dataset, [global_batch], 0, shuffle=shuffle, seed=seed, order_sampler=order_sampler
    )
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        batches = list(DataLoader(dataset, batch_size=global_batch, sampler=sampler))
        for i, (x, y) in enumerate(batches):
            (nn.functional.mse_loss(net(x), y) / accumulate).backward()
            if (i + 1) % accumulate == 0 or i + 1 == len(batches):
                opt.step()
                opt.zero_grad()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}
