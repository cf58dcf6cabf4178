"""The harness's fit job: one tiny fit of :class:`FitRegressor`, set up by its config, and a dump of what each rank saw.

Named configurations (:data:`FIT_JOBS`, the defaults a job name puts under its config): ``tiny`` (60 samples),
``balance`` (64 samples, loader batch 8, a CSV logger), ``resume`` (40 samples), ``preempt`` (80 samples; rank 0
prints the exit statuses of the replicas it launched when it ends), ``contract`` (1 epoch of 40 samples, loaders made
by the module, ``copy.deepcopy(trainer.callbacks)`` at train start).

Config keys (all optional): ``devices`` (2), ``num_nodes``, ``accelerator`` ("cpu"), ``strategy`` (keywords of
``HeterogeneousStrategy``, or a strategy name), ``epochs`` (2), ``max_steps``, ``accumulate``, ``seed`` (0), ``n``,
``batch_size`` (4), ``loader`` (extra DataLoader keywords, e.g. ``num_workers``), ``train_loaders`` (``"dict"`` or
``"list"``: a second training loader of ``n2`` samples at half the batch size, combined by Lightning), ``val_n``
(validation samples; 0: none), ``module`` (keywords of :class:`~tests.helpers.tiny.TinyRegressor`), ``slow_from_epoch``
(``module``'s ``slow_factor`` applies from that epoch on), ``memory_cap_from_epoch`` (``[epoch, caps]``: the emulated
memory caps become ``caps`` from that epoch on), ``sleep_counts_as_cpu`` (the process CPU clock reads the wall clock, so
``emulate_slowdown`` stretches the module's sleeps), ``step_cost`` (seconds slept per sample in ``training_step``),
``csv_logger``, ``save_every`` (a checkpoint to ``OUT_DIR/ckpt`` every that many steps, with the weights just before and
when saved in ``OUT_DIR/{before,saved}_step{s}_rank{r}.pt``, and those a validation sees in
``OUT_DIR/validated_step{s}_rank{r}.pt``), ``ckpt_dir`` (a ``ModelCheckpoint`` writing there every
1000 steps), ``resume`` (checkpoint path), ``ready_step`` (each rank writes ``OUT_DIR/ready{r}`` holding its pid once
``global_step`` reaches it), ``stuck_rank`` / ``stuck_step`` (that rank writes ``OUT_DIR/stuck{r}`` and sleeps for good
in ``training_step`` from that step on), ``own_sharding`` (``use_distributed_sampler=False``, each rank's Dataset its
own ``dataset[rank::world]``), ``custom_loader`` (:class:`FeatureLoader`), ``pin_previous_speeds`` (the strategy gets
the speeds the previous fit of the same job ended with, as its ``speeds``), ``batchnorm`` (a ``BatchNorm1d`` layer in
the network), ``log_on_step`` (the loss logged on every step with ``sync_dist=True``),
``val_check_interval`` / ``check_val_every_n_epoch`` (the Trainer's, with
``val_n``), ``val_ckpt`` (a ``ModelCheckpoint`` writing ``OUT_DIR/val_ckpt/step=<s>.ckpt`` at the end of every
validation), ``log_epoch_loss`` (the loss logged per epoch with ``sync_dist=True`` and
no ``batch_size``, as ``train/epoch_loss``), ``oom_above`` (one limit per rank, 0: none: the network itself raises
``torch.OutOfMemoryError`` in a training forward of more samples, as a device out of memory does). The default root
directory is ``OUT_DIR``.

Every rank that finishes dumps ``OUT_DIR/rank{r}.pt`` (:func:`fit_record`).
"""

from __future__ import annotations

import atexit
import copy
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Subset

from lightning_het.cluster.rendezvous import TOKEN_ENV
from tests.helpers.harness_parts import make_strategy, make_trainer, save_rank, train_loader, weights
from tests.helpers.tiny import TinyRegressor, make_dataset, pl

#: what the strategy may set in the environment of a Trainer call
WATCHED_ENV = (TOKEN_ENV, "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")

#: the speeds the last fit of this process ended with (``pin_previous_speeds``)
_previous_speeds: list[list[float]] = []

