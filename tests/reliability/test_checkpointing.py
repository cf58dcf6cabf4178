"""Checkpoints record the allocation and the sampler's place; resumed fits continue exactly."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_het import HeterogeneousStrategy, ProportionalDistributedSampler
from lightning_het.reliability.checkpointing import (
    CHECKPOINT_KEY,
    Candidate,
    checkpoint_candidates,
    checkpoint_record,
    choose_checkpoint,
    identity_differences,
    job_identity,
    plan_allocation,
    plan_sampler_resume,
    read_record,
)
from tests.helpers.harness import run_harness, split_output
from tests.helpers.tiny import TinyRegressor, make_dataset, reference_weights


def _weights(module: TinyRegressor) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.net.state_dict().items()}


def _close(a: dict, b: dict, tol: float = 1e-6) -> bool:
    """Equal within ``tol`` (absolute, and relative to the weights' size)."""
    return all(torch.allclose(a[k], b[k], rtol=tol, atol=tol) for k in b)


# ---------------------------------------------------------------------------------------------------- decisions (pure)
def _record(world: int = 2, speeds=(1.0, 3.0), sizes=(2, 6)) -> dict:
    return checkpoint_record(None, list(sizes), list(speeds), [0] * world, profiled=True, find_sampler=list)


class TestPlanAllocation:
    def test_not_resuming(self):
        plan = plan_allocation(None, world_size=2, given_speeds=None)
        assert plan.speeds is None and plan.message is None

    def test_same_replicas_reuse_the_checkpoints_speeds_without_profiling(self):
        plan = plan_allocation(_record(), world_size=2, given_speeds=None)
        assert plan.speeds == [1.0, 3.0] and "re-balancing" not in plan.message
        assert "resuming with the checkpoint's speeds [1.0, 3.0] (no re-profiling" in plan.message

    def test_other_replica_count_rebalances_by_profiling(self):
        plan = plan_allocation(_record(), world_size=3, given_speeds=None)
        assert plan.speeds is None and plan.message.startswith("re-balancing on resume")
        assert "trained by 2 replica(s), this run has 3" in plan.message

    def test_given_speeds_win(self):
        plan = plan_allocation(_record(), world_size=2, given_speeds=[2, 2])
        assert plan.speeds == [2.0, 2.0] and plan.message.startswith("re-balancing on resume")
        assert "speeds [1.0, 3.0]" in plan.message and "given speeds [2.0, 2.0]" in plan.message
        assert "re-balancing" not in plan_allocation(_record(), world_size=2, given_speeds=[1, 3]).message


class TestPlanSamplerResume:
    ORDER = {"num_steps": 5, "global_batch_size": 8, "dataset_len": 40, "shuffle": True, "seed": 0}

    def _saved(self, epoch: int, done: int, **changes) -> dict:
        order = {k: v for k, v in self.ORDER.items() if k != "num_steps"}
        return {"epoch": epoch, "steps_done": done, "num_steps": 5, **order, **changes}

    def test_mid_epoch_skips_the_batches_done(self):
        plan = plan_sampler_resume(self._saved(1, 2), **self.ORDER)
        assert plan == (1, 2)  # (epoch, global batches to skip)

    def test_epoch_boundaries(self):
        assert plan_sampler_resume(self._saved(1, 0), **self.ORDER) == (1, 0)
        end = plan_sampler_resume(self._saved(1, 5), **self.ORDER)
        assert end == (2, 0)
        assert plan_sampler_resume(None, **self.ORDER) is None

    @pytest.mark.parametrize(("change", "text"), [({"global_batch_size": 12}, "global_batch_size 12 -> 8"),
                                                  ({"dataset_len": 48}, "dataset_len 48 -> 40"),
                                                  ({"seed": 3}, "seed 3 -> 0")])  # fmt: skip
    def test_mid_epoch_with_a_different_order_is_refused(self, change, text):
        with pytest.raises(ValueError, match=rf"middle of epoch 1 \(2 of 5 .*{text}.*HINT"):
            plan_sampler_resume(self._saved(1, 2, **change), **self.ORDER)

    def test_a_different_order_is_fine_at_an_epoch_boundary(self):
        plan = plan_sampler_resume(self._saved(1, 5, global_batch_size=12, epoch_finished=True), **self.ORDER)
        assert plan == (2, 0)
        with pytest.raises(ValueError, match="before the epoch ended"):
            plan_sampler_resume(self._saved(1, 5, global_batch_size=12, epoch_finished=False), **self.ORDER)


def test_record_versions():
    assert read_record({}) is None
    assert read_record({CHECKPOINT_KEY: _record()})["batch_sizes"] == [2, 6]
    with pytest.raises(ValueError, match=r"version 99.*HINT"):
        read_record({CHECKPOINT_KEY: {**_record(), "version": 99}})


def test_resumed_sampler_continues_the_same_global_batches_on_another_split():
    """The union over replicas of the resumed batches is what one process would draw from global batch 2 on."""
    dataset = make_dataset(40)
    single = ProportionalDistributedSampler(dataset, [8], 0, seed=5)
    single.set_epoch(1)
    expected = list(single)[2 * 8 :]
    parts = []
    for rank in range(3):
        sampler = ProportionalDistributedSampler(dataset, [2, 2, 4], rank, seed=5)
        sampler.resume(1, 2)
        parts.append(list(sampler))
        assert len(sampler) == 5 * [2, 2, 4][rank]  # Lightning counts the whole epoch
        sampler.set_epoch(2)
        assert len(list(sampler)) == 5 * [2, 2, 4][rank]  # later epochs are whole again
    sizes = [2, 2, 4]
    union = [i for step in range(3) for r in range(3) for i in parts[r][step * sizes[r] : (step + 1) * sizes[r]]]
    assert union == expected


# ---------------------------------------------------------------------------------------------------- one replica
def _fit(tmp_path: Path, *, ckpt: str | None = None, save_every: int = 0, global_batch: int | None = 8, **kwargs):
    pl.seed_everything(0)
    model = TinyRegressor()
    callbacks = []
    if save_every:  # every `save_every` steps, or at the end of every epoch for -1
        every = {"every_n_epochs": 1, "save_on_train_epoch_end": True} if save_every < 0 else {
            "every_n_train_steps": save_every}  # fmt: skip
        callbacks.append(ModelCheckpoint(tmp_path, "{step}", save_top_k=-1, **every))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=HeterogeneousStrategy(speeds=[1.0], global_batch_size=global_batch, process_group_backend="gloo"),
        max_epochs=2,
        logger=False,
        callbacks=callbacks,
        enable_checkpointing=bool(callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **kwargs,
    )
    trainer.fit(model, DataLoader(make_dataset(40), batch_size=4, shuffle=True), ckpt_path=ckpt)
    return model, trainer


def test_mid_epoch_resume_is_bitwise_exact_and_checkpoint_records_allocation(tmp_path):
    full, _ = _fit(tmp_path, save_every=7)  # 5 steps per epoch: step 7 is in the middle of epoch 1
    saved = torch.load(tmp_path / "step=7.ckpt", weights_only=True)[CHECKPOINT_KEY]
    assert saved["batch_sizes"] == [8] and saved["speeds"] == [1.0] and saved["node_ids"] == [0]
    assert saved["sampler"] == {"epoch": 1, "steps_done": 2, "num_steps": 5, "global_batch_size": 8,
                                "dataset_len": 40, "shuffle": True, "seed": 0, "epoch_finished": False}  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed, trainer = _fit(tmp_path / "resumed", ckpt=str(tmp_path / "step=7.ckpt"))
    assert resumed.seen_batch_sizes == [8, 8, 8] and trainer.global_step == 10
    assert all(torch.equal(a, b) for a, b in zip(_weights(full).values(), _weights(resumed).values()))
    assert not [w for w in caught if "dataloader is not resumable" in str(w.message)]
    assert _close(_weights(full), reference_weights(make_dataset(40), 8, epochs=2, seed=0))


def test_mid_epoch_resume_with_another_global_batch_is_refused(tmp_path):
    _fit(tmp_path, save_every=7, max_steps=7)
    with pytest.raises(ValueError, match=r"middle of epoch 1 .*global_batch_size 8 -> 4.*HINT"):
        _fit(tmp_path / "resumed", ckpt=str(tmp_path / "step=7.ckpt"), global_batch=4)


def test_resume_keeps_the_checkpoints_global_batch_unless_one_is_given(tmp_path):
    """The default global batch (the DataLoader's batch_size 4 x 1 replica here) does not replace the checkpoint's 8,
    as on a resume on another number of replicas: the fit continues on the same global batches."""
    full, _ = _fit(tmp_path, save_every=7)
    resumed, trainer = _fit(tmp_path / "resumed", ckpt=str(tmp_path / "step=7.ckpt"), global_batch=None)
    assert resumed.seen_batch_sizes == [8, 8, 8] and trainer.global_step == 10
    assert trainer.strategy.global_batch_size == 8
    assert all(torch.equal(a, b) for a, b in zip(_weights(full).values(), _weights(resumed).values()))


def test_epoch_boundary_resume_may_change_the_global_batch(tmp_path):
    _fit(tmp_path, save_every=-1, max_steps=5)  # saved in on_train_epoch_end of epoch 0
    resumed, trainer = _fit(tmp_path / "resumed", ckpt=str(tmp_path / "step=5.ckpt"), global_batch=4)
    assert resumed.seen_batch_sizes == [4] * 10 and trainer.global_step == 15
    # saved after the last batch but inside the epoch (on_train_batch_end): Lightning would cut the next epoch short
    _fit(tmp_path / "last", save_every=5, max_steps=5)
    with pytest.raises(ValueError, match=r"middle of epoch 0 \(5 of 5 global batches done, before the epoch ended"):
        _fit(tmp_path / "resumed_last", ckpt=str(tmp_path / "last" / "step=5.ckpt"), global_batch=4)


class _FakeController:
    def __init__(self) -> None:
        self.calls = 0

    def synchronize(self, params) -> bool:
        raise AssertionError("a save must not sync the replicas (with an outer optimizer, that is an extra step)")

    def consensus_state_dict(self, module, state):
        self.calls += 1
        return {**state, "net.0.weight": torch.zeros_like(state["net.0.weight"])}


def test_node_local_checkpoint_holds_the_consensus_model_without_a_sync():
    strategy = HeterogeneousStrategy(process_group_backend="gloo")
    strategy._lightning_module = module = TinyRegressor()
    strategy.comm_algorithm = _FakeController()
    state = strategy.lightning_module_state_dict()
    assert strategy.comm_algorithm.calls == 1 and not state["net.0.weight"].any()
    assert module.net[0].weight.any()  # the module keeps its own weights


# ---------------------------------------------------------------------------------------------------- resume="auto"
class _CrashingRegressor(TinyRegressor):
    """Raises in the training step at global step ``crash_at`` (a failure that leaves no emergency checkpoint)."""

    def __init__(self, lr: float, crash_at: int) -> None:
        super().__init__(lr=lr)
        self.crash_at = crash_at

    def training_step(self, batch, batch_idx):
        if self.global_step == self.crash_at:
            raise RuntimeError("injected failure")
        return super().training_step(batch, batch_idx)


def _auto_fit(root: Path, *, lr: float = 0.05, resume="auto", ckpt: str | None = None, crash_at: int = -1,
              save_every: int = 0, save_last: bool = False, **kwargs):  # fmt: skip
    """One replica, 5 global batches of 8 per epoch, checkpoints in ``root/checkpoints`` (every epoch's end, or
    every ``save_every`` steps); returns the model (``seen_batch_sizes``: one entry per step trained) and the
    warnings."""
    pl.seed_everything(0)
    model = _CrashingRegressor(lr, crash_at)
    every = (
        {"every_n_train_steps": save_every} if save_every else {"every_n_epochs": 1, "save_on_train_epoch_end": True}
    )
    checkpoints = ModelCheckpoint(root / "checkpoints", "{epoch}-{step}", save_top_k=-1, save_last=save_last, **every)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=HeterogeneousStrategy(speeds=[1.0], global_batch_size=8, resume=resume, process_group_backend="gloo"),
        logger=False,
        callbacks=[checkpoints],
        default_root_dir=str(root),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **kwargs,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, DataLoader(make_dataset(40), batch_size=4, shuffle=True), ckpt_path=ckpt)
    ours = [str(w.message) for w in caught if "resume='auto'" in str(w.message)]
    return model, trainer, ours


