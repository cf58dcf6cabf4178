"""Measured memory caps (``max_micro_batch_sizes="auto"``): the largest micro-batch whose training step fits."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import numpy
import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from lightning_het.data.microbatch import batch_length, step_loss, take_grads

#: the search stops when the sizes that fit and that do not are this close (relative to the first), or 1 apart
SEARCH_RESOLUTION = 0.125
#: fraction of the measured cap kept free on an accelerator (fragmentation, optimizer state allocated later)
SAFETY_MARGIN = 0.1


class EmulatedMemoryCap:
    """Emulation only (``emulate_memory_cap``)."""

    def __init__(self, rank: int, cap: int | None) -> None:
        self.rank = rank
        self.cap = cap
        self._handles: list[RemovableHandle] = []

    def install(self, module: torch.nn.Module) -> None:
        """Check every training forward of ``module`` and of its direct submodules (once installed, on one module)."""
        self.remove()
        for target in (module, *module.children()):
            self._handles.append(target.register_forward_pre_hook(self._check, with_kwargs=True))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _check(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.cap is None or not torch.is_grad_enabled():
            return
        samples = batch_length(args)
        samples = batch_length(kwargs) if samples is None else samples
        if samples is not None and samples > self.cap:
            raise torch.OutOfMemoryError(
                f"emulated: rank {self.rank} cannot hold {samples} samples (emulate_memory_cap {self.cap})"
            )


def cap_search(fits: Callable[[int], bool], start: int, upper: int, lowest: int = 1) -> tuple[int, int]:
    """The largest size in ``[lowest, upper]`` for which ``fits`` (non-increasing in the size) holds, to within one
    search step below, and the number of trials; ``0`` when not even ``lowest`` samples fit (no smaller size is
    tried)."""
    trials = 0

    def trial(n: int) -> bool:
        nonlocal trials
        trials += 1
        return fits(n)

    n = min(max(start, lowest), upper)
    good, bad = (n, None) if trial(n) else (0, n)
    while bad is None and good < upper:  # double until one fails or the bound is reached
        n = min(2 * good, upper)
        good, bad = (n, None) if trial(n) else (good, n)
    while good == 0 and bad is not None and bad > lowest:  # halve until one fits
        n = max(bad // 2, lowest)
        good, bad = (n, bad) if trial(n) else (0, n)
    if bad is None or good == 0:
        return good, trials
    while bad - good > max(1, int(good * SEARCH_RESOLUTION)):
        mid = (good + bad) // 2
        good, bad = (mid, bad) if trial(mid) else (good, mid)
    return good, trials


def resize_batch(batch: Any, size: int) -> Any:
    """``batch`` with ``size`` samples along the first dimension of every tensor (its samples repeated cyclically)."""
    total = batch_length(batch)
    if total is None:
        return batch
    index = torch.arange(size) % total

    def take(value: Any) -> Any:
        if isinstance(value, Tensor) and value.dim():
            return value.index_select(0, index.to(value.device))
        if isinstance(value, dict):
            return type(value)({k: take(v) for k, v in value.items()})  # type: ignore[call-arg]
        if isinstance(value, (list, tuple)):
            items = [take(v) for v in value]
            return type(value)(*items) if isinstance(value, tuple) and type(value) is not tuple else type(value)(items)
        return value

    return take(batch)


@contextmanager
def training_state_kept(module: torch.nn.Module, params: Sequence[Tensor]) -> Iterator[None]:
    """Around trial steps: the gradients, buffers (batch norm statistics) and random state come back as they were, and
    ``module.log`` / ``log_dict`` (a LightningModule's) record nothing."""
    grads = take_grads(params)
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    states = random.getstate(), numpy.random.get_state()
    quiet = [name for name in ("log", "log_dict") if hasattr(module, name)]
    for name in quiet:
        setattr(module, name, lambda *args, **kwargs: None)
    try:
        with torch.random.fork_rng(devices=range(torch.cuda.device_count())):  # torch's states, CPU and CUDA
            yield
    finally:
        for name in quiet:
            delattr(module, name)
        with torch.no_grad():
            for name, b in module.named_buffers():
                if name in buffers:
                    b.copy_(buffers[name])
        random.setstate(states[0])
        numpy.random.set_state(states[1])
        for p, g in zip(params, grads):
            p.grad = g


def measure_cap(
    step: Callable[[Any], Any],
    batch: Any,
    *,
    upper: int,
    no_sync: Callable[[], AbstractContextManager[Any]],
    module: torch.nn.Module,
    accelerator: bool,
    retry: Callable[[], None] | None = None,
    least: int = 1,
) -> tuple[int, int]:
    """This replica's cap."""
    params = [p for p in module.parameters() if p.requires_grad]

    def fits(n: int) -> bool:
        if n < least:
            return False
        try:
            with no_sync():
                step_loss(step(resize_batch(batch, n))).backward()
        except torch.OutOfMemoryError:
            if retry is not None:
                retry()
            return False
        finally:
            for p in params:
                p.grad = None
            if accelerator:
                torch.cuda.empty_cache()
        return True

    with training_state_kept(module, params):
        cap, trials = cap_search(fits, batch_length(batch) or 1, upper, least)
    if cap < least:
        return 0, trials
    return (max(int(cap * (1 - SAFETY_MARGIN)), least) if accelerator else cap), trials


def cached_caps(cap: int | None, gather: Callable[[list[float]], list[list[float]]]) -> list[int] | None:
    """Every replica's cap from the profile cache (``cap``: this replica's entry), when every replica has one."""
    rows = gather([float(cap or 0)])
    return [int(r[0]) for r in rows] if all(r[0] >= 1 for r in rows) else None


def checked_caps(caps: list[int], least: int, source: str) -> list[int]:
    """``caps`` when every replica holds ``least`` samples at once, else the error every replica raises."""
    small = [r for r, c in enumerate(caps) if c < least]
    if small:
        norm = " (the model's batch norm layers need micro-batches of 2 samples or more)" if least > 1 else ""
        raise RuntimeError(
            f"HeterogeneousStrategy: not even a training step of {least} sample(s){norm} fits in the memory"
            f" of rank(s) {small} (micro-batch caps {caps}, {source}). HINT: free memory on that device,"
            " shrink the model, or leave the device out of the job."
        )
    return caps


def lowered_caps(micro: Any, gather: Callable[[list[float]], list[list[float]]], fallback: int) -> list[int] | None:
    """The caps after an out-of-memory error lowered one (one all-gather, on every replica), or ``None``."""
    rows = gather([float(micro.cap or 0), float(micro.pending)])
    if not any(r[1] for r in rows):
        return None
    micro.pending = False
    caps = [int(r[0]) or fallback for r in rows]
    rank_zero_warn(
        f"HeterogeneousStrategy: rank(s) {[r for r, row in enumerate(rows) if row[1]]} ran out of memory; micro-batch"
        f" caps now {caps} (the global batch and the exact gradient are unchanged). HINT: set"
        f" `max_micro_batch_sizes={caps}` for the next run."
    )
    return caps


#: every batch norm layer of torch (they share only a private base class)
_BATCH_NORMS = (
    torch.nn.BatchNorm1d,
    torch.nn.BatchNorm2d,
    torch.nn.BatchNorm3d,
    torch.nn.LazyBatchNorm1d,
    torch.nn.LazyBatchNorm2d,
    torch.nn.LazyBatchNorm3d,
    torch.nn.SyncBatchNorm,
)


def _norm_layers(module: torch.nn.Module | None, synced: bool) -> list[str]:
    """The names of ``module``'s ``SyncBatchNorm`` layers (``synced``), or of its other batch norm layers."""
    modules = module.named_modules() if module is not None else []
    return [n for n, m in modules if isinstance(m, _BATCH_NORMS) and isinstance(m, torch.nn.SyncBatchNorm) == synced]


def _shown(names: list[str]) -> str:
    return ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")


def per_replica_batchnorm(module: torch.nn.Module | None, world_size: int) -> list[str]:
    """The batch norm layers that normalise each replica's batch apart, with a warning (rank 0) naming them."""
    layers = _norm_layers(module, synced=False)
    if layers and world_size > 1:
        rank_zero_warn(
            f"The model has {len(layers)} batch norm layer(s) ({_shown(layers)}) that normalise each"
            " replica's batch separately: with uneven per-replica batches the gradient is no longer exactly the"
            " global-batch gradient, and every replica now gets at least 2 samples per step. HINT: pass"
            " `Trainer(sync_batchnorm=True)` for global batch statistics (not with micro-batching)."
        )
    return layers


def refuse_synced_norm_in_pieces(module: torch.nn.Module | None, world_size: int, micro_batching: bool) -> None:
    """Raise when micro-batching meets ``SyncBatchNorm``: its forward is a collective, and replicas that run their
    shares in different numbers of micro-batches would pair different collectives."""
    synced = _norm_layers(module, synced=True) if micro_batching and world_size > 1 else []
    if synced:
        raise ValueError(
            f"`max_micro_batch_sizes` (or `emulate_memory_cap`) runs a share as several forward passes, but the model's"
            f" SyncBatchNorm layer(s) ({_shown(synced)}) make every training forward a collective that all replicas"
            " must run equally often. HINT: drop `Trainer(sync_batchnorm=True)` (each micro-batch is then normalised by"
            " its own statistics), or bound the shares with `max_batch_sizes` instead."
        )


def refuse_single_sample_pieces(layers: list[str], caps: Any, least: int) -> None:
    """Raise when a micro-batch cap below ``least`` could leave a piece of one sample, which the model's batch norm
    ``layers`` cannot normalise in training (a cap of 2 splits a share of 3 as ``[2, 1]``)."""
    small = [(r, c) for r, c in enumerate(caps if isinstance(caps, list) else []) if c < least]
    if layers and small:
        rank, cap = small[0]
        raise ValueError(
            f"`max_micro_batch_sizes[{rank}]` is {cap}, but the model's batch norm layer(s) ({_shown(layers)}) need at"
            f" least 2 samples per micro-batch in training, and pieces of at most {cap} samples can leave one of 1"
            f" (a share of 3 runs as [2, 1]). HINT: set `max_micro_batch_sizes[{rank}]` to {least} or more, or bound"
            " the share itself with `max_batch_sizes` instead."
        )
