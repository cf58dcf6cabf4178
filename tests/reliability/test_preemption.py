"""SIGTERM / SIGUSR1: the replicas agree at the next step boundary, rank 0 saves, all exit 143 (docs/preemption.md)."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import pickle
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.utils.data import DataLoader, Dataset

from lightning_het import HeterogeneousStrategy
from lightning_het.reliability.launch import (
    AGREE_EVERY_S,
    PREEMPTION_EXIT_CODE,
    Preempted,
    PreemptionHandler,
    _shielded_init,
    preemption_path,
    shield_loader_workers,
)
from tests.helpers import harness
from tests.helpers.gloo import run_gloo
from tests.helpers.harness import run_harness
from tests.helpers.jobs import REPO, JobResult, group_members, job_env
from tests.helpers.side_by_side import Results, SideBySide
from tests.helpers.tiny import FLAVOUR_ENV
from tests.helpers.watchdogs import ExitRecorder

BASE = {"devices": 2, "strategy": {"speeds": [1, 3]}, "epochs": 2, "n": 80, "batch_size": 4}  # 10 steps per epoch


# ---------------------------------------------------------------------------------------------------- in process
def test_preempted_exits_143_and_is_lightnings_sigterm_exception():
    err = Preempted("/x/last.ckpt", [0, 15])
    assert isinstance(err, SIGTERMException) and isinstance(err, SystemExit)
    assert err.code == PREEMPTION_EXIT_CODE == 143 and err.signals == [0, 15]


@pytest.mark.parametrize("grace", [0, -1, float("nan"), "25", True])
def test_bad_grace(grace):
    with pytest.raises(ValueError, match=r"Expected argument `preemption_grace` to be finite seconds > 0"):
        HeterogeneousStrategy(preemption_grace=grace)


def test_default_preemption_path(tmp_path):
    plain = SimpleNamespace(checkpoint_callbacks=[], default_root_dir=str(tmp_path))
    assert preemption_path(plain) == str(tmp_path / "checkpoints" / "last.ckpt")
    with_callback = SimpleNamespace(checkpoint_callbacks=[ModelCheckpoint(tmp_path / "ck")], default_root_dir="/")
    assert preemption_path(with_callback) == str(tmp_path / "ck" / "last.ckpt")


def test_the_apps_strategy_schema_passes_the_preemption_keywords():
    from lightning_het.app.config import StrategyConfig

    strategy = HeterogeneousStrategy(**StrategyConfig(preemption_checkpoint="ck/", preemption_grace=5).to_kwargs())
    reliability = strategy.config.reliability
    assert reliability.preemption_grace == 5.0 and reliability.preemption_checkpoint == "ck/"


def test_preemption_checkpoint_false_is_accepted_by_the_strategy_and_the_apps_schema():
    from lightning_het.app.config import StrategyConfig

    assert HeterogeneousStrategy(preemption_checkpoint=False).config.reliability.preemption_checkpoint is False
    strategy = HeterogeneousStrategy(**StrategyConfig(preemption_checkpoint=False).to_kwargs())
    assert strategy.config.reliability.preemption_checkpoint is False
    with pytest.raises(ValueError, match=r"`preemption_checkpoint` to be a file or directory path.*got True"):
        HeterogeneousStrategy(preemption_checkpoint=True)


def test_preemption_checkpoint_false_stops_without_saving(capsys, monkeypatch):
    """The replicas still stop at the agreed step and end with 143; nothing is written."""
    from lightning_het.reliability.launch import ExitCleanup

    monkeypatch.setattr(ExitCleanup, "exit_code", None)  # what preempt sets is undone after the test

    def no_save(path):
        raise AssertionError(f"saved {path}")

    trainer = SimpleNamespace(global_step=7, current_epoch=1, save_checkpoint=no_save, checkpoint_callbacks=[])
    exits = ExitRecorder()
    handler = PreemptionHandler(0.2, False, exit=exits)
    err = handler.preempt(trainer, [int(signal.SIGTERM)])
    assert isinstance(err, Preempted) and err.checkpoint is None and err.code == PREEMPTION_EXIT_CODE
    assert "stopped after global step 7 (epoch 1); saved no checkpoint (preemption_checkpoint=False)" in (
        capsys.readouterr().err
    )
    assert exits.done.wait(10) and exits.codes == [PREEMPTION_EXIT_CODE]  # the deadline still ends a stuck replica
    assert ExitCleanup.exit_code == PREEMPTION_EXIT_CODE  # and the process ends with 143 once its exit handlers ran


def _spaced_agreement_worker(rank: int, world_size: int) -> list[tuple[int, list[int]]]:
    """Up to 200 steps of 10 ms (rank 1: 20 ms); rank 1 is signalled after step 30. Returns the number of all-reduces
    and (step, agreed) of the first two steps and of the stop."""
    import torch.distributed as dist

    reduces = []
    all_reduce = dist.all_reduce
    dist.all_reduce = lambda *args, **kwargs: reduces.append(1) or all_reduce(*args, **kwargs)
    handler = PreemptionHandler()
    handler.rank, handler.world_size = rank, world_size  # what the strategy records, without taking over the signals
    seen = []
    for step in range(1, 201):
        time.sleep(0.01 * (rank + 1))
        handler.received = int(signal.SIGTERM) if rank == 1 and step > 30 else 0
        agreed = handler.agree(torch.device("cpu"), step)
        if any(agreed) or not seen or step < 3:
            seen.append((step, agreed))
        if any(agreed):
            break
    return len(reduces), seen


def test_short_steps_share_one_agreement_and_every_replica_stops_at_the_same_step(tmp_path):
    """About every AGREE_EVERY_S (the slower replica's pace decides), the same steps on every replica, the signal
    seen."""
    (reduces, seen), other = run_gloo(_spaced_agreement_worker, 2, tmp_path)
    assert (reduces, seen) == other  # the same agreements at the same steps, the same flags
    interval = int(AGREE_EVERY_S / 0.02)  # steps of 20 ms or more (the slower replica), rounded down
    assert 3 <= reduces <= 8  # 2 at the start, then one per interval (~3 here; one per step would be 30+)
    steps = [step for step, _ in seen]
    assert steps[:2] == [1, 2]  # step 1 agrees on step 2 (no pace yet), step 2 measures the pace
    stop, agreed = seen[-1]
    assert agreed == [0, int(signal.SIGTERM)]
    assert 31 <= stop <= 31 + interval + 1  # at most one interval after the signal


class _SignalDisposition(Dataset):
    """Each item: whether SIGTERM and SIGUSR1 are ignored in the process that loads it."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> torch.Tensor:
        ignored = [signal.getsignal(s) == signal.SIG_IGN for s in (signal.SIGTERM, signal.SIGUSR1)]
        return torch.tensor([*ignored, os.environ.get("INNER_RAN") == "1"])


def _inner(worker_id: int) -> None:
    os.environ["INNER_RAN"] = "1"


def test_loader_workers_ignore_the_preemption_signals_and_keep_their_init_fn():
    loader = DataLoader(_SignalDisposition(), batch_size=2, num_workers=1, worker_init_fn=_inner)
    assert shield_loader_workers(loader, rank=0) is loader
    wrapped = loader.worker_init_fn
    assert wrapped.func is _shielded_init and wrapped.args[0] is _inner
    shield_loader_workers(loader, rank=0)
    assert loader.worker_init_fn is wrapped  # not wrapped twice
    pickle.dumps(wrapped)  # spawn/forkserver workers receive it pickled
    assert next(iter(loader)).tolist() == [[True, True, True], [True, True, True]]
    no_workers = DataLoader(_SignalDisposition())
    assert shield_loader_workers(no_workers, rank=0).worker_init_fn is None


@pytest.mark.parametrize(("fitting", "grace", "signum"), [(True, 0.3, signal.SIGTERM), (False, 30.0, signal.SIGUSR1)])
def test_signal_is_noticed_and_the_deadline_ends_the_process(fitting, grace, signum):
    """The C-level wakeup pipe notices the signal; the deadline ends the replica with 143 after `grace` (in fit) or
    at once (outside fit); the previous handlers come back afterwards."""
    previous = signal.getsignal(signum)
    exits = ExitRecorder()
    handler = PreemptionHandler(grace, exit=exits)
    handler.rank, handler.world_size, handler.fitting = 0, 1, fitting
    handler.register_signal_handlers()
    try:
        started = time.monotonic()
        os.kill(os.getpid(), signum)
        assert exits.done.wait(10), "the deadline never fired"
        assert exits.codes == [PREEMPTION_EXIT_CODE] and handler.received == signum
        assert grace <= time.monotonic() - started < grace + 5 if fitting else time.monotonic() - started < 5
        assert handler.agree(torch.device("cpu")) == [signum]  # one replica: no collective
    finally:
        handler.teardown()
    assert signal.getsignal(signum) == previous


# ---------------------------------------------------------------------------------------------------- real jobs
@dataclass
class Stopped:
    out: Path  # the job's directory
    returncode: int
    output: str
    seconds: float  # from the signal until the last process holding the job's output ended
    survivors: list[int] = field(default_factory=list)


def _signal_job(out: Path, cfg: dict, *, target: str = "group", signum: int = signal.SIGTERM, wait_for: str = "ready",
                limit: float = 240, flavour: str = "lightning") -> Stopped:  # fmt: skip
    """Start the harness's ``preempt`` job in its own session (on the Lightning package ``flavour``), wait until it
    wrote ``{wait_for}{r}`` (every rank for "ready", rank 1 otherwise), send ``signum`` to the process group, the
    launcher (rank 0) or replica 1, and wait for the end."""
    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [sys.executable, *harness.command("preempt", out, cfg)],
        cwd=REPO,
        env=job_env({FLAVOUR_ENV: flavour}),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.append(proc.stdout.read()), daemon=True)
    reader.start()
    try:
        markers = [out / f"{wait_for}{r}" for r in ((0, 1) if wait_for == "ready" else (1,))]
        deadline = time.monotonic() + limit
        while not all(m.exists() for m in markers):
            if proc.poll() is not None or time.monotonic() > deadline:
                reader.join(5)
                raise AssertionError(f"the job never reached its markers (status {proc.poll()}):\n{''.join(output)}")
            time.sleep(0.02)
        sent = time.monotonic()
        if target == "group":
            os.killpg(proc.pid, signum)
        elif target == "launcher":
            os.kill(proc.pid, signum)
        else:
            os.kill(int((out / "ready1").read_text()), signum)
        reader.join(60)
        assert not reader.is_alive(), "the job still holds its output 60 s after the signal"
        seconds = time.monotonic() - sent
        proc.wait(5)
        end = time.monotonic() + 3
        while group_members(proc.pid) and time.monotonic() < end:
            time.sleep(0.1)
        return Stopped(out, proc.returncode, "".join(output), seconds, group_members(proc.pid))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path)["state_dict"]