def _emergency_at_step_7(root: Path, lr: float) -> Path:
    """What a job that lost a replica after step 7 leaves in ``root``: ``emergency.ckpt`` of step 7 (the same
    content as a ModelCheckpoint's, which the strategy writes through the same record)."""
    _auto_fit(root, lr=lr, resume=None, save_every=7, max_steps=7)
    emergency = root / "checkpoints" / "emergency.ckpt"
    (root / "checkpoints" / "epoch=1-step=7.ckpt").rename(emergency)
    for other in (root / "checkpoints").glob("epoch=*"):
        other.unlink()
    return emergency


def test_the_job_identity_names_what_differs():
    model = TinyRegressor()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    job = job_identity(model, [sgd], [], {"comm": "exact"})
    assert job["optimizer 0"] == "SGD" and job["optimizer 0 group 0 lr"] == 0.1 and job["comm"] == "exact"
    other = job_identity(model, [torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)], [], {"comm": "exact"})
    assert identity_differences(job, other) == ["optimizer 0 group 0 lr 0.1 -> 0.5"]
    assert identity_differences(job, job) == []
    # a scheduler changes the live lr: its initial_lr is the configured one
    scheduled = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(scheduled, lambda epoch: 0.5)
    with_scheduler = job_identity(model, [scheduled], [scheduler], {"comm": "exact"})
    assert with_scheduler["optimizer 0 group 0 lr"] == 0.1 and with_scheduler["scheduler 0"] == "LambdaLR"
    bigger = job_identity(torch.nn.Linear(4, 2), [], [], {})
    assert identity_differences(bigger, job_identity(torch.nn.Linear(4, 3), [], [], {}))[0].startswith("model 'Linear")
    assert "no job identity" in identity_differences(None, job)[0]


