"""The harness's ``sharded`` job: one tiny fit with :class:`~lightning_het.HeterogeneousFSDPStrategy`.

Config keys: ``devices`` (3), ``strategy`` (its keywords; gloo), ``n`` (45 samples), ``batch_size`` (the loader's, 4),
``epochs`` (2), ``max_steps``, ``accumulate``, ``shard_in_module`` (the module's own ``configure_model`` shards),
``save_every`` (a checkpoint every that many steps in ``OUT_DIR/ckpt/step=<s>.ckpt``), ``resume`` (a checkpoint path to
resume from), ``module`` (keywords of :class:`~tests.helpers.tiny.TinyRegressor`), ``rebalance_at`` (``[epoch, sizes]``:
adopt ``sizes`` from that epoch), ``val_n`` (a validation set of that many samples). Every rank dumps
``OUT_DIR/rank{r}.pt``: the full weights, the batch sizes it saw, the allocation, the mesh's shape and the strategy's
balance report.
"""

from __future__ import annotations

from pathlib import Path

from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader

from lightning_het import HeterogeneousFSDPStrategy
from tests.helpers.harness_parts import make_trainer, save_rank
from tests.helpers.tiny import TinyRegressor, make_dataset, pl


class ShardedRegressor(TinyRegressor):
    """``TinyRegressor`` that adopts ``rebalance_at[1]`` from epoch ``rebalance_at[0]``."""

    def __init__(self, rebalance_at: list | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.rebalance_at = rebalance_at

    def on_train_epoch_end(self) -> None:
        if self.rebalance_at and self.current_epoch + 1 == self.rebalance_at[0]:  # as the balance monitor does
            sizes = self.rebalance_at[1]
            self.trainer.strategy.adopt_allocation(sizes, [float(b) for b in sizes])
            self.trainer.reload_dataloaders_every_n_epochs = 1  # the next epoch's loader: split anew


class SelfSharded(ShardedRegressor):
    """Shards its network itself in ``configure_model``, over the strategy's mesh."""

    def configure_model(self) -> None:
        mesh = self.trainer.strategy.shard_mesh
        for layer in (self.net[0], self.net[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)


def full_weights(net) -> dict:
    """The network's full weights (a collective: every rank gathers its DTensors)."""
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in net.state_dict().items()
    }


def sharded(out: Path, cfg: dict) -> None:
    pl.seed_everything(cfg.get("seed", 0))
    strategy = HeterogeneousFSDPStrategy(process_group_backend="gloo", **cfg.get("strategy", {}))
    module_cls = SelfSharded if cfg.get("shard_in_module") else ShardedRegressor
    module = module_cls(cfg.get("rebalance_at"), **cfg.get("module", {}))
    loader = DataLoader(make_dataset(cfg.get("n", 45)), batch_size=cfg.get("batch_size", 4), shuffle=True)
    every = cfg.get("save_every")  # a checkpoint every that many steps, in OUT_DIR/ckpt/step=<s>.ckpt (folders)
    callbacks = [pl.callbacks.ModelCheckpoint(out / "ckpt", "{step}", every_n_train_steps=every, save_top_k=-1)]
    trainer = make_trainer(
        cfg.get("devices", 3),
        strategy,
        max_epochs=cfg.get("epochs", 2),
        max_steps=cfg.get("max_steps", -1),
        accumulate_grad_batches=cfg.get("accumulate", 1),
        callbacks=callbacks if every else [],
        enable_checkpointing=bool(every),
        default_root_dir=str(out),
    )
    val_n = cfg.get("val_n")  # an evaluation set, split by the replicas' shares
    val = DataLoader(make_dataset(val_n, seed=99), batch_size=5) if val_n else None
    trainer.fit(module, loader, val, ckpt_path=cfg.get("resume"))
    record = {
        "state_dict": full_weights(module.net),
        "seen_batch_sizes": module.seen_batch_sizes,
        "val_seen": module.val_seen,
        "val_mse": float(trainer.callback_metrics["val/mse"]) if "val/mse" in trainer.callback_metrics else None,
        "batch_sizes": strategy.batch_sizes,
        "global_step": trainer.global_step,
        "mesh": list(strategy.shard_mesh.mesh.shape),
        "report": strategy.balance_report(),
        "table": strategy.balance_table(),
    }
    save_rank(out, trainer.global_rank, record)
