"""A tiny multi-replica fit in which one replica misbehaves: ``python -m tests.helpers.run_faulty OUT_DIR JSON``.

JSON keys: ``devices`` (default 3), ``timeout`` (strategy ``timeout``, seconds), ``epochs``, ``n`` (dataset size), and
``fault``: ``{"kind": "hang" | "exit" | "raise", "rank": r, "step": k, "where": "training_step" | "validation_step"}``
(replica ``r`` misbehaves in that hook at global step ``k``). When the fault fires, the replica writes
``OUT_DIR/fault.json`` with its pid and the wall-clock time, so a test can measure how long the job took to end.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
from torch.utils.data import DataLoader

import lightning_het
from tests.helpers.tiny import TinyRegressor, make_dataset


def _fire(out: Path, fault: dict, rank: int) -> None:
    (out / "fault.json").write_text(json.dumps({"rank": rank, "pid": os.getpid(), "time": time.time(), **fault}))
    print(f"FAULT {fault['kind']} on rank {rank} (pid {os.getpid()})", flush=True)
    if fault["kind"] == "hang":
        while True:
            time.sleep(3600)
    if fault["kind"] == "exit":
        os._exit(3)
    raise RuntimeError(f"injected failure on rank {rank}")


class FaultyRegressor(TinyRegressor):
    def __init__(self, out: Path, fault: dict) -> None:
        super().__init__()
        self.out = out
        self.fault = fault

    def _due(self, where: str) -> bool:
        f = self.fault
        mine = self.global_rank == f["rank"] and self.global_step == f["step"]
        return mine and f.get("where", "training_step") == where

    def training_step(self, batch, batch_idx):
        if self._due("training_step"):
            _fire(self.out, self.fault, self.global_rank)
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        if self._due("validation_step"):
            _fire(self.out, self.fault, self.global_rank)
        return super().validation_step(batch, batch_idx)


def main() -> None:
    out = Path(sys.argv[1])
    cfg = json.loads(sys.argv[2])
    fault = cfg["fault"]
    pl.seed_everything(0)
    strategy = lightning_het.HeterogeneousStrategy(
        process_group_backend="gloo", speeds=[1.0] * cfg.get("devices", 3), timeout=cfg.get("timeout", 5.0)
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=cfg.get("devices", 3),
        strategy=strategy,
        max_epochs=cfg.get("epochs", 3),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    train = DataLoader(make_dataset(cfg.get("n", 60)), batch_size=4, shuffle=True)
    val = DataLoader(make_dataset(30, seed=99), batch_size=5) if fault.get("where") == "validation_step" else None
    trainer.fit(FaultyRegressor(out, fault), train, val)


if __name__ == "__main__":
    main()
