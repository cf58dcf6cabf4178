"""What a checkpoint records about the heterogeneous split, and how a resumed run uses it."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_het._compat import training_loaders

#: top-level checkpoint key holding :func:`allocation_record`
CHECKPOINT_KEY = "lightning_het"
_VERSION = 1
_LIGHTNING_NOT_RESUMABLE = "You're resuming from a checkpoint that ended before the epoch ended"


def sampler_record(sampler: Any, steps_done: int) -> dict[str, Any]:
    """Where ``sampler`` (a ``ProportionalDistributedSampler``) stands: its epoch, the global batches of that epoch
    done, and what fixes its order."""
    return {
        "epoch": int(sampler.epoch),
        "steps_done": int(steps_done),
        "num_steps": int(sampler.num_steps),
        "global_batch_size": int(sampler.global_batch_size),
        "dataset_len": len(sampler.dataset),  # type: ignore[arg-type]
        "shuffle": bool(sampler.shuffle),
        "seed": int(sampler.seed),
    }


def allocation_record(
    batch_sizes: Sequence[int] | None,
    speeds: Sequence[float] | None,
    node_ids: Sequence[int] | None,
    *,
    profiled: bool,
    sampler: Mapping[str, Any] | None = None,
    comm: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``checkpoint["lightning_het"]`` entry (plain types, and the comm mode's tensors under ``"comm"``)."""
    sizes = [int(b) for b in batch_sizes or []]
    return {
        "version": _VERSION,
        "world_size": len(sizes),
        "global_batch_size": sum(sizes),
        "batch_sizes": sizes,
        "speeds": [float(s) for s in speeds or []],
        "profiled": bool(profiled),
        "node_ids": [int(n) for n in node_ids or []],
        "sampler": dict(sampler) if sampler is not None else None,
        "comm": dict(comm) if comm else None,
    }


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


@dataclass(frozen=True)
class AllocationPlan:
    """What a resumed fit uses as speeds, and the log line explaining it."""

    speeds: list[float] | None
    message: str | None
    rebalanced: bool


def plan_allocation(
    record: Mapping[str, Any] | None, *, world_size: int, given_speeds: Sequence[float] | None
) -> AllocationPlan:
    """Decide the speeds of a resumed fit from the checkpoint's record. Pure."""
    if record is None or not record.get("speeds"):
        return AllocationPlan(None, None, False)
    saved_world = int(record["world_size"])
    saved_speeds = [float(s) for s in record["speeds"]]
    if given_speeds is not None:
        given = [float(s) for s in given_speeds]
        if saved_world == world_size and given == saved_speeds:
            return AllocationPlan(given, "resuming with the checkpoint's allocation (the given speeds match it)", False)
        message = (
            f"re-balancing on resume: the checkpoint was trained by {saved_world} replica(s) with speeds"
            f" {saved_speeds}, this run has {world_size} replica(s) with the given speeds {given}"
        )
        return AllocationPlan(given, message, True)
    if saved_world != world_size:
        message = f"the checkpoint was trained by {saved_world} replica(s), this run has {world_size}"
        return AllocationPlan(None, f"re-balancing on resume: {message}; profiling the replicas", True)
    message = f"resuming with the checkpoint's speeds {saved_speeds} (no re-profiling; pass `speeds=` to re-balance)"
    return AllocationPlan(saved_speeds, message, False)


@dataclass(frozen=True)
class SamplerResume:
    """Where the training sampler starts: ``epoch`` and the global batches of it to skip."""

    epoch: int
    skip_steps: int


def plan_sampler_resume(
    saved: Mapping[str, Any] | None,
    *,
    num_steps: int,
    global_batch_size: int,
    dataset_len: int,
    shuffle: bool,
    seed: int,
) -> SamplerResume | None:
    """Decide where the sampler of a resumed fit starts. Pure."""
    if not saved:
        return None
    epoch, done, saved_steps = int(saved["epoch"]), int(saved["steps_done"]), int(saved["num_steps"])
    if done <= 0:
        return SamplerResume(epoch, 0)
    # after the last batch but before the epoch ended (e.g. saved in on_train_batch_end): Lightning's loop counters
    # still sit inside the epoch, so a different number of batches per epoch would cut the next epoch short
    inside = done < saved_steps or not saved.get("epoch_finished", True)
    now = {"global_batch_size": global_batch_size, "dataset_len": dataset_len, "shuffle": shuffle, "seed": seed}
    changed = [f"{k} {saved[k]!r} -> {v!r}" for k, v in now.items() if saved.get(k) != v]
    if inside and changed:
        raise ValueError(
            f"You resumed from a checkpoint taken in the middle of epoch {epoch} ({done} of {saved_steps} global"
            f" batches done, before the epoch ended), but this run draws its global batches in a different order"
            f" ({', '.join(changed)}), so the batches already trained on cannot be skipped. HINT: resume from a"
            " checkpoint taken at the end of an epoch (`ModelCheckpoint(save_on_train_epoch_end=True)`), or keep"
            " `global_batch_size`, the training data and the seed unchanged (the number of replicas and their speeds"
            " may change)."
        )
    if done >= saved_steps or done >= num_steps:
        return SamplerResume(epoch + 1, 0)
    return SamplerResume(epoch, done)


