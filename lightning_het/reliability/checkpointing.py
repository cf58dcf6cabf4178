"""What a checkpoint records about the heterogeneous split, and how a resumed run uses it."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_het._compat import training_loaders

CHECKPOINT_KEY = "lightning_het"  # the top-level checkpoint key of :func:`checkpoint_record`
_VERSION = 1
_ORDER = ("num_steps", "global_batch_size", "dataset_len", "shuffle", "seed")  # what fixes a sampler's batches
_LIGHTNING_NOT_RESUMABLE = "You're resuming from a checkpoint that ended before the epoch ended"


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
        loop = trainer.fit_loop
        state = {"epoch": int(sampler.epoch), "steps_done": int(loop.epoch_loop.batch_progress.current.processed),
                 **_sampler_order(sampler),  # the epoch's end-of-epoch bookkeeping ran (saved in on_train_epoch_end)
                 "epoch_finished": loop.epoch_progress.current.processed > sampler.epoch}  # fmt: skip
    sizes = [int(b) for b in batch_sizes or []]
    return {"version": _VERSION, "world_size": len(sizes), "global_batch_size": sum(sizes), "batch_sizes": sizes,
            "speeds": [float(s) for s in speeds or []], "node_ids": [int(n) for n in node_ids or []],
            "profiled": bool(profiled), "sampler": state, "comm": dict(comm) if comm else None}  # fmt: skip


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
        warnings.filterwarnings("ignore", message=_LIGHTNING_NOT_RESUMABLE, category=UserWarning)
        _QUIET.append(warnings.filters[0])


def end_resume_quiet() -> None:
    """Remove the filters :func:`apply_sampler_resume` added (at the fit's teardown)."""
    while _QUIET:
        added = _QUIET.pop()
        with contextlib.suppress(ValueError):
            warnings.filters.remove(added)


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
