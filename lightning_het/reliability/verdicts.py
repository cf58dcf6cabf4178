"""What the watchdog concludes: phases, statuses, verdicts, the pure :func:`judge` and exit statuses."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from enum import IntEnum

import torch.distributed as dist

WATCHDOG_EXIT_CODE = 124  # exit status of a replica ended by the watchdog (as ``timeout(1)`` uses for "timed out")
INTERRUPTED_EXIT_CODE = 130  # exit status of a job interrupted by Ctrl-C (SIGINT), as shells report it


def exit_code_for(verdict: Verdict) -> int:
    """The exit status of a replica ended by ``verdict``: 130 for Ctrl-C, else 124 (stalled, dead or failed)."""
    return INTERRUPTED_EXIT_CODE if verdict.kind == "interrupted" else WATCHDOG_EXIT_CODE


def is_sigterm_exit(exception: BaseException) -> bool:
    """Whether ``exception`` is a ``SIGTERMException`` of either Lightning package (e.g. preempted)."""
    return isinstance(exception, SystemExit) and any(
        cls.__name__ == "SIGTERMException" and cls.__module__.endswith(".utilities.exceptions")
        for cls in type(exception).__mro__
    )


class Phase(IntEnum):
    """Where a replica's main thread is (values increase with progress), and its :attr:`text`."""

    def __new__(cls, value: int, text: str) -> Phase:
        self = int.__new__(cls, value)  # the member being made
        self._value_, self.text = value, text
        return self

    SETUP = 0, "in setup (setup hooks, model wrapping, data loaders)"  # process group up, checkpoint restore
    PROFILING = 1, "profiling the training step (speed measurement)"
    TRAINING_STEP = 2, "in training_step"
    BACKWARD = 3, "in backward (gradient all-reduce)"
    OPTIMIZER_STEP = 4, "in the optimizer step"
    BETWEEN_BATCHES = 5, "between training batches (loading data, epoch hooks, checkpointing)"  # after batch k
    EVAL_LOADING = 6, "loading an evaluation batch"  # evaluation after batch k: between evaluation batches
    EVAL_STEP = 7, "in an evaluation step"
    EVAL_EPOCH_END = 8, "in the evaluation epoch-end hooks"  # all evaluation batches done
    EVAL_DONE = 9, "done with evaluation (synchronising metrics)"  # the loop ended: waiting for the others
    TEARDOWN = 10, "in teardown (end-of-run hooks)"  # the loops are over: waiting for the others to finish


_EVAL_HOOKS = {"validate": ("validation_step", "on_validation_epoch_end"), "test": ("test_step", "on_test_epoch_end"),
               "sanity_check": ("validation_step (sanity check)", "on_validation_epoch_end"),
               "predict": ("predict_step", "on_predict_epoch_end")}  # fmt: skip
_EVAL_PHASES = (Phase.EVAL_LOADING, Phase.EVAL_STEP, Phase.EVAL_EPOCH_END)


@dataclass(frozen=True)
class ReplicaStatus:
    """One replica as seen by an observer (the input of :func:`judge`)."""

    rank: int
    host: str = "?"
    pid: int = 0
    batch: int = 0
    phase: Phase = Phase.BETWEEN_BATCHES
    armed: bool = True
    waiting: bool = False
    state: str = "running"
    silent_for: float = 0.0
    stalled_for: float = 0.0
    error: str = ""
    eval_stage: str = ""
    eval_batch: int = -1

    @property
    def position(self) -> tuple[int, int]:
        """Progress through the lock-step schedule: later batches, then later phases, compare greater."""
        return self.batch, int(self.phase)

    def describe(self) -> str:
        """Where the replica is, in words: the phase and the training (or evaluation) batch it concerns."""
        phase, batch, stage, where = self.phase, self.batch, self.eval_stage, f"{self.phase.text} of batch {self.batch}"
        if phase in (Phase.SETUP, Phase.PROFILING, Phase.TEARDOWN):
            where = phase.text
        elif phase in _EVAL_PHASES and stage:
            step, hook = _EVAL_HOOKS.get(stage, (f"{stage} step", "the evaluation epoch-end hooks"))
            if phase == Phase.EVAL_STEP:
                where = f"in {step} of evaluation batch {self.eval_batch}"
            elif phase == Phase.EVAL_EPOCH_END:
                where = f"in {hook}"
            else:
                where = f"loading evaluation batch {self.eval_batch + 1} for {step}"
            where = f"{where} (after training batch {batch})" if batch else where
        return f"rank {self.rank} on {self.host} (pid {self.pid}): {where}"


@dataclass(frozen=True)
class Verdict:
    """Which replica(s) to blame, and the message every replica prints before ending."""

    kind: str  # "hung", "silent", "exited", "failed" or "lost_store"
    culprits: tuple[int, ...]
    seconds: float
    message: str

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> Verdict:
        data = json.loads(text)
        return cls(**{**data, "culprits": tuple(data["culprits"]), "seconds": float(data["seconds"])})


