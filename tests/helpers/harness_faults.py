"""The harness's jobs with an injected fault: a replica that misbehaves in a training or validation step
(``faulty``) or in one phase of the job's life (``lifecycle``).

``faulty`` config keys: ``devices`` (default 3), ``timeout`` (strategy ``timeout``, seconds), ``epochs``, ``n``
(dataset size), and ``fault``: ``{"kind": "hang" | "exit" | "raise", "rank": r, "step": k, "where": "training_step" |
"validation_step"}`` (replica ``r`` misbehaves in that hook at global step ``k``). When the fault fires, the replica
writes ``OUT_DIR/fault.json`` with its pid and the wall-clock time, so a test can measure how long the job took to end.

``lifecycle`` (2 replicas) config keys: ``timeout`` (strategy ``timeout``, s), ``startup_timeout`` (s), ``root``
(Trainer ``default_root_dir``), ``step_sleep`` (seconds each training step sleeps; lets a test act while the job runs;
speeds are ``[1, 1]`` unless the fault is in profiling), ``hold`` (a file name: training goes on, epoch after epoch,
until ``OUT_DIR/<hold>`` exists, which the replicas agree on at every step, so a test decides when the job ends),
and ``fault``:
``{"kind": "hang" | "exit" | "none", "rank": r, "where": "launch" | "prepare_data" | "setup" | "profiling" | "train" |
"eval" | "epoch_end" | "teardown" | "loader"}``. ``launch`` fires before the Trainer exists; ``prepare_data`` in
``LightningModule.prepare_data`` (rank 0 only runs it; the others wait in Lightning's barrier around it); ``setup`` in
``LightningModule.setup``; ``profiling`` in training batch 1, one of the first training steps, which the strategy
times to measure speeds; ``train`` in training batch 2; ``eval`` in validation batch 1; ``epoch_end`` in
``on_validation_epoch_end``; ``teardown`` in ``LightningModule.teardown``; ``loader`` in ``Dataset.__getitem__``
of the training DataLoader's worker processes (``num_workers=2``; each worker serves one batch, then the fault fires
in its next item).

Files written to OUT_DIR: ``fault.json`` (pid, wall-clock time) when the fault fires; ``training.json`` (rank 0, the
job's pids) once training runs; ``workers/<pid>`` for every DataLoader worker process (``loader`` faults).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from torch.utils.data import DataLoader, Dataset

from tests.helpers.harness_parts import fire, make_strategy, make_trainer, save_rank, weights
from tests.helpers.tiny import TinyRegressor, make_dataset, pl


# ---------------------------------------------------------------------------------------------------- faulty
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
            fire(self.out, self.fault, self.global_rank)
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        if self._due("validation_step"):
            fire(self.out, self.fault, self.global_rank)
        return super().validation_step(batch, batch_idx)


def faulty(out: Path, cfg: dict) -> None:
    fault = cfg["fault"]
    pl.seed_everything(0)
    devices = cfg.get("devices", 3)
    trainer = make_trainer(
        devices,
        make_strategy({"speeds": [1.0] * devices, "timeout": cfg.get("timeout", 5.0)}),
        max_epochs=cfg.get("epochs", 3),
    )
    train = DataLoader(make_dataset(cfg.get("n", 60)), batch_size=4, shuffle=True)
    val = DataLoader(make_dataset(30, seed=99), batch_size=5) if fault.get("where") == "validation_step" else None
    trainer.fit(FaultyRegressor(out, fault), train, val)


# ---------------------------------------------------------------------------------------------------- emergency
class CountingRegressor(FaultyRegressor):
    """Appends ``"<global step> <wall-clock time>"`` for every optimizer step it completes to
    ``OUT_DIR/steps_rank{r}.txt``; each training step sleeps ``step_sleep`` seconds."""

    step_sleep = 0.0

    def training_step(self, batch, batch_idx):
        time.sleep(self.step_sleep)
        return super().training_step(batch, batch_idx)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        with open(self.out / f"steps_rank{self.global_rank}.txt", "a") as fh:
            fh.write(f"{self.global_step} {time.time():.3f}\n")


def emergency(out: Path, cfg: dict) -> None:
    """``faulty``'s fit (``fault`` and ``lr`` optional) into ``cfg["root"]`` (its checkpoints), with the strategy's
    ``resume``; writes ``rank{r}.pt`` (weights, global step) when the fit ends. Under torchrun the replicas per node
    and the nodes come from the environment (an elastic restart may have fewer), the speeds are equal."""
    pl.seed_everything(0)
    devices, nodes = cfg.get("devices", 3), 1
    if "LOCAL_WORLD_SIZE" in os.environ:
        devices = int(os.environ["LOCAL_WORLD_SIZE"])
        nodes = int(os.environ["WORLD_SIZE"]) // devices
    spec = {"speeds": [1.0] * devices * nodes, "timeout": cfg.get("timeout", 3.0), "resume": cfg.get("resume")}
    trainer = make_trainer(
        devices, make_strategy(spec), num_nodes=nodes, max_epochs=cfg.get("epochs", 3), default_root_dir=cfg["root"]
    )
    model = CountingRegressor(out, cfg.get("fault", {"rank": -1, "step": -1}))
    model.step_sleep = cfg.get("step_sleep", 0.0)
    model.lr = cfg.get("lr", model.lr)
    trainer.fit(model, DataLoader(make_dataset(cfg.get("n", 60)), batch_size=cfg.get("batch_size", 4), shuffle=True))
    record = {"state_dict": weights(model.net), "global_step": trainer.global_step, "world_size": trainer.world_size}
    save_rank(out, trainer.global_rank, record)


# ---------------------------------------------------------------------------------------------------- lifecycle
def _fire(out: Path, fault: dict, rank: int) -> None:
    """A lifecycle fault: hang, or exit with status 3."""
    fire(out, fault, rank, f" in {fault['where']}")


class _RecordWorker:
    """``worker_init_fn``: records the worker's pid as ``OUT/workers/<pid>`` (the strategy wraps it)."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def __call__(self, worker_id: int) -> None:
        (self.out / "workers").mkdir(exist_ok=True)
        (self.out / "workers" / str(os.getpid())).write_text(str(worker_id))


