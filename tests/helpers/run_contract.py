"""Tiny fits that use Lightning's contract the way DDP users do; each dumps what each rank saw and what the fit left
behind: ``python -m tests.helpers.run_contract OUT_DIR JSON`` (one config, or a list run one after another in the
same processes: see :func:`tests.helpers.jobs.run_configs`).

Every fit deep-copies ``trainer.callbacks`` in ``on_train_start`` (as Lightning's own tests do) and records the error,
if any. JSON keys: devices (default 2), strategy (HeterogeneousStrategy kwargs), epochs, n (dataset size),
batch_size, seed,
loader: ``"plain"`` or ``"custom"`` (:class:`FeatureLoader`, a DataLoader subclass with an ``__init__`` argument of
its own, for the training and the validation loader), val_n (validation set size, 0: none),
own_sharding: ``Trainer(use_distributed_sampler=False)`` and each rank's Dataset holds its own shard
(``dataset[rank::world]``, in order).
"""

from __future__ import annotations

import copy
import os
import sys
import threading
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Subset

import lightning_het
from lightning_het.cluster.rendezvous import TOKEN_ENV
from tests.helpers.jobs import run_configs
from tests.helpers.tiny import TinyRegressor, make_dataset

#: what the strategy may set in the environment of a Trainer call
WATCHED_ENV = (TOKEN_ENV, "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


class FeatureLoader(DataLoader):
    """A DataLoader subclass with an ``__init__`` argument of its own, stored under another name (Lightning can only
    re-create it from the arguments it captured)."""

    def __init__(self, num_features: int, dataset, *args, **kwargs) -> None:
        super().__init__(dataset, *args, **kwargs)
        self.features_expected = num_features


class DeepCopyCallbacks(pl.Callback):
    """``copy.deepcopy(trainer.callbacks)`` once training starts (the strategy's callbacks are attached by then)."""

    error: str | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        try:
            copied = copy.deepcopy(trainer.callbacks)
            assert [type(c) for c in copied] == [type(c) for c in trainer.callbacks]
        except Exception as err:
            self.error = f"{type(err).__name__}: {err}"


class ContractModel(TinyRegressor):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.cfg = cfg

    def _loader(self, dataset, **kwargs) -> DataLoader:
        if self.cfg.get("loader", "plain") == "custom":
            return FeatureLoader(4, dataset, **kwargs)
        return DataLoader(dataset, **kwargs)

    def train_dataloader(self) -> DataLoader:
        cfg = self.cfg
        dataset = make_dataset(cfg.get("n", 40))
        if cfg.get("own_sharding"):  # the user's own sharding: each rank's Dataset is its part
            world = self.trainer.world_size
            dataset = Subset(dataset, list(range(self.trainer.global_rank, len(dataset), world)))
            return self._loader(dataset, batch_size=cfg.get("batch_size", 4), shuffle=False)
        return self._loader(dataset, batch_size=cfg.get("batch_size", 4), shuffle=True)

    def val_dataloader(self) -> DataLoader | list:
        if not self.cfg.get("val_n"):
            return []  # no validation
        return self._loader(make_dataset(self.cfg.get("val_n", 0), seed=99), batch_size=5)


def run(out: Path, cfg: dict) -> None:
    pl.seed_everything(cfg.get("seed", 0), workers=True)
    env_before = {name: os.environ.get(name) for name in WATCHED_ENV}
    strategy = lightning_het.HeterogeneousStrategy(process_group_backend="gloo", **cfg.get("strategy", {}))
    model = ContractModel(cfg)
    deepcopy = DeepCopyCallbacks()
    trainer = pl.Trainer(
        accelerator="cpu",
        callbacks=[deepcopy],
        devices=cfg.get("devices", 2),
        strategy=strategy,
        max_epochs=cfg.get("epochs", 1),
        use_distributed_sampler=not cfg.get("own_sharding", False),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model)
    threads = sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())
    torch.save(
        {
            "state_dict": {k: v.detach().cpu() for k, v in model.net.state_dict().items()},
            "seen_batch_sizes": model.seen_batch_sizes,
            "val_seen": model.val_seen,
            "loss_scale": trainer.strategy.loss_scale,
            "batch_sizes": trainer.strategy.batch_sizes,
            "global_step": trainer.global_step,
            "threads_after_fit": threads,
            "env_before": env_before,
            "env_after": {name: os.environ.get(name) for name in WATCHED_ENV},
            "deepcopy_error": deepcopy.error,
        },
        out / f"rank{trainer.global_rank}.pt",
    )


def main() -> None:
    run_configs(run, sys.argv[1:])


if __name__ == "__main__":
    main()