def apply_sampler_resume(sampler: Any, record: Mapping[str, Any] | None, epoch: int) -> SamplerResume | None:
    """Position a fresh training sampler at ``epoch`` or at the checkpoint's place; return the resume plan."""
    plan = None
    if record is not None:
        now = sampler_record(sampler, steps_done=0)
        keys = ("num_steps", "global_batch_size", "dataset_len", "shuffle", "seed")
        plan = plan_sampler_resume(record.get("sampler"), **{key: now[key] for key in keys})
    if plan is None:
        sampler.set_epoch(epoch)
        return None
    sampler.resume(plan.epoch, plan.skip_steps)
    if plan.skip_steps:
        rank_zero_info(
            f"HeterogeneousStrategy: resuming in the middle of epoch {plan.epoch}: the sampler skips the"
            f" {plan.skip_steps} global batch(es) already trained on"
        )
        # Lightning warns that a plain DataLoader cannot resume mid-epoch; ours does, so that warning is wrong here:
        # silenced until this fit's teardown (end_resume_quiet), not for the later Trainers of the process; a
        # PossibleUserWarning, whose class each Lightning package has its own of
        warnings.filterwarnings("ignore", message=_LIGHTNING_NOT_RESUMABLE, category=UserWarning)
        _QUIET.append(warnings.filters[0])
    return plan


_QUIET: list[Any] = []  # the warning filters apply_sampler_resume added, removed by end_resume_quiet


def end_resume_quiet() -> None:
    """Remove the filter :func:`apply_sampler_resume` added for Lightning's "not resumable" warning (at the fit's
    teardown; nothing when none was added or a ``warnings.catch_warnings`` block has removed it already)."""
    while _QUIET:
        added = _QUIET.pop()
        for index, entry in enumerate(warnings.filters):
            if entry is added:
                del warnings.filters[index]
                break


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
    """The ``checkpoint["lightning_het"]`` entry now: allocation, training sampler position and comm state
    (``speeds`` is ``None`` while the first steps still profile)."""
    sampler_state = None
    if trainer is not None:
        loaders = training_loaders(trainer)
        sampler = find_sampler(loaders) if loaders is not None else None
        if sampler is not None:
            done = trainer.fit_loop.epoch_loop.batch_progress.current.processed
            sampler_state = sampler_record(sampler, done)
            # the epoch's end-of-epoch bookkeeping already ran (saved in on_train_epoch_end or later)
            sampler_state["epoch_finished"] = trainer.fit_loop.epoch_progress.current.processed > sampler.epoch
    return allocation_record(batch_sizes, speeds, node_ids, profiled=profiled, sampler=sampler_state, comm=comm)


def log_resumed_allocation(plan: AllocationPlan, record: Mapping[str, Any] | None, batch_sizes: Sequence[int]) -> None:
    """One INFO line (rank 0) on how the resumed split relates to the checkpoint's."""
    if plan.message is None or record is None:
        return
    rank_zero_info(
        f"HeterogeneousStrategy: {plan.message}; batch sizes {list(record.get('batch_sizes', []))} ->"
        f" {list(batch_sizes)}"
    )


def with_node_states(record: dict[str, Any], checkpoint: Mapping[str, Any], controller: Any) -> dict[str, Any]:
    """``record`` with every node's inner optimizer state and residual under ``comm["nodes"]`` on rank 0
    (``node_local``; a collective, called where every rank saves)."""
    if controller is None or "optimizer_states" not in checkpoint:
        return record
    nodes = controller.gather_node_states(checkpoint["optimizer_states"])
    if nodes is not None and record.get("comm") is not None:
        record["comm"]["nodes"] = nodes
    return record


def node_optimizer_checkpoint(checkpoint: Mapping[str, Any], controller: Any) -> Mapping[str, Any]:
    """``checkpoint`` with, in ``comm="node_local"`` with the node layout it was saved with, this rank's node's own
    inner optimizer states; as it is otherwise (every node then resumes rank 0's)."""
    comm = (checkpoint.get(CHECKPOINT_KEY) or {}).get("comm")
    states = None if controller is None else controller.node_optimizer_states(comm)
    return checkpoint if states is None else {**checkpoint, "optimizer_states": states}