def test_candidates_are_every_checkpoint_of_the_run_directory_once(tmp_path):
    folder = tmp_path / "logs" / "version_1" / "checkpoints"
    earlier = tmp_path / "logs" / "version_0" / "checkpoints"
    own = tmp_path / "own"
    for path in (folder / "epoch=0-step=5.ckpt", earlier / "epoch=2-step=15.ckpt", own / "emergency.ckpt",
                 own / "notes.txt"):  # fmt: skip
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x")
    (own / "last.ckpt").symlink_to(own / "emergency.ckpt")
    found = checkpoint_candidates(str(own / "last.ckpt"), [str(folder), None])
    assert sorted(found) == sorted(map(str, [own / "last.ckpt", folder / "epoch=0-step=5.ckpt",
                                             earlier / "epoch=2-step=15.ckpt"]))  # fmt: skip


def test_the_choice_follows_progress_past_unreadable_files_and_other_jobs():
    job = {"model": "m", "optimizer 0 group 0 lr": 0.1}
    other = {**job, "optimizer 0 group 0 lr": 0.5}
    candidates = [
        Candidate("emergency.ckpt", 7, 1, 30.0, job),  # the newest file, but the least progress
        Candidate("epoch=2-step=15.ckpt", mtime=40.0, error="RuntimeError: truncated"),
        Candidate("old.ckpt", mtime=1.0, error="EOFError: "),  # written before the chosen one: not named
        Candidate("b.ckpt", 20, 3, 10.0, other),
        Candidate("epoch=1-step=10.ckpt", 10, 1, 20.0, job),
        Candidate("last.ckpt", 10, 1, 25.0, job, global_batch_size=8),  # same step, written later
        Candidate("weights.ckpt", 30, 5, 50.0, job, weights_only=True),  # ModelCheckpoint(save_weights_only=True)
    ]
    path, lines = choose_checkpoint(candidates, job, None)
    assert path == "last.ckpt"
    assert len(lines) == 2 and "skips epoch=2-step=15.ckpt: it cannot be read (RuntimeError: truncated)" in lines[0]
    assert "resuming from last.ckpt" in lines[0]
    # the one other job's checkpoint passed over, named with what differs
    assert "does not resume b.ckpt: it is another job's checkpoint (optimizer 0 group 0 lr 0.5 -> 0.1);" in lines[1]
    # another global batch given explicitly: not an exact continuation of the checkpoint that recorded 8
    assert choose_checkpoint(candidates, job, 16)[0] == "epoch=1-step=10.ckpt"
    path, lines = choose_checkpoint(candidates[1:4], job, None)
    assert path is None and [line.split(":")[0] for line in lines[:2]] == [
        "resume='auto' skips epoch=2-step=15.ckpt",
        "resume='auto' skips old.ckpt",
    ]