#: job name -> the defaults of its config
FIT_JOBS: dict[str, dict[str, Any]] = {
    "tiny": {"n": 60},
    "balance": {"n": 64, "batch_size": 8, "csv_logger": True},
    "resume": {"n": 40},
    "preempt": {"n": 80, "report_children": True},
    "contract": {"n": 40, "epochs": 1, "module_loaders": True, "deepcopy_callbacks": True},
}


class FeatureLoader(DataLoader):
    """A DataLoader subclass with an ``__init__`` argument of its own, stored under another name (Lightning can only
    re-create it from the arguments it captured)."""

    def __init__(self, num_features: int, dataset, *args, **kwargs) -> None:
        super().__init__(dataset, *args, **kwargs)
        self.features_expected = num_features


class OutOfMemoryAbove(nn.Sequential):
    """A ``Sequential`` (the same parameter names) whose training forward of more than ``limit`` samples raises
    ``torch.OutOfMemoryError`` before any layer runs, as a device out of memory does (``limit`` 0: never)."""

    limit = 0

    def forward(self, x):
        if self.limit and torch.is_grad_enabled() and x.shape[0] > self.limit:
            raise torch.OutOfMemoryError(f"out of memory: {x.shape[0]} samples on a device that holds {self.limit}")
        return super().forward(x)