#: the real jobs of this module: independent (but for the resume of a stopped fit), and mostly waiting (for the
#: signal, the grace, the checkpoint), so they run side by side; the chain of two jobs first
JOBS = SideBySide(width=3)
SIGTERM_TEST = "test_sigterm_to_the_process_group_saves_and_the_resumed_fit_continues_exactly"


@pytest.fixture(scope="module")
def jobs(request, tmp_path_factory) -> Results:
    return JOBS.run(request, tmp_path_factory)


@JOBS.job("preempted, full and resumed", SIGTERM_TEST)
def _preempted_full_and_resumed(out: Path) -> tuple[Stopped, JobResult, JobResult | None]:
    """A fit stopped by SIGTERM to its process group in the middle of epoch 1; then, in one job (one launch for both),
    the same fit uninterrupted into ``full/0`` and the stopped fit resumed from its checkpoint into ``full/1``. The
    job's end, and the same (the resumed fit's) or ``None`` when the stopped fit saved no checkpoint."""
    cfg = {**BASE, "step_cost": 0.02, "ready_step": 12, "loader": {"num_workers": 1, "persistent_workers": True}}
    stopped = _signal_job(out / "pre", cfg)
    ckpt = out / "pre" / "checkpoints" / "last.ckpt"  # no ModelCheckpoint: <default_root_dir>/checkpoints
    resume = [{**BASE, "resume": str(ckpt)}] if ckpt.exists() else []
    (out / "full").mkdir()
    after = run_harness("preempt", out / "full", [BASE, *resume])
    return stopped, after, after if resume else None