def test_auto_resume_does_not_resume_another_jobs_emergency_checkpoint(tmp_path):
    """Job A (lr 0.1) leaves emergency.ckpt; job B (lr 0.5) in the same directory starts fresh, with one warning
    naming the file and the setting, and ends where a fresh job B does."""
    emergency = _emergency_at_step_7(tmp_path, lr=0.1)
    job_b, trainer, warned = _auto_fit(tmp_path, lr=0.5, max_epochs=2)
    assert len(job_b.seen_batch_sizes) == 10 and trainer.global_step == 10
    assert len(warned) == 1 and f"does not resume {emergency}" in warned[0]
    assert "optimizer 0 group 0 lr 0.1 -> 0.5" in warned[0] and "starting a fresh fit" in warned[0]
    fresh, _, _ = _auto_fit(tmp_path / "fresh", lr=0.5, resume=None, max_epochs=2)
    assert all(torch.equal(a, b) for a, b in zip(_weights(fresh).values(), _weights(job_b).values()))
    # the same job (lr 0.1) resumes it: the 3 steps after step 7
    (tmp_path / "a" / "checkpoints").mkdir(parents=True)
    shutil.copy(emergency, tmp_path / "a" / "checkpoints" / "emergency.ckpt")
    job_a, trainer, warned = _auto_fit(tmp_path / "a", lr=0.1, max_epochs=2)
    assert len(job_a.seen_batch_sizes) == 3 and trainer.global_step == 10 and warned == []


