"""``resume="auto"``: which checkpoint of the run directory a fit continues from, and the emergency checkpoint's
retirement once training has moved past it.

Rank 0 reads every checkpoint of the run directory (:func:`checkpoint_candidates`), orders them by the training
progress recorded inside (global step, epoch, then modification time), and takes the first that is readable and of
this job (:func:`~lightning_het.reliability.identity.job_identity`); the other ranks receive its choice. See
``docs/reliability.md``, "Automatic resume".
"""

from __future__ import annotations

import glob
import os
import re
import warnings
import zipfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_het._compat import restore_checkpoint
from lightning_het.reliability.checkpointing import CHECKPOINT_KEY, resumed_global_batch_size
from lightning_het.reliability.emergency import EMERGENCY_CHECKPOINT_NAME, wants_resume
from lightning_het.reliability.identity import identity_differences

_VERSION_DIR = re.compile(r"version_\d+")


@dataclass(frozen=True)
class Candidate:
    """One checkpoint file as :func:`read_candidate` found it: its progress and identity, or why it cannot be read."""

    path: str
    step: int = -1
    epoch: int = -1
    mtime: float = 0.0
    job: Mapping[str, Any] | None = None
    global_batch_size: int | None = None
    error: str | None = None  # unreadable: the error's type and message
    weights_only: bool = False  # no training state (``ModelCheckpoint(save_weights_only=True)``): not resumable

    @property
    def progress(self) -> tuple[int, int, float]:
        return (self.step, self.epoch, self.mtime)


@dataclass
class ResumeChoice:
    """What :func:`choose_checkpoint` decided: the checkpoint to resume (``None``: start fresh), the unreadable files
    and the other jobs' checkpoints (with what differs) it passed over, in the order it considered them."""

    path: str | None = None
    unreadable: list[Candidate] = field(default_factory=list)
    foreign: list[tuple[str, list[str]]] = field(default_factory=list)

    def warnings(self) -> list[str]:
        """One line per unreadable file and one for the other jobs' checkpoints passed over."""
        then = f"resuming from {self.path}" if self.path else "starting a fresh fit"
        lines = [
            f"resume='auto' skips {c.path}: it cannot be read ({c.error}); {then}. HINT: delete or replace the file"
            " (a full disk or a copy cut short leaves it truncated)"
            for c in self.unreadable
        ]
        if self.foreign:
            path, differences = self.foreign[0]
            more = f" (and {len(self.foreign) - 1} more checkpoint(s) of other jobs)" if len(self.foreign) > 1 else ""
            differ = "; ".join(differences)
            lines.append(
                f"resume='auto' does not resume {path}{more}: it is another job's checkpoint ({differ}); {then}."
                f" HINT: pass `trainer.fit(..., ckpt_path=...)` to resume it anyway, or give this job its own"
                " `default_root_dir`"
            )
        return lines


def checkpoint_candidates(preemption_path: str, dirpaths: Iterable[str | None] = ()) -> list[str]:
    """Every checkpoint file ``resume="auto"`` considers: the ``*.ckpt`` files of the preemption checkpoint's folder
    (``emergency.ckpt``, ``last.ckpt``, the preemption checkpoint) and of every ``ModelCheckpoint`` folder
    ``dirpaths`` (for a logger's ``version_N`` folder, those of every version), on the local filesystem; each once."""
    folders = [os.path.dirname(preemption_path), *(d for d in dirpaths if d)]
    patterns = []
    for folder in dict.fromkeys(os.path.abspath(f) for f in folders):
        patterns.append(os.path.join(glob.escape(folder), "*.ckpt"))
        parent = os.path.dirname(folder)
        if _VERSION_DIR.fullmatch(os.path.basename(parent)):  # lightning_logs/version_N/checkpoints: every version
            base = glob.escape(os.path.dirname(parent))
            patterns.append(os.path.join(base, "version_*", glob.escape(os.path.basename(folder)), "*.ckpt"))
    found = [preemption_path] if os.path.isfile(preemption_path) else []
    found += sorted(path for pattern in patterns for path in glob.glob(pattern) if os.path.isfile(path))
    return list({os.path.realpath(p): p for p in reversed(found)}.values())[::-1]  # a link to a file counts once


def read_candidate(path: str) -> Candidate:
    """Read ``path`` (memory-mapped, as Lightning loads checkpoints: ``weights_only=True``) for its progress and
    identity; an unreadable file gives a :class:`Candidate` with ``error``."""
    mtime = 0.0
    try:
        mtime = os.path.getmtime(path)
        try:
            checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as err:
            if "mmap" not in str(err):  # not a zip file (the legacy format) cannot be mapped
                raise
            checkpoint = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(checkpoint, Mapping):
            raise ValueError(f"holds a {type(checkpoint).__name__}, not a checkpoint")
        record = checkpoint.get(CHECKPOINT_KEY) or {}
        return Candidate(
            path,
            int(checkpoint.get("global_step", -1)),
            int(checkpoint.get("epoch", -1)),
            mtime,
            record.get("job"),
            resumed_global_batch_size(record) if record else None,
            weights_only="optimizer_states" not in checkpoint or "loops" not in checkpoint,
        )
    except Exception as err:  # truncated, not a checkpoint, unreadable: the next one is tried
        message = f"{type(err).__name__}: {' '.join(str(err).split())[:200]}"
        if os.path.isfile(path) and not zipfile.is_zipfile(path):  # torch.save writes a zip archive
            message = f"not a complete checkpoint archive, truncated?; {message}"
        return Candidate(path, mtime=mtime, error=message)


