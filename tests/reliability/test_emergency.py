"""The emergency checkpoint: the survivors' agreement and save (threads on one store), ``resume``, and the jobs where
a replica dies or hangs mid-epoch and the fit is finished from the checkpoint on 1, 2 and 3 replicas."""

from __future__ import annotations

import concurrent.futures
import os
import random
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from lightning_het import HeterogeneousStrategy
from lightning_het.arguments import ArgumentError, validate_resume
from lightning_het.reliability.checkpointing import wants_resume
from lightning_het.reliability.emergency import (
    EmergencyCheckpoint,
    LoopRecord,
    StepState,
    agreed_writer,
    restore_rng,
    rng_state,
)
from lightning_het.reliability.watchdog import WATCHDOG_EXIT_CODE, Phase
from tests.helpers.harness import run_harness
from tests.helpers.harness_faults import CountingRegressor
from tests.helpers.side_by_side import SideBySide
from tests.helpers.tiny import TinyRegressor, make_dataset, pl, quiet_trainer, reference_weights
from tests.helpers.watchdogs import watchdog_pair

JOBS = SideBySide(width=1)


# ---------------------------------------------------------------------------------------------------- pure parts
@pytest.mark.parametrize(
    ("steps", "expected"),
    [
        ({0: 7, 1: 7}, (7, 0)),
        ({0: 8, 1: 7, 2: 7}, (7, 1)),  # rank 0 one step ahead: the lowest survivor holding the agreed step writes
        ({0: 7, 2: -1}, (-1, None)),  # a survivor could not tell: no checkpoint
        ({}, (-1, None)),
    ],
)
def test_agreed_step_and_writer(steps, expected):
    assert agreed_writer(steps) == expected


def test_resume_keyword():
    assert validate_resume("auto") == "auto" and validate_resume(None) is None and validate_resume(False) is False
    with pytest.raises(ArgumentError, match="resume"):
        validate_resume("yes")
    with pytest.raises(ArgumentError, match="resume"):
        HeterogeneousStrategy(resume=True)
    assert wants_resume("auto", {}) and not wants_resume(None, {})
    assert wants_resume(None, {"TORCHELASTIC_RESTART_COUNT": "1"})  # a restarted elastic worker resumes by itself
    assert not wants_resume(False, {"TORCHELASTIC_RESTART_COUNT": "1"})


def test_rng_state_round_trips_and_loads_with_weights_only(tmp_path):
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    torch.save(rng_state(), tmp_path / "rng.pt")
    expected = (torch.rand(2), random.random(), np.random.rand())
    restore_rng(torch.load(tmp_path / "rng.pt", weights_only=True))
    again = (torch.rand(2), random.random(), np.random.rand())
    assert torch.equal(again[0], expected[0]) and again[1:] == expected[1:]


class _CompareLoopRecord(pl.Callback):
    """At every hook: the :class:`LoopRecord` built at setup (as the strategy's) gives ``fit_loop.state_dict()``."""

    def __init__(self) -> None:
        self.checked = 0

    def setup(self, trainer, pl_module, stage) -> None:
        self.record = LoopRecord(trainer.fit_loop)

    def _check(self, trainer, *args, epoch=None) -> None:
        assert self.record.state_dict(self.record.take(epoch)) == trainer.fit_loop.state_dict()
        self.checked += 1

    def on_train_batch_end(self, trainer, *args) -> None:  # where the strategy takes it, naming the epoch
        self._check(trainer, epoch=trainer.current_epoch)

    on_train_batch_start = on_validation_end = on_train_epoch_end = _check


class _StatefulLoader(DataLoader):
    """A loader with a state (Lightning keeps it in the fit loop's state): the batches drawn so far."""

    drawn = 0

    def __iter__(self):
        for batch in super().__iter__():
            self.drawn += 1
            yield batch

    def state_dict(self):
        return {"drawn": self.drawn}

    def load_state_dict(self, state):
        self.drawn = state["drawn"]


