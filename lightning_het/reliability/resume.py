"""``resume="auto"``: the checkpoint of this job (its identity) with the most progress in the run directory, and the
emergency checkpoint's retirement once a fit has reached its end (``docs/reliability.md``, "Automatic resume")."""

from __future__ import annotations

import glob
import hashlib
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

EMERGENCY_CHECKPOINT_NAME = "emergency.ckpt"  # beside the preemption checkpoint (``last.ckpt``)
#: the ``node_local`` settings that change its trajectory
_NODE_LOCAL_SETTINGS = ("outer_optimizer", "global_sync_every", "comm_warmup_steps", "outer_lr", "outer_momentum",
                        "sync_dtype", "merge_weights")  # fmt: skip
_VERSION_DIR = re.compile(r"version_\d+")


def _plain(value: Any) -> Any:
    """``value`` as a plain, comparable type (a tensor's number, a tuple's list, anything else's ``repr``)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return [_plain(v) for v in value] if isinstance(value, (list, tuple)) else repr(value)


def job_identity(
    module: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer], schedulers: Sequence[Any], settings: Mapping
) -> dict[str, Any]:
    """This fit's identity: the model's class and state's shapes, each optimizer's class and hyperparameters as
    configured, each scheduler's class and ``settings``; before a checkpoint is loaded into the optimizers."""
    shapes = "\n".join(f"{name}:{tuple(t.shape)}:{t.dtype}" for name, t in module.state_dict().items())
    identity: dict[str, Any] = {"model": f"{type(module).__name__} {hashlib.sha1(shapes.encode()).hexdigest()[:12]}"}
    for index, optimizer in enumerate(optimizers):
        identity[f"optimizer {index}"] = type(optimizer).__name__
        for number, group in enumerate(optimizer.param_groups):
            for key, value in sorted(group.items()):
                if key != "params" and (key != "lr" or "initial_lr" not in group):
                    identity[f"optimizer {index} group {number} {'lr' if key == 'initial_lr' else key}"] = _plain(value)
    for index, scheduler in enumerate(schedulers):
        identity[f"scheduler {index}"] = type(scheduler).__name__
    return {**identity, **{key: _plain(value) for key, value in settings.items()}}


def trajectory_settings(config: Any, mode: str, trainer: Any) -> dict[str, Any]:
    """The settings that change the trajectory (not the replicas, speeds or micro-batching): the comm mode and its
    settings, gradient accumulation and clipping, the precision."""
    settings: dict[str, Any] = {"comm": "exact" if mode in ("allreduce", "hierarchical") else mode}
    if mode == "node_local":
        settings.update({key: config.comm.keywords().get(key) for key in _NODE_LOCAL_SETTINGS})
        outer = settings["outer_optimizer"]
        settings["outer_optimizer"] = outer if outer is None or isinstance(outer, str) else repr(outer)
    return {**settings, "accumulate_grad_batches": int(trainer.accumulate_grad_batches),
            "gradient_clip_val": trainer.gradient_clip_val, "gradient_clip_algorithm": trainer.gradient_clip_algorithm,
            "precision": str(trainer.precision)}  # fmt: skip


def identity_differences(saved: Mapping[str, Any] | None, now: Mapping[str, Any]) -> list[str]:
    """What differs between a checkpoint's identity ``saved`` and this fit's ``now``: ``"<setting> <saved> -> <now>"``
    each (``None``: a checkpoint written without one). Pure."""
    if saved is None:
        return ["no job identity (written by another strategy or an older lightning-het)"]
    missing = object()
    keys = dict.fromkeys([*now, *saved])
    return [
        f"{key} {saved.get(key)!r} -> {now.get(key)!r}"
        for key in keys
        if saved.get(key, missing) != now.get(key, missing)
    ]


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


@dataclass
class ResumeChoice:
    """The checkpoint to resume (``None``: start fresh), and the unreadable files and other jobs' checkpoints (with
    what differs) passed over."""

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
            (path, differences), more = self.foreign[0], len(self.foreign) - 1
            others = f" (and {more} more checkpoint(s) of other jobs)" if more else ""
            lines.append(
                f"resume='auto' does not resume {path}{others}: it is another job's checkpoint"
                f" ({'; '.join(differences)}); {then}. HINT: pass `trainer.fit(..., ckpt_path=...)` to resume it"
                " anyway, or give this job its own `default_root_dir`"
            )
        return lines


def checkpoint_candidates(preemption_path: str, dirpaths: Iterable[str | None] = ()) -> list[str]:
    """Every ``*.ckpt`` file of the preemption checkpoint's folder and of the ``ModelCheckpoint`` folders ``dirpaths``
    (for a logger's ``version_N`` folder: of every version), each once."""
    patterns = []
    for folder in dict.fromkeys(os.path.abspath(f) for f in [os.path.dirname(preemption_path), *dirpaths] if f):
        patterns.append(os.path.join(glob.escape(folder), "*.ckpt"))
        parent = os.path.dirname(folder)
        if _VERSION_DIR.fullmatch(os.path.basename(parent)):  # lightning_logs/version_N/checkpoints: every version
            base = glob.escape(os.path.dirname(parent))
            patterns.append(os.path.join(base, "version_*", glob.escape(os.path.basename(folder)), "*.ckpt"))
    found = [preemption_path] if os.path.isfile(preemption_path) else []
    found += sorted(path for pattern in patterns for path in glob.glob(pattern) if os.path.isfile(path))
    return list({os.path.realpath(p): p for p in reversed(found)}.values())[::-1]  # a link to a file counts once


