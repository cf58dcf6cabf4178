"""Profiled fits whose modules check Lightning's contract: ``python -m tests.helpers.run_inloop OUT_DIR JSON``.

JSON: one config or a list (see :func:`tests.helpers.jobs.run_configs`); keys ``devices`` (2), ``epochs`` (2),
``n`` (320), ``batch_size`` (16, per replica), ``manual`` (manual optimization), ``gan`` (manual optimization of two
networks, one per backward), ``strategy`` (extra ``HeterogeneousStrategy`` keywords), ``loader`` (extra
``DataLoader`` keywords), ``limit_train_batches``, ``cost_per_sample_s`` (CPU seconds burnt per sample, stretched by
``emulate_slowdown``). Every rank dumps ``OUT_DIR/rank{r}.pt``: the batch size and the synchronised gradient of every
step, hook counts, what ``training_step`` found missing, the allocation.
"""

from __future__ import annotations

import sys

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader

import lightning_het
from tests.helpers.jobs import run_configs
from tests.helpers.tiny import burn, make_dataset, make_net


class ContractModule(pl.LightningModule):
    """``training_step(self, batch)`` without ``batch_idx``; state made in ``on_train_start`` and
    ``on_train_epoch_start``; counts its hooks; records every step's batch size and synchronised gradient."""

    def __init__(self, cost_per_sample_s: float = 0.0, manual: bool = False, gan: bool = False) -> None:
        super().__init__()
        self.net = make_net()
        self.frozen = nn.Dropout(0.5).eval()  # a frozen submodule: Lightning keeps it in eval() mode
        self.gan = gan  # manual optimization of two networks, each backward reaching one of them
        self.disc = make_net(seed=8) if gan else None
        self.cost_per_sample_s = cost_per_sample_s
        self.automatic_optimization = not manual
        self.counts = {"training_step": 0, "on_before_backward": 0, "on_after_backward": 0, "on_train_batch_end": 0}
        self.problems: list[str] = []
        self.batch_sizes: list[int] = []
        self.grads: list[torch.Tensor] = []

    def on_train_start(self) -> None:
        self.started = torch.zeros(1)

    def on_train_epoch_start(self) -> None:
        self.epoch_state = self.current_epoch

    def training_step(self, batch):
        self.counts["training_step"] += 1
        if not hasattr(self, "started") or getattr(self, "epoch_state", None) != self.current_epoch:
            self.problems.append(f"step {self.counts['training_step']}: state from on_train_start missing")
        if self.trainer.train_dataloader is None:
            self.problems.append("trainer.train_dataloader is None")
        if self.frozen.training:
            self.problems.append(f"step {self.counts['training_step']}: the frozen submodule was put in train mode")
        x, y = batch
        self.batch_sizes.append(int(x.shape[0]))
        if self.cost_per_sample_s:
            burn(self.cost_per_sample_s * x.shape[0])
        loss = nn.functional.mse_loss(self.net(x), y)
        if self.gan:
            opt_g, opt_d = self.optimizers()
            opt_g.zero_grad()
            self.manual_backward(loss)  # the second network gets no gradient: find_unused_parameters=True
            self._record_grad()
            opt_g.step()
            opt_d.zero_grad()
            self.manual_backward(nn.functional.mse_loss(self.disc(x), y))
            opt_d.step()
            return None
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            self._record_grad()
            opt.step()
            return None
        return loss

    def on_before_backward(self, loss) -> None:
        self.counts["on_before_backward"] += 1

    def on_after_backward(self) -> None:
        self.counts["on_after_backward"] += 1

    def on_before_optimizer_step(self, optimizer) -> None:
        if self.automatic_optimization:
            self._record_grad()

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.counts["on_train_batch_end"] += 1

    def _record_grad(self) -> None:
        self.grads.append(torch.cat([p.grad.detach().flatten().clone() for p in self.net.parameters()]))

    def configure_optimizers(self):
        if self.gan:
            return [
                torch.optim.SGD(self.net.parameters(), lr=0.05, momentum=0.9),
                torch.optim.SGD(self.disc.parameters(), lr=0.05, momentum=0.9),
            ]
        return torch.optim.SGD(self.net.parameters(), lr=0.05, momentum=0.9)


def fit_and_dump(out, cfg: dict) -> None:
    pl.seed_everything(0)
    strategy = lightning_het.HeterogeneousStrategy(process_group_backend="gloo", **cfg.get("strategy", {}))
    model = ContractModule(cfg.get("cost_per_sample_s", 0.0), cfg.get("manual", False), cfg.get("gan", False))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=cfg.get("devices", 2),
        strategy=strategy,
        max_epochs=cfg.get("epochs", 2),
        limit_train_batches=cfg.get("limit_train_batches"),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    loader = DataLoader(
        make_dataset(cfg.get("n", 320)), batch_size=cfg.get("batch_size", 16), shuffle=True, **cfg.get("loader", {})
    )
    trainer.fit(model, loader)
    s = trainer.strategy
    torch.save(
        {
            "batch_sizes_seen": model.batch_sizes,
            "grads": model.grads,
            "counts": model.counts,
            "problems": model.problems,
            "global_step": trainer.global_step,
            "batch_sizes": s.batch_sizes,
            "cost_model": [c.as_dict() for c in s.cost_model] if s.cost_model else None,
            "profile_seconds": s.profile_seconds,
            "state_dict": {k: v.detach().clone() for k, v in model.net.state_dict().items()},
        },
        out / f"rank{trainer.global_rank}.pt",
    )


if __name__ == "__main__":
    run_configs(fit_and_dump, sys.argv[1:])