class FitRegressor(TinyRegressor):
    """``TinyRegressor`` whose ``slow_rank`` is ``slow_factor`` times slower from ``slow_from_epoch`` on, and whose
    ``stuck_rank`` hangs in ``training_step`` from ``stuck_step`` on."""

    def __init__(self, out: Path, cfg: dict, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.out, self.cfg = out, cfg
        self.backward_hooks = 0
        if cfg.get("batchnorm"):
            torch.manual_seed(7)
            self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))
        if cfg.get("oom_above"):
            self.net = OutOfMemoryAbove(*self.net)
        self.target_factor = self.slow_factor
        self.slow_from_epoch = cfg.get("slow_from_epoch", 0)

    def on_fit_start(self) -> None:
        if self.cfg.get("oom_above"):
            self.net.limit = self.cfg["oom_above"][self.global_rank]

    def on_train_epoch_start(self) -> None:
        self.slow_factor = self.target_factor if self.current_epoch >= self.slow_from_epoch else 1.0
        lowered = self.cfg.get("memory_cap_from_epoch")  # [epoch, caps]: the emulated memory caps from that epoch on
        if lowered and self.current_epoch == lowered[0]:
            self.trainer.strategy.policy.memory_emulation.cap = lowered[1][self.global_rank]

    def on_before_backward(self, loss) -> None:
        self.backward_hooks += 1  # once per micro-batch through Lightning's backward

    def training_step(self, batch, batch_idx):
        stuck = self.cfg.get("stuck_rank")
        if self.global_rank == stuck and self.trainer.global_step >= self.cfg["stuck_step"]:
            (self.out / f"stuck{self.global_rank}").write_text(str(os.getpid()))
            while True:  # a replica that never reaches the step boundary
                time.sleep(1)
        loss = super().training_step(batch, batch_idx)
        if self.cfg.get("log_on_step"):  # a collective in every training_step (every micro-batch)
            self.log("train/step_loss", loss, on_step=True, on_epoch=False, sync_dist=True)
        if self.cfg.get("log_epoch_loss"):  # the common form: Lightning infers the batch size from the batch
            self.log("train/epoch_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss


class LoaderRegressor(FitRegressor):
    """Makes its own loaders in the hooks, as DDP users do (the ``contract`` job)."""

    def _loader(self, dataset, **kwargs) -> DataLoader:
        if self.cfg.get("custom_loader"):
            return FeatureLoader(4, dataset, **kwargs)
        return DataLoader(dataset, **kwargs)

    def train_dataloader(self) -> DataLoader:
        dataset = make_dataset(self.cfg["n"])
        if self.cfg.get("own_sharding"):  # the user's own sharding: each rank's Dataset is its part
            world = self.trainer.world_size
            dataset = Subset(dataset, list(range(self.trainer.global_rank, len(dataset), world)))
            return self._loader(dataset, batch_size=self.cfg.get("batch_size", 4), shuffle=False)
        return self._loader(dataset, batch_size=self.cfg.get("batch_size", 4), shuffle=True)

    def val_dataloader(self) -> DataLoader | list:
        if not self.cfg.get("val_n"):
            return []  # no validation
        return self._loader(make_dataset(self.cfg["val_n"], seed=99), batch_size=5)


class DeepCopyCallbacks(pl.Callback):
    """``copy.deepcopy(trainer.callbacks)`` once training starts (the strategy's callbacks are attached by then)."""

    error: str | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        try:
            copied = copy.deepcopy(trainer.callbacks)
            assert [type(c) for c in copied] == [type(c) for c in trainer.callbacks]
        except Exception as err:
            self.error = f"{type(err).__name__}: {err}"


class DumpOnSave(pl.Callback):
    """Each rank writes the weights it holds just before ``ModelCheckpoint`` saves (Lightning runs checkpoint callbacks
    last) and when the checkpoint is taken (after the checkpoint captured the weights)."""

    def __init__(self, out: Path, every: int) -> None:
        self.out, self.every = out, every

    def _dump(self, trainer, pl_module, what: str) -> None:
        path = self.out / f"{what}_step{trainer.global_step}_rank{trainer.global_rank}.pt"
        torch.save(weights(pl_module.net), path)

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        if trainer.global_step % self.every == 0:
            self._dump(trainer, pl_module, "before")

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        if not (self.out / f"saved_step{trainer.global_step}_rank{trainer.global_rank}.pt").exists():  # the first save
            self._dump(trainer, pl_module, "saved")

    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        if trainer.state.fn == "fit":
            self._dump(trainer, pl_module, "validated")  # the weights validation sees


class Ready(pl.Callback):
    """Tell the test that training reached ``step`` (so that a signal lands mid-run)."""

    def __init__(self, out: Path, step: int) -> None:
        self.out, self.step, self.done = out, step, False

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        if not self.done and trainer.global_step >= self.step:
            self.done = True
            tmp = self.out / f".ready{trainer.global_rank}"
            tmp.write_text(str(os.getpid()))
            tmp.rename(self.out / f"ready{trainer.global_rank}")


def _callbacks(out: Path, cfg: dict) -> list:
    callbacks: list = []
    if cfg.get("deepcopy_callbacks"):
        callbacks.append(DeepCopyCallbacks())
    if cfg.get("save_every"):
        every = cfg["save_every"]
        callbacks.append(pl.callbacks.ModelCheckpoint(out / "ckpt", "{step}", every_n_train_steps=every, save_top_k=-1))
        callbacks.append(DumpOnSave(out, every))
    if cfg.get("ready_step") is not None:
        callbacks.append(Ready(out, cfg["ready_step"]))
    if cfg.get("val_ckpt"):  # a checkpoint at the end of every validation (Lightning's default trigger)
        callbacks.append(pl.callbacks.ModelCheckpoint(out / "val_ckpt", "{step}", save_top_k=-1))
    if cfg.get("ckpt_dir"):
        callbacks.append(pl.callbacks.ModelCheckpoint(cfg["ckpt_dir"], "{step}", every_n_train_steps=1000))
    return callbacks


def _loaders(cfg: dict) -> tuple[Any, DataLoader | None]:
    """The training loader(s) and the validation loader of a fit whose module makes none."""
    loader: Any = train_loader(cfg, 60)
    if cfg.get("train_loaders"):  # several training loaders ("dict" or "list"): a second one, half the batch size
        second = DataLoader(make_dataset(cfg.get("n2", 30), seed=5), batch_size=max(1, cfg.get("batch_size", 4) // 2))
        loader = {"a": loader, "b": second} if cfg["train_loaders"] == "dict" else [loader, second]
    val_n = cfg.get("val_n", 0)
    return loader, DataLoader(make_dataset(val_n, seed=99), batch_size=5) if val_n else None


def _report_children(trainer) -> None:
    procs = getattr(trainer.strategy.launcher, "procs", None) or []
    print(f"launched replicas ended with {[p.poll() for p in procs]}", flush=True)


def fit(out: Path, cfg: dict) -> None:
    """One fit as ``cfg`` says, dumping this rank's view into ``out/rank{r}.pt``."""
    if cfg.get("sleep_counts_as_cpu"):
        time.process_time = time.perf_counter
    pl.seed_everything(cfg.get("seed", 0), workers=True)
    env_before = {name: os.environ.get(name) for name in WATCHED_ENV}
    spec = cfg.get("strategy", {})
    if cfg.get("pin_previous_speeds"):
        spec = {**spec, "speeds": _previous_speeds[-1]}
    strategy = make_strategy(spec)
    module = {**cfg.get("module", {}), **({"cost_per_sample_s": cfg["step_cost"]} if "step_cost" in cfg else {})}
    model = (LoaderRegressor if cfg.get("module_loaders") else FitRegressor)(out, cfg, **module)
    callbacks = _callbacks(out, cfg)
    logger = pl.loggers.CSVLogger(out, name="logs", version=0) if cfg.get("csv_logger") else False
    trainer = make_trainer(
        cfg.get("devices", 2),
        strategy,
        accelerator=cfg.get("accelerator", "cpu"),
        num_nodes=cfg.get("num_nodes", 1),
        max_epochs=cfg.get("epochs", 2),
        max_steps=cfg.get("max_steps", -1),
        accumulate_grad_batches=cfg.get("accumulate", 1),
        val_check_interval=cfg.get("val_check_interval"),
        check_val_every_n_epoch=cfg.get("check_val_every_n_epoch", 1),
        use_distributed_sampler=not cfg.get("own_sharding", False),
        logger=logger,
        callbacks=callbacks,
        enable_checkpointing=any(isinstance(c, pl.callbacks.ModelCheckpoint) for c in callbacks),
        default_root_dir=str(out),
    )
    if cfg.get("report_children") and trainer.global_rank == 0:
        atexit.register(_report_children, trainer)
    if cfg.get("module_loaders"):
        trainer.fit(model, ckpt_path=cfg.get("resume"))
    else:
        trainer.fit(model, *_loaders(cfg), ckpt_path=cfg.get("resume"))
    record = fit_record(trainer, model)
    _previous_speeds.append(record["speeds"])
    record["env_before"] = env_before
    record["deepcopy_error"] = next((c.error for c in callbacks if isinstance(c, DeepCopyCallbacks)), None)
    save_rank(out, trainer.global_rank, record)


def fit_record(trainer, model: TinyRegressor) -> dict[str, Any]:
    """What a rank saw in a fit: weights, batch sizes, allocation, communication, profile, telemetry, threads."""
    s = trainer.strategy
    monitor = next((cb for cb in trainer.callbacks if hasattr(cb, "report_paths")), None)
    return {
        "state_dict": weights(model.net),
        "seen_batch_sizes": model.seen_batch_sizes,
        "backward_hooks": getattr(model, "backward_hooks", None),
        "batch_sizes": s.batch_sizes,
        "speeds": s.speeds,
        "node_ids": s.node_ids,
        "loss_scale": s.loss_scale,
        "global_step": trainer.global_step,
        "val_seen": model.val_seen,
        "val_mse": float(trainer.callback_metrics["val/mse"]) if "val/mse" in trainer.callback_metrics else None,
        "step_loss": float(trainer.callback_metrics.get("train/step_loss", float("nan"))),
        "epoch_loss": float(trainer.callback_metrics.get("train/epoch_loss", float("nan"))),
        "root_device": str(s.root_device),
        "num_threads": torch.get_num_threads(),
        "backend": s.process_group_backend,
        "comm_mode": s.comm_mode,
        "comm_stats": s.comm_stats,
        "comm_reduction": s.comm_reduction,
        "cluster_environment": type(s.cluster_environment).__name__,
        "hostname": socket.gethostname(),
        "cost_model": [c.as_dict() for c in s.cost_model] if s.cost_model else None,
        "profile_seconds": s.profile_seconds,
        "micro_cap": s.micro_batcher.cap if getattr(s, "micro_batcher", None) is not None else None,
        "micro_search_steps": s.micro_batcher.search_steps if getattr(s, "micro_batcher", None) is not None else 0,
        "profile_cached": s.balance_report()["profile_cached"],
        "report": s.balance_report(include_series=True),
        "report_paths": {k: str(v) for k, v in (monitor.report_paths if monitor else {}).items()},
        "log_dir": trainer.log_dir,
        "threads_after_fit": sorted(t.name for t in threading.enumerate() if t is not threading.main_thread()),
        "env_after": {name: os.environ.get(name) for name in WATCHED_ENV},
    }