HINTS = {
    "interrupted": "the job was interrupted from outside (Ctrl-C); nothing failed.",
    "hung": "look at what the named replica(s) were doing (a stuck device, a deadlocked data loader, a step that"
    " waits on something outside the job); if they were only slow, raise the strategy's `timeout`.",
    "silent": "check the named replica(s)' host: a crash, an out-of-memory kill or a lost network link.",
    "exited": "the named replica(s)' own output shows why they exited.",
    "failed": "the named replica(s)' traceback shows the cause.",
    "lost_store": "check rank 0's output (it hosts the rendezvous store) and the network between the nodes.",
}


def _ranks(statuses: Sequence[ReplicaStatus]) -> list[int]:
    return sorted(s.rank for s in statuses)


def judge(
    statuses: Sequence[ReplicaStatus],
    timeout: float,
    *,
    silence_timeout: float | None = None,
    suspect_after: float | None = None,
) -> Verdict | None:
    """Decide whether the job must end and whom to blame (pure; the rules are in ``docs/reliability.md``)."""
    silence = timeout if silence_timeout is None else silence_timeout
    suspect = timeout / 2 if suspect_after is None else suspect_after
    for kind in ("interrupted", "failed"):
        ended = [s for s in statuses if s.state == kind]
        if ended:
            detail = "; ".join(f"rank {s.rank} on {s.host} (pid {s.pid}): {s.error or s.state}" for s in ended)
            return Verdict(kind, tuple(_ranks(ended)), 0.0, f"replica(s) {_ranks(ended)} {kind} ({detail})")
    running = [s for s in statuses if s.state == "running"]
    silent = [s for s in running if s.silent_for > silence]
    if silent:
        seconds = max(s.silent_for for s in silent)
        detail = "; ".join(f"{s.describe()} when last heard of" for s in silent)
        message = f"replica(s) {_ranks(silent)} stopped responding for {seconds:.1f} s: no heartbeat, the process"
        return Verdict("silent", tuple(_ranks(silent)), seconds, f"{message} died or froze ({detail})")
    armed = [s for s in running if s.armed]
    if not any(s.stalled_for > timeout for s in armed):
        return None
    seconds = max(s.stalled_for for s in armed)
    waiting = {s.rank for s in running if s.waiting or s.phase == Phase.EVAL_DONE}
    suspects = [s for s in armed if s.stalled_for > suspect and s.rank not in waiting]
    behind = min((s.position for s in suspects), default=None)
    culprits = [s for s in suspects if s.phase in _EVAL_PHASES] or [s for s in suspects if s.position == behind]
    culprits = culprits or [s for s in running if s.rank not in waiting]
    progressing = bool(culprits) and all(s.stalled_for <= suspect for s in culprits)
    if not culprits:  # everyone waits on everyone: report them all
        culprits = armed
    others = [s for s in running if s not in culprits]
    context = "; ".join(s.describe() for s in culprits)
    if others:
        context += "; the others wait: " + "; ".join(s.describe() for s in others)
    seconds = seconds if progressing else max(s.stalled_for for s in culprits)
    text = f"{'kept the other replicas waiting' if progressing else 'stopped responding'} for {seconds:.1f} s"
    return Verdict("hung", tuple(_ranks(culprits)), seconds, f"replica(s) {_ranks(culprits)} {text} ({context})")


_COLLECTIVE_FAILURE_MARKERS = ("gloo", "nccl", "connection closed by peer", "connection reset by peer")


def is_collective_failure(exception: BaseException) -> bool:
    """Whether ``exception`` is a collective that failed because of a peer (timed out, lost connection)."""
    text = str(exception).lower()
    marked = isinstance(exception, RuntimeError) and any(marker in text for marker in _COLLECTIVE_FAILURE_MARKERS)
    return marked or isinstance(exception, dist.DistError)


def first_line(exception: BaseException, limit: int = 300) -> str:
    """``Type: first line`` of ``exception``, about ``limit`` characters at most, keeping its ``HINT:``."""
    text = str(exception).strip().splitlines()
    line = f"{type(exception).__name__}: {text[0] if text else ''}"
    if len(line) <= limit:
        return line
    head, sep, hint = line.partition(" HINT: ")
    if not sep:
        return line[: limit - 1] + "…"
    hint = hint if len(hint) <= limit else hint[: limit - 1] + "…"
    return f"{head[: max(limit // 2, limit - len(hint) - 8)].rstrip()}… HINT: {hint}"


class JobEnded(SystemExit):
    """Raised instead of an exception that only reflects the job ending elsewhere; exits with :attr:`code`."""