def test_auto_resume_takes_the_checkpoint_with_the_most_progress_and_a_finished_job_trains_nothing(tmp_path):
    """A failure at step 7 left emergency.ckpt; the run resumed from it then failed at step 12 without one (an
    exception), after the epoch-end checkpoint of step 10: the next run continues from step 10, not the stale
    step 7; once finished, running it again trains nothing and ends on the same weights."""
    emergency = _emergency_at_step_7(tmp_path, lr=0.05)
    with pytest.raises(RuntimeError, match="injected failure"):
        _auto_fit(tmp_path, ckpt=str(emergency), crash_at=12, max_epochs=3)
    assert (tmp_path / "checkpoints" / "epoch=1-step=10.ckpt").exists()
    restarted, trainer, warned = _auto_fit(tmp_path, max_epochs=3)
    assert len(restarted.seen_batch_sizes) == 5 and trainer.global_step == 15 and warned == []
    again, trainer, warned = _auto_fit(tmp_path, max_epochs=3)
    assert again.seen_batch_sizes == [] and trainer.global_step == 15 and warned == []
    assert all(torch.equal(a, b) for a, b in zip(_weights(restarted).values(), _weights(again).values()))
    assert _close(_weights(again), reference_weights(make_dataset(40), 8, epochs=3, seed=0))