def choose_checkpoint(
    candidates: Sequence[Candidate], job: Mapping[str, Any], global_batch_size: int | None
) -> ResumeChoice:
    """The checkpoint of this ``job`` with the most training progress among ``candidates`` (ties: the most recently
    written), past other jobs' (``global_batch_size``: the one given to this run, else the checkpoint's is kept) and
    the unreadable ones (named when written after the chosen one). Pure."""
    choice, chosen = ResumeChoice(), None
    for candidate in sorted(candidates, key=lambda c: c.progress, reverse=True):
        if candidate.error is not None or candidate.weights_only:  # a weights-only file is not meant to resume
            continue
        differences = identity_differences(candidate.job, job)
        saved_batch = candidate.global_batch_size
        if global_batch_size is not None and saved_batch is not None and saved_batch != global_batch_size:
            differences.append(f"global_batch_size {saved_batch!r} -> {global_batch_size!r}")
        if differences:
            choice.foreign.append((candidate.path, differences))
            continue
        choice.path, chosen = candidate.path, candidate
        break
    # an unreadable file's progress is unknown: named when it was written after the checkpoint resumed
    unreadable = [c for c in candidates if c.error is not None and (chosen is None or c.mtime >= chosen.mtime)]
    choice.unreadable = sorted(unreadable, key=lambda c: c.mtime, reverse=True)
    return choice


def auto_resume(
    trainer: Any,
    resume: Any,
    preemption_path: str,
    job: Mapping[str, Any],
    global_batch_size: int | None,
    broadcast: Callable[[Any], Any],
) -> list[Candidate]:
    """``resume="auto"`` (or a restarted elastic worker) and no ``ckpt_path``: load into ``trainer`` the checkpoint
    :func:`choose_checkpoint` picks on rank 0 (``broadcast``: rank 0's object on every rank), after the strategy's
    setup created the optimizers and before Lightning restores the training state. Every rank calls it; returns this
    job's emergency checkpoints (for :func:`retire_emergencies`; empty when nothing was considered)."""
    if trainer.ckpt_path is not None or not wants_resume(resume):
        return []
    decision: tuple[str | None, list[Candidate]] = (None, [])
    if trainer.global_rank == 0:
        dirpaths = [getattr(callback, "dirpath", None) for callback in trainer.checkpoint_callbacks]
        candidates = [read_candidate(path) for path in checkpoint_candidates(preemption_path, dirpaths)]
        choice = choose_checkpoint(candidates, job, global_batch_size)
        for line in choice.warnings():
            warnings.warn(f"HeterogeneousStrategy: {line}", UserWarning, stacklevel=2)
        decision = (choice.path, stale_emergencies(candidates, job))
    path, emergencies = broadcast(decision)
    if path is not None:
        rank_zero_info(f"HeterogeneousStrategy: resume='auto': resuming from {path}")
        restore_checkpoint(trainer, path)
    return emergencies


def stale_emergencies(candidates: Sequence[Candidate], job: Mapping[str, Any]) -> list[Candidate]:
    """The emergency checkpoints among ``candidates`` that are this job's."""
    return [
        c
        for c in candidates
        if os.path.basename(c.path) == EMERGENCY_CHECKPOINT_NAME
        and c.error is None
        and not identity_differences(c.job, job)
    ]


def fit_reached_its_end(trainer: Any) -> bool:
    """Whether the fit stopped at ``max_steps`` or ``max_epochs`` (not early, not interrupted)."""
    max_steps, max_epochs = trainer.max_steps, trainer.max_epochs
    if max_steps is not None and max_steps >= 0 and trainer.global_step >= max_steps:
        return True
    return max_epochs is not None and max_epochs >= 0 and trainer.current_epoch >= max_epochs


def retire_emergencies(trainer: Any, emergencies: Sequence[Candidate]) -> None:
    """At the end of a fit that reached its end: replace this job's earlier emergency checkpoints with the finished
    state (every rank calls it: ``trainer.save_checkpoint`` saves atomically on rank 0), so that running the same
    command again resumes to the end and trains nothing, and no stale step is resumed."""
    if not fit_reached_its_end(trainer):
        return
    for emergency in emergencies:
        if trainer.global_step <= emergency.step:
            continue
        trainer.save_checkpoint(emergency.path)
        rank_zero_info(
            f"HeterogeneousStrategy: the emergency checkpoint {emergency.path} (global step {emergency.step}) now"
            f" holds the finished fit (global step {trainer.global_step})"
        )