@pytest.mark.parametrize("loader", [DataLoader, _StatefulLoader])
def test_the_step_record_of_the_fit_loop_is_its_state_dict_throughout_a_fit(tmp_path, loader):
    """The emergency checkpoint's per-step record of the fit loop: the same dict as ``fit_loop.state_dict()`` at every
    hook (batch starts and ends, after validation, at epoch ends), with gradient accumulation and a validation loop,
    also when the training loader has a state of its own (which changes every step)."""
    data = make_dataset(40)
    compare = _CompareLoopRecord()
    trainer = pl.Trainer(
        max_epochs=2, accumulate_grad_batches=2, val_check_interval=3, default_root_dir=tmp_path, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[compare],
    )  # fmt: skip
    trainer.fit(TinyRegressor(), loader(data, batch_size=4), DataLoader(data, batch_size=8))
    # per epoch: 10 batch starts and ends, validation after batches 3, 6 and 9, the epoch end; and the sanity check
    assert compare.checked == 2 * (2 * 10 + 3 + 1) + 1
    state = compare.record.state_dict(compare.record.take())
    assert state["epoch_loop.batch_progress"]["total"]["completed"] == 20 and state == trainer.fit_loop.state_dict()
    assert ("combined_loader" in state["state_dict"]) == (loader is _StatefulLoader)


# ---------------------------------------------------------------------------------------------------- agreement
class Replica:
    """One survivor's :class:`EmergencyCheckpoint` over a fake training thread holding ``weights``."""

    def __init__(self, rank: int, folder: Path) -> None:
        self.weights = torch.zeros(3)
        self.step = 0
        self.emergency = EmergencyCheckpoint(rank, self._observe, self._dump, lambda: str(folder / "emergency.ckpt"))

    def _observe(self) -> StepState:
        return StepState(self.step, 0, {}, {}, torch.get_rng_state())

    def _dump(self, state: StepState) -> dict:
        return {"global_step": state.step, "weights": self.weights.clone()}

    def train_step(self) -> None:
        self.emergency.update(self._update, lambda: None, self.step + 1)
        self.emergency.step_ended()

    def _update(self, closure: Callable[[], None]) -> None:
        closure()
        self.weights += 1
        self.step += 1


def test_survivors_agree_and_the_lowest_writes_the_step_all_completed(tmp_path):
    store = dist.HashStore()
    replicas = [Replica(rank, tmp_path) for rank in range(3)]
    for replica in replicas:
        for _ in range(4):
            replica.train_step()
    replicas[0].train_step()  # rank 0 is one step ahead of rank 2 (rank 1 is the dead one)
    survivors = [replicas[0], replicas[2]]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        paths = list(pool.map(lambda r: r.emergency.save(store, [0, 2], 2.0, 5.0), survivors))
    assert paths == [str(tmp_path / "emergency.ckpt")] * 2
    saved = torch.load(tmp_path / "emergency.ckpt", weights_only=True)
    assert saved["global_step"] == 4 and torch.equal(saved["weights"], torch.full((3,), 4.0))  # written by rank 2
    assert not list(tmp_path.glob("*.tmp"))


def test_a_parameter_update_waits_for_the_save_and_a_step_not_yet_ended_is_waited_for(tmp_path):
    replica = Replica(0, tmp_path)
    replica.train_step()
    entered = threading.Event()

    def slow_dump(state: StepState) -> dict:
        entered.set()
        time.sleep(0.3)
        return {"global_step": state.step, "weights": replica.weights.clone()}

    replica.emergency = EmergencyCheckpoint(0, replica._observe, slow_dump, lambda: str(tmp_path / "e.ckpt"))
    replica.train_step()
    saver = threading.Thread(target=replica.emergency.save, args=(dist.HashStore(), [0], 2.0, 5.0))
    saver.start()
    assert entered.wait(2.0)
    replica.train_step()  # blocks on the lock until the save is over
    saver.join()
    assert torch.load(tmp_path / "e.ckpt", weights_only=True)["global_step"] == 2 and replica.step == 3
    # an update done but its step not ended yet (the schedulers' update, on_train_batch_end): nothing to agree on
    late = Replica(0, tmp_path)
    late.emergency.update(lambda closure: closure(), lambda: None, 1)
    assert late.emergency.save(dist.HashStore(), [0], 0.3, 1.0) is None