@pytest.mark.slow
def test_sigterm_to_the_process_group_saves_and_the_resumed_fit_continues_exactly(jobs):
    stopped, full, resumed = jobs["preempted, full and resumed"]
    full_dir = stopped.out.parent / "full" / "0"
    assert full.returncode == 0, full.output[-4000:]
    assert (full_dir / "rank0.pt").exists() and (full_dir / "rank1.pt").exists(), full.output[-4000:]

    pre = stopped.out
    assert stopped.returncode == PREEMPTION_EXIT_CODE, stopped.output[-4000:]
    assert stopped.seconds < 30 and stopped.survivors == []
    assert "launched replicas ended with [143]" in stopped.output  # replica 1 too
    ckpt = pre / "checkpoints" / "last.ckpt"  # no ModelCheckpoint: <default_root_dir>/checkpoints
    # both replicas get the signal; the message names those whose handler had run when the replicas agreed (on a
    # busy machine a replica inside a collective runs it later)
    assert re.search(r"lightning_het preemption: replica\(s\) \[(0, 1|0|1)\] received SIGTERM; all 2 replica\(s\)"
                     rf" stopped after global step 1\d \(epoch 1\); saved {re.escape(str(ckpt))}", stopped.output), [
        line for line in stopped.output.splitlines() if "preemption:" in line]  # fmt: skip
    assert ckpt.exists() and not list((pre / "checkpoints").glob("*.tmp"))
    assert not list(pre.glob("rank*.pt"))  # nobody trained on to the end
    saved = torch.load(ckpt, weights_only=True)
    assert 12 <= saved["global_step"] < 20
    sampler = saved["lightning_het"]["sampler"]
    assert sampler["epoch"] == 1 and sampler["steps_done"] == saved["global_step"] - 10
    assert "DataLoader worker" not in stopped.output  # the workers were not killed by the signal

    assert resumed.returncode == 0, resumed.output[-4000:]
    for rank in range(2):
        expected = _weights(full_dir / f"rank{rank}.pt")
        got = torch.load(pre.parent / "full" / "1" / f"rank{rank}.pt")
        assert got["global_step"] == 20
        assert len(got["seen_batch_sizes"]) == 20 - saved["global_step"]
        for name, value in expected.items():
            assert torch.allclose(got["state_dict"][name], value, rtol=1e-6, atol=1e-6), name


