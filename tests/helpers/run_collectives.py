"""Fits whose user code runs Lightning's collectives in every hook, with the progress bar on:
``python -m tests.helpers.run_collectives OUT_DIR JSON``.

JSON is one config or a list (run one after another in the same processes, see
:func:`tests.helpers.jobs.run_configs`). Keys: ``strategy`` (keywords of ``HeterogeneousStrategy``, or ``"ddp"`` for
stock DDP), ``epochs``, ``batches``. Rank 0 writes ``result.json``: the logged epoch metrics and, per rank, every
value ``self.all_gather`` returned, so a test compares them with what stock DDP gives.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_het
from tests.helpers.jobs import run_configs


class Chatty(L.LightningModule):
    """Logs with ``sync_dist`` on step and on epoch and all-gathers a scalar where stock DDP allows it (not in
    ``on_train_epoch_end``, where rank 0's progress bar reduces the epoch metrics alone, under DDP too)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.gathered: list[list[float]] = []

    def _gather(self, name: str) -> None:
        value = self.all_gather(torch.tensor(float(self.global_rank + 1)))
        self.gathered.append([name, *value.tolist()])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train_epoch_loss", loss, on_step=False, on_epoch=True, sync_dist=True, prog_bar=True)
        self.log("train_step_loss", loss, on_step=True, on_epoch=False, sync_dist=True, prog_bar=True)
        return loss

    def on_train_epoch_start(self) -> None:
        self._gather("on_train_epoch_start")

    def on_train_end(self) -> None:
        self._gather("on_train_end")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def run(out: Path, cfg: dict[str, Any]) -> None:
    L.seed_everything(0)
    batches, world = cfg.get("batches", 3), 2
    data = TensorDataset(torch.randn(8 * batches, 4), torch.randn(8 * batches, 1))
    spec = cfg.get("strategy", {})
    strategy = "ddp" if spec == "ddp" else lightning_het.HeterogeneousStrategy(timeout=30, **spec)
    model = Chatty()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_epochs=cfg.get("epochs", 2),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=True,
        enable_model_summary=False,
        default_root_dir=out,
    )
    trainer.fit(model, DataLoader(data, batch_size=4))
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    ranks = [None] * world
    torch.distributed.all_gather_object(ranks, model.gathered)
    if trainer.is_global_zero:
        (out / "result.json").write_text(json.dumps({"metrics": metrics, "gathered": ranks}))


if __name__ == "__main__":
    run_configs(run, sys.argv[1:])
