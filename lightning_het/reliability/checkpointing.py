"""What a checkpoint records of the split, how a resumed fit uses it, and which checkpoint ``resume="auto"`` picks."""

from __future__ import annotations

import contextlib
import glob
import hashlib
import os
import re
import warnings
import zipfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_het._compat import training_loaders

CHECKPOINT_KEY = "lightning_het"  # the top-level checkpoint key of :func:`checkpoint_record`
_VERSION = 1
_ORDER = ("num_steps", "global_batch_size", "dataset_len", "shuffle", "seed")  # what fixes a sampler's batches


def _sampler_order(sampler: Any) -> dict[str, Any]:
    """What fixes the order of ``sampler``'s (a ``ProportionalDistributedSampler``) global batches."""
    values = (sampler.num_steps, sampler.global_batch_size, len(sampler.dataset), sampler.shuffle, sampler.seed)
    return {key: type_(value) for key, type_, value in zip(_ORDER, (int, int, int, bool, int), values)}


def checkpoint_record(
    trainer: Any,
    batch_sizes: Sequence[int] | None,
    speeds: Sequence[float] | None,
    node_ids: Sequence[int] | None,
    *,
    profiled: bool,
    find_sampler: Callable[[Iterable[Any]], Any],
    comm: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``checkpoint["lightning_het"]`` entry now: the allocation, the sampler position, the comm state."""
    loaders = None if trainer is None else training_loaders(trainer)
    sampler, state = None if loaders is None else find_sampler(loaders), None
    if sampler is not None:
        state = {"epoch": int(sampler.epoch), **_sampler_order(sampler)}
    sizes = [int(b) for b in batch_sizes or []]
    record = {"version": _VERSION, "world_size": len(sizes), "global_batch_size": sum(sizes), "batch_sizes": sizes,
              "speeds": [float(s) for s in speeds or []], "node_ids": [int(n) for n in node_ids or []],
              "profiled": bool(profiled), "sampler": state, "comm": dict(comm) if comm else None}  # fmt: skip
    if trainer is None:
        return record
    loop = trainer.fit_loop
    return at_position(record, loop.epoch_loop.batch_progress.current.processed, loop.epoch_progress.current.processed)


def at_position(record: dict[str, Any], steps_done: int, epochs_done: int) -> dict[str, Any]:
    """``record`` with its sampler's place: ``steps_done`` batches of its epoch trained, ``epochs_done`` epochs ended
    (once the epoch's end-of-epoch bookkeeping ran: saved in ``on_train_epoch_end``, it is finished)."""
    sampler = record.get("sampler")
    if not sampler:
        return record
    place = {"steps_done": int(steps_done), "epoch_finished": epochs_done > sampler["epoch"]}
    return {**record, "sampler": {**sampler, **place}}


def read_record(checkpoint: Mapping[str, Any]) -> dict[str, Any] | None:
    """The entry of a loaded checkpoint, or ``None`` for a checkpoint written without this strategy."""
    record = checkpoint.get(CHECKPOINT_KEY)
    if record is None:
        return None
    version = record.get("version")
    if not isinstance(version, int) or version > _VERSION:
        raise ValueError(
            f"The checkpoint's `{CHECKPOINT_KEY}` entry has version {version!r}, but this lightning-het reads versions"
            f" up to {_VERSION}. HINT: resume with the lightning-het version that wrote it, or delete"
            f" checkpoint[{CHECKPOINT_KEY!r}] to start a fresh allocation."
        )
    return dict(record)


def resumed_global_batch_size(record: Mapping[str, Any] | None) -> int | None:
    """The checkpoint's global batch (``None`` when not resuming), kept unless ``global_batch_size`` is given."""
    if not record:
        return None
    saved = (record.get("sampler") or {}).get("global_batch_size", record.get("global_batch_size"))
    return int(saved) if isinstance(saved, int) and saved > 0 else None


class AllocationPlan(NamedTuple):
    """What a resumed fit uses as speeds, and the log line explaining it ("re-balancing on resume: ..." or not)."""

    speeds: list[float] | None
    message: str | None


def plan_allocation(
    record: Mapping[str, Any] | None, *, world_size: int, given_speeds: Sequence[float] | None
) -> AllocationPlan:
    """Decide the speeds of a resumed fit from the checkpoint's record. Pure."""
    if record is None or not record.get("speeds"):
        return AllocationPlan(None, None)
    saved_world, saved_speeds = int(record["world_size"]), [float(s) for s in record["speeds"]]
    given = None if given_speeds is None else [float(s) for s in given_speeds]
    if given is not None and (saved_world, saved_speeds) == (world_size, given):
        return AllocationPlan(given, "resuming with the checkpoint's allocation (the given speeds match it)")
    trained = f"the checkpoint was trained by {saved_world} replica(s)"
    if given is not None:
        message = f"{trained} with speeds {saved_speeds}, this run has {world_size} replica(s) with the given speeds"
        return AllocationPlan(given, f"re-balancing on resume: {message} {given}")
    if saved_world != world_size:
        message = f"{trained}, this run has {world_size}; profiling the replicas"
        return AllocationPlan(None, f"re-balancing on resume: {message}")
    message = f"resuming with the checkpoint's speeds {saved_speeds} (no re-profiling; pass `speeds=` to re-balance)"
    return AllocationPlan(saved_speeds, message)


def log_resumed_allocation(plan: AllocationPlan, record: Mapping[str, Any] | None, batch_sizes: Sequence[int]) -> None:
    """One INFO line (rank 0) on how the resumed split relates to the checkpoint's."""
    if plan.message is not None and record is not None:
        sizes = f"batch sizes {list(record.get('batch_sizes', []))} -> {list(batch_sizes)}"
        rank_zero_info(f"HeterogeneousStrategy: {plan.message}; {sizes}")


def plan_sampler_resume(saved: Mapping[str, Any] | None, **now: Any) -> tuple[int, int] | None:
    """The epoch a resumed fit's sampler starts and the global batches of it to skip, from the saved position and
    ``now``'s order (``_ORDER``). Pure."""
    if not saved:
        return None
    epoch, done, saved_steps = int(saved["epoch"]), int(saved["steps_done"]), int(saved["num_steps"])
    if done <= 0:
        return (epoch, 0)
    # after the last batch but before the epoch ended (e.g. saved in on_train_batch_end): Lightning's loop counters
    # still sit inside the epoch, so a different number of batches per epoch would cut the next epoch short
    inside = done < saved_steps or not saved.get("epoch_finished", True)
    changed = [f"{k} {saved[k]!r} -> {v!r}" for k, v in now.items() if k != "num_steps" and saved.get(k) != v]
    if inside and changed:
        raise ValueError(
            f"You resumed from a checkpoint taken in the middle of epoch {epoch} ({done} of {saved_steps} global"
            f" batches done, before the epoch ended), but this run draws its global batches in a different order"
            f" ({', '.join(changed)}), so the batches already trained on cannot be skipped. HINT: resume from a"
            " checkpoint taken at the end of an epoch (`ModelCheckpoint(save_on_train_epoch_end=True)`), or keep"
            " `global_batch_size`, the training data and the seed unchanged (the number of replicas and their speeds"
            " may change)."
        )
    if done >= saved_steps or done >= now["num_steps"]:
        return (epoch + 1, 0)
    return (epoch, done)


_QUIET: list[Any] = []  # the warning filters apply_sampler_resume added, removed by end_resume_quiet


def apply_sampler_resume(sampler: Any, record: Mapping[str, Any] | None, epoch: int) -> None:
    """Position a fresh training sampler at ``epoch`` or at the checkpoint's place."""
    plan = None if record is None else plan_sampler_resume(record.get("sampler"), **_sampler_order(sampler))
    if plan is None:
        return sampler.set_epoch(epoch)
    sampler.resume(*plan)
    if plan[1]:
        rank_zero_info(
            f"HeterogeneousStrategy: resuming in the middle of epoch {plan[0]}: the sampler skips the"
            f" {plan[1]} global batch(es) already trained on"
        )
        # Lightning warns that a plain DataLoader cannot resume mid-epoch; ours does: silenced until this fit's
        # teardown (a PossibleUserWarning, whose class each Lightning package has its own of)
        warnings.filterwarnings("ignore", "You're resuming from a checkpoint that ended before", UserWarning)
        _QUIET.append(warnings.filters[0])


def end_resume_quiet() -> None:
    """Remove the filters :func:`apply_sampler_resume` added (at the fit's teardown)."""
    while _QUIET:
        with contextlib.suppress(ValueError):
            warnings.filters.remove(_QUIET.pop())


def with_node_states(record: dict[str, Any], checkpoint: Mapping[str, Any], controller: Any) -> dict[str, Any]:
    """``record`` with every node's inner optimizer state under ``comm["nodes"]`` on rank 0 (a collective)."""
    if controller is None or "optimizer_states" not in checkpoint:
        return record
    nodes = controller.gather_node_states(checkpoint["optimizer_states"])
    if nodes is not None and record.get("comm") is not None:
        record["comm"]["nodes"] = nodes
    return record


def node_optimizer_checkpoint(checkpoint: Mapping[str, Any], controller: Any) -> Mapping[str, Any]:
    """``checkpoint`` with this rank's node's own inner optimizer states (``node_local``, the same node layout)."""
    comm = (checkpoint.get(CHECKPOINT_KEY) or {}).get("comm")
    states = None if controller is None else controller.node_optimizer_states(comm)
    return checkpoint if states is None else {**checkpoint, "optimizer_states": states}


EMERGENCY_CHECKPOINT_NAME = "emergency.ckpt"  # beside the preemption checkpoint (``last.ckpt``)
#: the ``node_local`` settings that change its trajectory
_NODE_LOCAL_SETTINGS = ("outer_optimizer", "global_sync_every", "comm_warmup_steps", "outer_lr", "outer_momentum",
                        "sync_dtype", "merge_weights")  # fmt: skip


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
    identity.update({f"scheduler {index}": type(scheduler).__name__ for index, scheduler in enumerate(schedulers)})
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
    keys = [key for key in dict.fromkeys([*now, *saved]) if saved.get(key, missing) != now.get(key, missing)]
    return [f"{key} {saved.get(key)!r} -> {now.get(key)!r}" for key in keys]


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
        if re.fullmatch(
            r"version_\d+", os.path.basename(parent)
        ):  # lightning_logs/version_N/checkpoints: every version
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
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
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