def read_candidate(path: str) -> Candidate:
    """Read ``path`` (memory-mapped, ``weights_only=True``) for its progress and identity, or why it cannot be read."""
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
        step, epoch = int(checkpoint.get("global_step", -1)), int(checkpoint.get("epoch", -1))
        weights_only = "optimizer_states" not in checkpoint or "loops" not in checkpoint
        return Candidate(
            path, step, epoch, mtime, record.get("job"), resumed_global_batch_size(record), None, weights_only
        )
    except Exception as err:  # truncated, not a checkpoint, unreadable: the next one is tried
        message = f"{type(err).__name__}: {' '.join(str(err).split())[:200]}"
        if os.path.isfile(path) and not zipfile.is_zipfile(path):  # torch.save writes a zip archive
            message = f"not a complete checkpoint archive, truncated?; {message}"
        return Candidate(path, mtime=mtime, error=message)


def choose_checkpoint(
    candidates: Sequence[Candidate], job: Mapping[str, Any], global_batch_size: int | None
) -> ResumeChoice:
    """The checkpoint of this ``job`` with the most progress among ``candidates`` (ties: the latest), past other jobs'
    (``global_batch_size``: the one given to this run) and unreadable ones (named if newer than the choice). Pure."""
    choice, chosen = ResumeChoice(), None
    for candidate in sorted(candidates, key=lambda c: (c.step, c.epoch, c.mtime), reverse=True):
        if candidate.error is not None or candidate.weights_only:  # a weights-only file is not meant to resume
            continue
        differences = identity_differences(candidate.job, job)
        saved_batch = candidate.global_batch_size
        if global_batch_size is not None and saved_batch is not None and saved_batch != global_batch_size:
            differences.append(f"global_batch_size {saved_batch!r} -> {global_batch_size!r}")
        if not differences:
            choice.path, chosen = candidate.path, candidate
            break
        choice.foreign.append((candidate.path, differences))
    # an unreadable file's progress is unknown: named when it was written after the checkpoint resumed
    unreadable = [c for c in candidates if c.error is not None and (chosen is None or c.mtime >= chosen.mtime)]
    choice.unreadable = sorted(unreadable, key=lambda c: c.mtime, reverse=True)
    return choice


def auto_resume(
    trainer: Any, resume: Any, preemption_path: str, job: Mapping, global_batch_size: int | None, broadcast: Callable
) -> list[Candidate]:
    """``resume="auto"`` and no ``ckpt_path`` (every rank, once the optimizers exist): load the checkpoint rank 0's
    :func:`choose_checkpoint` picks; returns this job's emergency checkpoints (for :func:`retire_emergencies`)."""
    if trainer.ckpt_path is not None or not wants_resume(resume):
        return []
    decision: tuple[str | None, list[Candidate]] = (None, [])
    if trainer.global_rank == 0:
        dirpaths = [getattr(callback, "dirpath", None) for callback in trainer.checkpoint_callbacks]
        candidates = [read_candidate(path) for path in checkpoint_candidates(preemption_path, dirpaths)]
        choice = choose_checkpoint(candidates, job, global_batch_size)
        for line in choice.warnings():
            warnings.warn(f"HeterogeneousStrategy: {line}", UserWarning, stacklevel=2)
        emergencies = [c for c in candidates if os.path.basename(c.path) == EMERGENCY_CHECKPOINT_NAME
                       and c.error is None and not identity_differences(c.job, job)]  # fmt: skip
        decision = (choice.path, emergencies)
    path, emergencies = broadcast(decision)
    if path is not None:
        rank_zero_info(f"HeterogeneousStrategy: resume='auto': resuming from {path}")
        restore_checkpoint(trainer, path)
    return emergencies


def retire_emergencies(trainer: Any, emergencies: Sequence[Candidate]) -> None:
    """A fit that reached ``max_steps`` or ``max_epochs`` (every rank): this job's earlier emergency checkpoints now
    hold the finished state, so that running the same command again trains nothing and no stale step is resumed."""
    max_steps, max_epochs, step = trainer.max_steps, trainer.max_epochs, trainer.global_step
    ended = max_steps is not None and 0 <= max_steps <= step
    if not ended and not (max_epochs is not None and 0 <= max_epochs <= trainer.current_epoch):
        return
    for emergency in emergencies:
        if step > emergency.step:
            trainer.save_checkpoint(emergency.path)
            rank_zero_info(
                f"HeterogeneousStrategy: the emergency checkpoint {emergency.path} (global step {emergency.step}) now"
                f" holds the finished fit (global step {step})"
            )


def wants_resume(resume: Any, environ: Any = None) -> bool:
    """Whether a fit resumes by itself: ``resume="auto"``, or a restarted elastic worker unless ``resume=False``."""
    restarted = int((os.environ if environ is None else environ).get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
    return resume is not False and (resume == "auto" or restarted)
