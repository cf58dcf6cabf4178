"""``resume="auto"``: this job's checkpoint with the most progress in the run directory (``docs/reliability.md``)."""

from __future__ import annotations

import glob
import hashlib
import os
import re
import zipfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

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
    """This fit's identity: the model's class and shapes, the optimizers' and schedulers' classes and settings."""
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
    """The settings that change the trajectory: comm, gradient accumulation and clipping, precision."""
    settings: dict[str, Any] = {"comm": "exact" if mode in ("allreduce", "hierarchical") else mode}
    if mode == "node_local":
        settings.update({key: config.comm.keywords().get(key) for key in _NODE_LOCAL_SETTINGS})  # objects: by repr
    return {**settings, "accumulate_grad_batches": int(trainer.accumulate_grad_batches),
            "gradient_clip_val": trainer.gradient_clip_val, "gradient_clip_algorithm": trainer.gradient_clip_algorithm,
            "precision": str(trainer.precision)}  # fmt: skip


def identity_differences(saved: Mapping[str, Any] | None, now: Mapping[str, Any]) -> list[str]:
    """What differs between a checkpoint's identity ``saved`` and ``now``: ``"<setting> <saved> -> <now>"`` each."""
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


def checkpoint_candidates(preemption_path: str, dirpaths: Iterable[str | None] = ()) -> list[str]:
    """Every ``*.ckpt`` file of the preemption checkpoint's folder and of ``dirpaths`` (and their ``version_*``)."""
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
) -> tuple[str | None, list[str]]:
    """The checkpoint of this ``job`` with the most progress among ``candidates`` (ties: the latest), and a warning
    for each unreadable file and one for the other jobs' checkpoints passed over."""
    chosen, foreign = None, []
    for candidate in sorted(candidates, key=lambda c: (c.step, c.epoch, c.mtime), reverse=True):
        if candidate.error is not None or candidate.weights_only:  # a weights-only file is not meant to resume
            continue
        differences = identity_differences(candidate.job, job)
        saved_batch = candidate.global_batch_size
        if global_batch_size is not None and saved_batch is not None and saved_batch != global_batch_size:
            differences.append(f"global_batch_size {saved_batch!r} -> {global_batch_size!r}")
        if not differences:
            chosen = candidate
            break
        foreign.append((candidate.path, differences))
    then = f"resuming from {chosen.path}" if chosen else "starting a fresh fit"
    # an unreadable file's progress is unknown: named when it was written after the checkpoint resumed
    unreadable = [c for c in candidates if c.error is not None and (chosen is None or c.mtime >= chosen.mtime)]
    lines = [
        f"resume='auto' skips {c.path}: it cannot be read ({c.error}); {then}. HINT: delete or replace the file"
        " (a full disk or a copy cut short leaves it truncated)"
        for c in sorted(unreadable, key=lambda c: c.mtime, reverse=True)
    ]
    if foreign:
        (path, differences), more = foreign[0], len(foreign) - 1
        others = f" (and {more} more checkpoint(s) of other jobs)" if more else ""
        lines.append(
            f"resume='auto' does not resume {path}{others}: it is another job's checkpoint"
            f" ({'; '.join(differences)}); {then}. HINT: pass `trainer.fit(..., ckpt_path=...)` to resume it"
            " anyway, or give this job its own `default_root_dir`"
        )
    return chosen and chosen.path, lines


def wants_resume(resume: Any, environ: Any = None) -> bool:
    """Whether a fit resumes by itself: ``resume="auto"``, or a restarted elastic worker unless ``resume=False``."""
    restarted = int((os.environ if environ is None else environ).get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
    return resume is not False and (resume == "auto" or restarted)