def test_a_failed_save_leaves_no_file_and_the_job_ends_as_before(tmp_path, capsys):
    replica = Replica(0, tmp_path)
    replica.train_step()

    def failing_dump(state: StepState) -> dict:
        raise OSError("No space left on device")

    replica.emergency = EmergencyCheckpoint(0, replica._observe, failing_dump, lambda: str(tmp_path / "e.ckpt"))
    replica.train_step()
    assert replica.emergency.save(dist.HashStore(), [0], 1.0, 1.0) is None
    assert "could NOT write the emergency checkpoint" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_the_watchdog_of_a_survivor_saves_before_ending_the_job_and_the_hung_replica_does_not(tmp_path):
    dogs, recorders, _ = watchdog_pair(0.6, prefix="e/")
    replicas = [Replica(rank, tmp_path / str(rank)) for rank in range(2)]
    for dog, replica in zip(dogs, replicas):
        replica.train_step()
        dog.emergency = replica.emergency
        dog.start()
        dog.arm("fit")
    dogs[0].step(Phase.BACKWARD, 1)  # rank 0 waits in the all-reduce of the next step
    dogs[1].step(Phase.TRAINING_STEP, 1)  # rank 1 hangs in it
    assert all(r.done.wait(10) for r in recorders)
    assert [r.codes for r in recorders] == [[WATCHDOG_EXIT_CODE]] * 2
    assert torch.load(tmp_path / "0" / "emergency.ckpt", weights_only=True)["global_step"] == 1
    assert not (tmp_path / "1").exists()


# ---------------------------------------------------------------------------------------------------- jobs
FIT = {"devices": 3, "epochs": 3, "n": 60, "timeout": 3.0}  # global batch 12: 5 steps per epoch, 15 in all
FAULT_STEP = 7  # epoch 1, its third global batch
REFERENCE = {"dataset": 60, "global_batch": 12, "epochs": 3}


def _steps(folder: Path) -> list[int]:
    """The optimizer steps every replica of a job completed, with repeats (rank 0's file, then the others')."""
    return [int(line.split()[0]) for f in sorted(folder.glob("steps_rank*.txt")) for line in f.read_text().splitlines()]


def _fault_job(out: Path, kind: str, rank: int):
    cfg = {**FIT, "root": str(out / "root"), "fault": {"kind": kind, "rank": rank, "step": FAULT_STEP}}
    return run_harness("emergency", out, cfg)


def _single_replica_resume(root: Path, out: Path) -> dict:
    """The fit resumed from ``root``'s emergency checkpoint by one replica in this process."""
    out.mkdir()
    environment = dict(os.environ)  # as tests/conftest.py after each test: this fit runs in a module fixture
    try:
        return _fit_one(root, out)
    finally:
        os.environ.clear()
        os.environ.update(environment)
        if dist.is_initialized():
            dist.destroy_process_group()


def _fit_one(root: Path, out: Path) -> dict:
    pl.seed_everything(0)
    trainer = quiet_trainer(1, HeterogeneousStrategy(speeds=[1.0], resume="auto", process_group_backend="gloo"),
                            max_epochs=3, default_root_dir=str(root))  # fmt: skip
    model = CountingRegressor(out, {"rank": -1, "step": -1})
    trainer.fit(model, DataLoader(make_dataset(60), batch_size=12, shuffle=True))
    return {k: v.detach().clone() for k, v in model.net.state_dict().items()}