class FaultyDataset(Dataset):
    """Wraps a dataset; in the worker processes of replica ``fault["rank"]``, items after the first ``served`` fire the
    fault (a ``__getitem__`` blocked on, say, a network read)."""

    def __init__(self, inner: Dataset, out: Path, fault: dict, served: int) -> None:
        self.inner = inner
        self.out = out
        self.fault = fault
        self.served = served
        self.count = 0

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int):
        self.count += 1
        rank = int(os.environ.get("LOCAL_RANK", 0))
        if self.count > self.served and rank == self.fault["rank"]:
            _fire(self.out, self.fault, rank)
        return self.inner[index]


class ProbeRegressor(TinyRegressor):
    def __init__(self, out: Path, fault: dict, step_sleep: float, hold: str | None = None) -> None:
        super().__init__()
        self.out = out
        self.fault = fault
        self.step_sleep = step_sleep
        self.hold = hold
        self.in_loop = False

    def _due(self, where: str) -> bool:
        return self.fault["kind"] != "none" and self.fault["where"] == where and self.global_rank == self.fault["rank"]

    def prepare_data(self) -> None:
        if self._due("prepare_data"):
            _fire(self.out, self.fault, self.global_rank)

    def setup(self, stage: str) -> None:
        if self._due("setup"):
            _fire(self.out, self.fault, self.global_rank)

    def on_train_start(self) -> None:
        self.in_loop = True
        if self.global_rank == 0:
            pids = [os.getpid(), *[p.pid for p in getattr(self.trainer.strategy.launcher, "procs", [])]]
            (self.out / "training.json").write_text(json.dumps({"pids": pids}))

    def training_step(self, batch, batch_idx):
        if batch_idx == 1 and self.trainer.strategy.profiling and self._due("profiling"):
            _fire(self.out, self.fault, self.global_rank)
        if self.in_loop and batch_idx == 2 and self._due("train"):
            _fire(self.out, self.fault, self.global_rank)
        if self.in_loop and self.step_sleep:
            time.sleep(self.step_sleep)
        if self.hold is not None:  # every replica stops after the same step: the first that any saw the file
            released = (self.out / self.hold).exists()
            self.trainer.should_stop = self.trainer.strategy.reduce_boolean_decision(released, all=False)
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        if batch_idx == 1 and self._due("eval"):
            _fire(self.out, self.fault, self.global_rank)
        return super().validation_step(batch, batch_idx)

    def on_validation_epoch_end(self) -> None:
        if self._due("epoch_end"):
            _fire(self.out, self.fault, self.global_rank)

    def teardown(self, stage: str) -> None:
        if self._due("teardown"):
            _fire(self.out, self.fault, self.global_rank)


def lifecycle(out: Path, cfg: dict) -> None:
    # Ctrl-C does what it does in a terminal's foreground job, also when the test run inherited SIGINT ignored (started
    # in the background of a script), which the job and its replicas would inherit in turn
    signal.signal(signal.SIGINT, signal.default_int_handler)
    fault = cfg.get("fault", {"kind": "none"})
    if fault.get("where") == "launch" and os.environ.get("LOCAL_RANK") == str(fault["rank"]):
        _fire(out, fault, fault["rank"])
    pl.seed_everything(0)
    strategy = make_strategy(
        {
            "timeout": cfg.get("timeout", 5.0),
            "startup_timeout": cfg.get("startup_timeout", 300.0),
            "profile_warmup": 0,
            "profile_steps": 1,
            "speeds": None if fault.get("where") == "profiling" else [1.0, 1.0],
        }
    )
    hold = cfg.get("hold")
    trainer = make_trainer(2, strategy, max_epochs=-1 if hold else 1, default_root_dir=cfg.get("root", str(out)))
    if fault.get("where") == "loader":
        dataset = FaultyDataset(make_dataset(48), out, fault, served=4)
        train = DataLoader(dataset, batch_size=4, shuffle=True, num_workers=2, worker_init_fn=_RecordWorker(out))
    else:
        train = DataLoader(make_dataset(48), batch_size=4, shuffle=True)
    val = DataLoader(make_dataset(20, seed=99), batch_size=2)
    trainer.fit(ProbeRegressor(out, fault, cfg.get("step_sleep", 0.0), hold), train, val)
    if trainer.is_global_zero:
        (out / "done.json").write_text(json.dumps({"time": time.time()}))