def test_auto_resume_falls_back_past_a_truncated_checkpoint_with_one_warning(tmp_path):
    _auto_fit(tmp_path, resume=None, save_last=True, max_epochs=2)
    folder = tmp_path / "checkpoints"
    for name in ("last.ckpt", "epoch=1-step=10.ckpt"):  # a full disk: the newest files cut short
        data = (folder / name).read_bytes()
        (folder / name).write_bytes(data[: len(data) // 2])
    resumed, trainer, warned = _auto_fit(tmp_path, max_epochs=3)
    assert len(resumed.seen_batch_sizes) == 10 and trainer.global_step == 15  # from epoch 0's checkpoint
    assert len(warned) == 2 and all("cannot be read (not a complete checkpoint archive" in line for line in warned)
    assert {line.split(" skips ")[1].split(":")[0] for line in warned} == {
        str(folder / "last.ckpt"), str(folder / "epoch=1-step=10.ckpt")}  # fmt: skip
    assert _close(_weights(resumed), reference_weights(make_dataset(40), 8, epochs=3, seed=0))


def test_a_mid_epoch_resume_leaves_lightnings_warning_to_later_trainers(tmp_path):
    _fit(tmp_path, save_every=7, max_steps=7)
    before = list(warnings.filters)
    _fit(tmp_path / "resumed", ckpt=str(tmp_path / "step=7.ckpt"))  # silences it for its own resume
    assert warnings.filters == before
    # a later single-device Trainer resuming mid-epoch from a plain DataLoader still gets it
    plain = pl.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
                       enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        plain.fit(TinyRegressor(), DataLoader(make_dataset(40), batch_size=8), ckpt_path=str(tmp_path / "step=7.ckpt"))
    assert [w for w in caught if "ended before the epoch ended" in str(w.message)]


# ---------------------------------------------------------------------------------------------------- real jobs
#: two emulated nodes, DiLoCo's outer step every 2 steps over int8 (error feedback), SGD momentum inside the nodes
OUTER = {
    "comm": "node_local",
    "node_ids": [0, 1],
    "speeds": [1, 3],
    "global_sync_every": 2,
    "outer_optimizer": "nesterov",
    "sync_dtype": "int8",
}
#: the two-replica fits of this module that resume nothing, run in one job (the two-replica resumes follow them there)
TWO_REPLICA_FITS = {
    # speeds 1:3, 2 epochs of 5 global batches of 8, a checkpoint after step 7 (mid-epoch 1)
    "uninterrupted": {"devices": 2, "strategy": {"speeds": [1, 3]}, "save_every": 7},
    # two emulated nodes, ``comm="node_local"`` averaging only at epoch ends, a checkpoint after step 3
    "node_local": {
        "devices": 2,
        "strategy": {"comm": "node_local", "node_ids": [0, 1], "speeds": [1, 3]},
        "save_every": 3,
        "epochs": 1,
    },
    # the same nodes with DiLoCo's outer step every 2 steps: the step-3 checkpoint is in the middle of a round; each
    # node's inner momentum and compression residual are its own
    "outer": {
        "devices": 2,
        "strategy": OUTER,
        "save_every": 3,
        "epochs": 2,
    },
}


#: the two-replica resumes from checkpoints of :data:`TWO_REPLICA_FITS` (``(fit, checkpoint)``, its config), run after
#: them in the same job
TWO_REPLICA_RESUMES = {
    # the uninterrupted fit's step-7 checkpoint on the same 2 replicas without speeds (they would profile)
    "same": (("uninterrupted", "step=7.ckpt"), {"devices": 2, "strategy": {}}),
    # the outer fit's step-3 checkpoint (in the middle of a round), saving every 3 steps as the first fit did
    "outer resumed": (("outer", "step=3.ckpt"), TWO_REPLICA_FITS["outer"]),
}


@pytest.fixture(scope="module")
def two_replica_fits(tmp_path_factory) -> dict[str, Path]:
    """The directory each fit of :data:`TWO_REPLICA_FITS` and :data:`TWO_REPLICA_RESUMES` wrote into (its output is
    in ``output.txt`` there), all in one job (one launch and rendezvous for all)."""
    out = tmp_path_factory.mktemp("two_replica_fits")
    names = [*TWO_REPLICA_FITS, *TWO_REPLICA_RESUMES]
    folders = {name: out / str(index) for index, name in enumerate(names)}
    resumes = [
        {**cfg, "resume": str(folders[fit] / "ckpt" / ckpt)} for (fit, ckpt), cfg in TWO_REPLICA_RESUMES.values()
    ]
    job = run_harness("resume", out, [*TWO_REPLICA_FITS.values(), *resumes])
    assert job.returncode == 0, job.output[-4000:]
    for folder, output in zip(folders.values(), split_output(job.output, len(names))):
        (folder / "output.txt").write_text(output)
    return folders


@pytest.fixture(scope="module")
def uninterrupted(two_replica_fits):
    """2 replicas, speeds 1:3, 2 epochs of 5 global batches of 8, a checkpoint after step 7 (mid-epoch 1)."""
    out = two_replica_fits["uninterrupted"]
    return out, [torch.load(out / f"rank{r}.pt") for r in range(2)]


@pytest.fixture(scope="module")
def resumed(two_replica_fits, uninterrupted, tmp_path_factory) -> dict[str, tuple[str, list[dict]]]:
    """Both resumes from the uninterrupted fit's step-7 checkpoint: on the ``"same"`` 2 replicas without speeds (they
    would profile; in the job of :func:`two_replica_fits`), and on ``"three"`` replicas with speeds [1, 1, 2] and no
    ``global_batch_size`` (the checkpoint's 8 is kept, not the DataLoader's 4 x 3). Each: the output and the per-rank
    dumps."""
    same = two_replica_fits["same"]
    ckpt = uninterrupted[0] / "ckpt" / "step=7.ckpt"
    three = tmp_path_factory.mktemp("three")
    job = run_harness("resume", three, {"devices": 3, "strategy": {"speeds": [1, 1, 2]}, "resume": str(ckpt)})
    assert job.returncode == 0, job.output[-4000:]
    return {
        "same": ((same / "output.txt").read_text(), [torch.load(same / f"rank{r}.pt") for r in range(2)]),
        "three": (job.output, [torch.load(three / f"rank{r}.pt") for r in range(3)]),
    }


@pytest.mark.slow
def test_resume_on_the_same_replicas_continues_exactly(uninterrupted, resumed):
    _, full = uninterrupted
    log, dumps = resumed["same"]
    assert "resuming with the checkpoint's speeds [1.0, 3.0] (no re-profiling" in log
    assert "skips the 2 global batch(es) already trained on" in log
    for rank, dump in enumerate(dumps):
        assert dump["batch_sizes"] == [2, 6] and dump["global_step"] == 10
        assert dump["seen_batch_sizes"] == [[2, 6][rank]] * 3
        assert _close(dump["state_dict"], full[rank]["state_dict"])


@pytest.mark.slow
def test_resume_on_three_replicas_rebalances_and_stays_on_the_trajectory(uninterrupted, resumed):
    _, full = uninterrupted
    log, dumps = resumed["three"]
    assert "re-balancing on resume: the checkpoint was trained by 2 replica(s)" in log
    assert "batch sizes [2, 6] -> [2, 2, 4]" in log
    # no global_batch_size given: the checkpoint's 8, not the DataLoader's batch_size 4 x 3 replicas
    assert "resuming with the checkpoint's global batch of 8 samples" in log
    for dump in dumps:
        assert dump["batch_sizes"] == [2, 2, 4] and dump["global_step"] == 10
        assert _close(dump["state_dict"], full[0]["state_dict"])  # the same global batches, split differently


@pytest.mark.slow
def test_node_local_checkpoint_holds_the_consensus_model(two_replica_fits):
    """Two emulated nodes, ``comm="node_local"`` averaging only at epoch ends: the replicas drift apart, yet a
    checkpoint taken mid-epoch (step 3) holds their share-weighted average, while every replica keeps its own model."""
    tmp_path = two_replica_fits["node_local"]
    saved = torch.load(tmp_path / "ckpt" / "step=3.ckpt", weights_only=True)["state_dict"]
    saved = {k.removeprefix("net."): v for k, v in saved.items() if k.startswith("net.")}
    before = [torch.load(tmp_path / f"before_step3_rank{r}.pt") for r in range(2)]
    held = [torch.load(tmp_path / f"saved_step3_rank{r}.pt") for r in range(2)]
    assert not all(torch.equal(before[0][k], before[1][k]) for k in saved)  # local models differ before the save
    for k in saved:
        assert torch.allclose(saved[k], 0.25 * before[0][k] + 0.75 * before[1][k], atol=1e-6)  # shares 2/8, 6/8
        assert torch.equal(before[0][k], held[0][k]) and torch.equal(before[1][k], held[1][k])


@pytest.mark.slow
def test_outer_step_resumes_in_the_middle_of_a_round_exactly(two_replica_fits):
    """The checkpoint records the outer optimizer's momentum and each node's own inner optimizer state (SGD momentum)
    and int8 residual; resumed after step 3 of a 2-step round schedule (saving every 3 steps as the first fit did),
    every node continues from its own state and the fit ends where the uninterrupted one ended."""
    out = two_replica_fits["outer"]
    checkpoint = torch.load(out / "ckpt" / "step=3.ckpt", weights_only=True)
    record = checkpoint["lightning_het"]["comm"]
    assert record["samples"] == [2, 6] and record["merge"]["optimizer"]["state"]  # a step since the sync at step 2
    nodes = record["nodes"]
    assert nodes["layout"] == [1, 1]
    assert nodes["optimizer_states"][0] is checkpoint["optimizer_states"]  # node 0's is rank 0's, stored once
    momenta = [states[0]["state"][0]["momentum_buffer"] for states in nodes["optimizer_states"]]
    assert not torch.allclose(momenta[0], momenta[1])  # each node's own
    assert all(r is not None and r.abs().max() > 0 for r in nodes["residuals"])
    again = two_replica_fits["outer resumed"]  # resumed from that checkpoint with the fit's own config
    for rank in range(2):
        full, resumed = (torch.load(d / f"rank{rank}.pt")["state_dict"] for d in (out, again))
        assert _close(resumed, full)


def test_at_position_sets_the_samplers_place_only():
    """The emergency record kept from an epoch's first step gets the step's place: batches done, epoch finished."""
    from lightning_het.reliability.checkpointing import at_position

    record = {"version": 1, "sampler": {"epoch": 2, "num_steps": 9}, "batch_sizes": [3, 5]}
    placed = at_position(record, 4, 2)
    assert placed == {**record, "sampler": {"epoch": 2, "num_steps": 9, "steps_done": 4, "epoch_finished": False}}
    assert at_position(record, 9, 3)["sampler"]["epoch_finished"] is True
    assert record["sampler"] == {"epoch": 2, "num_steps": 9}  # not modified
    assert at_position({"sampler": None}, 4, 2) == {"sampler": None}