@JOBS.job(
    "emergency",
    "test_a_dead_or_hung_replica_leaves_a_checkpoint_the_fit_finishes_from_exactly",
    "test_die_resume_and_run_again_trains_every_step_exactly_once",
    "test_another_job_does_not_resume_the_emergency_checkpoint",
    "test_a_truncated_newer_checkpoint_is_passed_over_with_one_warning",
)
def _emergency_jobs(out: Path) -> dict:
    """A dead (rank 2) and a hung (rank 1) replica, side by side; then the same commands with ``resume="auto"`` (one
    job of 3 replicas: both, the dead one's once more, another job's in a copy of its directory, the dead one's in a
    copy with a truncated newer last.ckpt), the dead one's checkpoint on 2 replicas, and on 1 in this process."""
    dead, hung = out / "dead", out / "hung"
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        faults = list(pool.map(lambda a: _fault_job(*a), [(dead, "exit", 2), (hung, "hang", 1)]))
    result: dict = {"out": out, "dead": faults[0], "hung": faults[1]}
    if not (dead / "root/checkpoints/emergency.ckpt").exists():
        return result
    for name in ("dead", "hung"):  # as the failed jobs left them (the resumed fits replace them when they finish)
        if (out / name / "root/checkpoints/emergency.ckpt").exists():
            shutil.copy(out / name / "root/checkpoints/emergency.ckpt", out / f"{name}-emergency.ckpt")
    for copy in ("on2", "on1", "other", "truncated"):
        shutil.copytree(dead / "root", out / copy / "root")
    data = (dead / "root/checkpoints/emergency.ckpt").read_bytes()  # a later last.ckpt, cut short by a full disk
    (out / "truncated/root/checkpoints/last.ckpt").write_bytes(data[: len(data) // 2])
    resume = [{**FIT, "root": str(folder / "root"), "resume": "auto"} for folder in (dead, hung)]
    # then the same command again (the dead job's: finished, it trains nothing), and another job (another lr) in a
    # copy of the dead job's directory (it does not resume that job's emergency checkpoint)
    resume += [resume[0], {**resume[0], "root": str(out / "other/root"), "lr": 0.5}]
    resume += [{**resume[0], "root": str(out / "truncated/root")}]  # the emergency checkpoint past the truncated one
    on2_cfg = {**resume[0], "devices": 2, "root": str(out / "on2/root")}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        on3 = pool.submit(run_harness, "emergency", out / "on3", resume)
        on2 = pool.submit(run_harness, "emergency", out / "on2", on2_cfg)
        result["on3"], result["on2"] = on3.result(), on2.result()
    # in this process, after the jobs: the fit changes os.environ, which the jobs' environments are made of
    result["on1"] = _single_replica_resume(out / "on1" / "root", out / "on1" / "fit")
    return result


@pytest.fixture(scope="module")
def jobs(request, tmp_path_factory):
    return JOBS.run(request, tmp_path_factory)


def _distance(weights: dict, reference: dict) -> float:
    return max((weights[k] - v).abs().max().item() for k, v in reference.items())


@pytest.mark.slow
def test_a_dead_or_hung_replica_leaves_a_checkpoint_the_fit_finishes_from_exactly(jobs):
    result = jobs["emergency"]
    out: Path = result["out"]
    reference = reference_weights(make_dataset(60), 12, epochs=3, seed=0)
    for index, (name, culprit) in enumerate((("dead", 2), ("hung", 1))):
        job, ckpt = result[name], out / name / "root/checkpoints/emergency.ckpt"
        assert job.returncode == WATCHDOG_EXIT_CODE, job.output[-4000:]
        assert f"replica(s) [{culprit}]" in job.output
        assert f"emergency checkpoint of global step {FAULT_STEP} (epoch 1)" in job.output, job.output[-4000:]
        assert f"saved to {ckpt} by rank 0" in job.output and "resume='auto'" in job.output
        saved = torch.load(out / f"{name}-emergency.ckpt", weights_only=True)
        assert saved["global_step"] == FAULT_STEP and saved["lightning_het"]["sampler"]["steps_done"] == 2
        assert set(saved) >= {"state_dict", "optimizer_states", "lr_schedulers", "loops", "lightning_het"}
        assert "rng" in saved["lightning_het"] and not list(ckpt.parent.glob("*.tmp"))
        # the same command with resume="auto": the steps after the checkpoint, none twice, the uninterrupted weights
        assert result["on3"].returncode == 0, result["on3"].output[-4000:]
        before, after = set(_steps(out / name)), _steps(out / "on3" / str(index))
        assert sorted(after) == sorted(list(range(FAULT_STEP + 1, 16)) * 3), name
        assert before & set(after) == set(), f"{name}: steps trained twice"
        for rank in range(3):
            dump = torch.load(out / "on3" / str(index) / f"rank{rank}.pt", weights_only=True)
            assert dump["global_step"] == 15 and _distance(dump["state_dict"], reference) < 1e-5
    # the same checkpoint resumed on 2 replicas and on 1
    assert result["on2"].returncode == 0, result["on2"].output[-4000:]
    for rank in range(2):
        assert _distance(torch.load(out / "on2" / f"rank{rank}.pt")["state_dict"], reference) < 1e-5
    assert _distance(result["on1"], reference) < 1e-5
    assert _steps(out / "on1" / "fit") == list(range(FAULT_STEP + 1, 16))


def _rank_steps(folder: Path, rank: int = 0) -> list[int]:
    path = folder / f"steps_rank{rank}.txt"
    return [int(line.split()[0]) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
def test_die_resume_and_run_again_trains_every_step_exactly_once(jobs):
    """A replica dies at step 7; the same command with resume="auto" finishes the fit; the same command once more
    resumes the finished state and trains nothing (rank 0's steps of the three runs: 1..15, each once)."""
    result = jobs["emergency"]
    out: Path = result["out"]
    assert result["on3"].returncode == 0, result["on3"].output[-4000:]
    runs = [out / "dead", out / "on3" / "0", out / "on3" / "2"]
    assert [len(_rank_steps(run)) for run in runs] == [FAULT_STEP, 15 - FAULT_STEP, 0]
    assert [step for run in runs for step in _rank_steps(run)] == list(range(1, 16))
    # the resumed fit, once finished, left its end in place of the emergency checkpoint it resumed
    assert torch.load(out / "dead/root/checkpoints/emergency.ckpt", weights_only=True)["global_step"] == 15
    assert _steps(out / "on3" / "2") == []  # no replica trained in the third run
    reference = reference_weights(make_dataset(60), 12, epochs=3, seed=0)
    for rank in range(3):
        dump = torch.load(out / "on3" / "2" / f"rank{rank}.pt", weights_only=True)
        assert dump["global_step"] == 15 and _distance(dump["state_dict"], reference) < 1e-5


@pytest.mark.slow
def test_another_job_does_not_resume_the_emergency_checkpoint(jobs):
    """The same script with lr 0.5 in a copy of the dead job's directory: one warning naming the emergency checkpoint
    and the lr, and a fresh fit (all 15 steps on every replica)."""
    result = jobs["emergency"]
    out: Path = result["out"]
    output = result["on3"].output
    ckpt = out / "other/root/checkpoints/emergency.ckpt"
    assert f"does not resume {ckpt}: it is another job's checkpoint (optimizer 0 group 0 lr 0.05 -> 0.5)" in output
    assert output.count("it is another job's checkpoint") == 1, output[-4000:]
    assert sorted(_steps(out / "on3" / "3")) == sorted(list(range(1, 16)) * 3)


@pytest.mark.slow
def test_a_truncated_newer_checkpoint_is_passed_over_with_one_warning(jobs):
    """A ``last.ckpt`` cut short, written after the emergency checkpoint: one warning naming it (rank 0 decides for
    every replica), and the fit resumes from the emergency checkpoint (steps 8-15, once on every replica)."""
    result = jobs["emergency"]
    out: Path = result["out"]
    job = result["on3"]
    assert job.returncode == 0, job.output[-4000:]
    folder = out / "truncated/root/checkpoints"
    assert job.output.count("it cannot be read") == 1, job.output[-4000:]
    assert f"skips {folder / 'last.ckpt'}: it cannot be read (not a complete checkpoint archive" in job.output
    assert f"resuming from {folder / 'emergency.ckpt'}" in job.output
    assert sorted(_steps(out / "on3" / "4")) == sorted(list(range(FAULT_STEP + 1, 16)) * 3)