SIGNAL_CASES = [
    pytest.param("lightning", "launcher", "SIGTERM", id="launcher-SIGTERM"),
    pytest.param("lightning", "replica", "SIGUSR1", id="replica-SIGUSR1"),
    pytest.param("pytorch_lightning", "launcher", "SIGTERM", id="pytorch_lightning-launcher-SIGTERM"),
]


def _signal_to_one(out: Path, flavour: str, target: str, signame: str) -> Stopped:
    cfg = {**BASE, "step_cost": 0.01, "ready_step": 3, "ckpt_dir": str(out / "ck")}
    return _signal_job(out / "job", cfg, target=target, signum=getattr(signal, signame), flavour=flavour)


for _case in SIGNAL_CASES:
    if _case.values[0] == "lightning" or importlib.util.find_spec(_case.values[0]) is not None:
        _name = f"test_a_signal_to_one_process_stops_every_replica[{_case.id}]"
        JOBS.add(_name, functools.partial(_signal_to_one, flavour=_case.values[0], target=_case.values[1],
                                          signame=_case.values[2]))  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(("flavour", "target", "signame"), SIGNAL_CASES)
def test_a_signal_to_one_process_stops_every_replica(jobs, request, flavour, target, signame):
    """SIGTERM to the launching process (rank 0) only, or SLURM's SIGUSR1 to replica 1 only: all replicas agree, the
    checkpoint goes where the user's ModelCheckpoint writes (on the standalone ``pytorch_lightning`` too)."""
    if flavour != "lightning":
        pytest.importorskip(flavour)
    stopped = jobs[request.node.name]
    assert stopped.returncode == PREEMPTION_EXIT_CODE, stopped.output[-4000:]
    assert stopped.seconds < 30 and stopped.survivors == []
    who = 0 if target == "launcher" else 1
    assert f"replica(s) [{who}] received {signame}" in stopped.output
    assert "launched replicas ended with [143]" in stopped.output
    assert (stopped.out.parent / "ck" / "last.ckpt").exists()


@JOBS.job("test_sigterm_without_a_preemption_checkpoint_stops_every_replica_and_saves_nothing")
def _without_checkpoint(out: Path) -> Stopped:
    cfg = {**BASE, "strategy": {"speeds": [1, 3], "preemption_checkpoint": False}, "step_cost": 0.01, "ready_step": 3}
    return _signal_job(out / "job", cfg)


@pytest.mark.slow
def test_sigterm_without_a_preemption_checkpoint_stops_every_replica_and_saves_nothing(jobs, request):
    """`preemption_checkpoint=False` (with `enable_checkpointing=False`, which alone does not switch the save off):
    every replica stops at the same step boundary and exits 143; no checkpoint is written."""
    stopped = jobs[request.node.name]
    assert stopped.returncode == PREEMPTION_EXIT_CODE, stopped.output[-4000:]
    assert stopped.seconds < 30 and stopped.survivors == []
    assert "saved no checkpoint (preemption_checkpoint=False)" in stopped.output
    assert "launched replicas ended with [143]" in stopped.output
    assert not list(stopped.out.rglob("*.ckpt*"))


@JOBS.job("test_a_stuck_replica_does_not_keep_the_others_alive")
def _stuck_replica(out: Path) -> Stopped:
    cfg = {**BASE, "strategy": {"speeds": [1, 3], "preemption_grace": 3}, "stuck_rank": 1, "stuck_step": 2}
    return _signal_job(out / "job", cfg, wait_for="stuck")


@pytest.mark.slow
def test_a_stuck_replica_does_not_keep_the_others_alive(jobs, request):
    """Replica 1 never reaches the step boundary (replica 0 waits for it in the gradient all-reduce): both end with
    143 once `preemption_grace` has passed, and nothing is left."""
    stopped = jobs[request.node.name]
    assert stopped.returncode == PREEMPTION_EXIT_CODE, stopped.output[-4000:]
    assert 3 <= stopped.seconds < 20 and stopped.survivors == []
    assert "did not end within preemption_grace=3 s" in stopped.output
    assert not (stopped.out / "checkpoints" / "last.ckpt").exists()
