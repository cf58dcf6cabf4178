"""Measured memory caps (``max_micro_batch_sizes="auto"``): the largest micro-batch whose training step fits."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy
import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_het.data.microbatch import batch_length, step_loss, take_grads

#: the search stops when the sizes that fit and that do not are this close (relative to the first), or 1 apart
SEARCH_RESOLUTION = 0.125
#: fraction of the measured cap kept free on an accelerator (fragmentation, optimizer state allocated later)
SAFETY_MARGIN = 0.1


class EmulatedMemoryCap:
    """Emulation (``emulate_memory_cap``): a training forward over ``cap`` samples raises ``torch.OutOfMemoryError``."""

    def __init__(self, rank: int, cap: int) -> None:
        self.rank, self.cap = rank, cap
        self._handles: list[RemovableHandle] = []

    def install(self, module: torch.nn.Module | None) -> None:
        """Check every training forward of ``module`` and of its direct submodules (``None``: none any more)."""
        for handle in self._handles:
            handle.remove()
        targets = () if module is None else (module, *module.children())
        self._handles = [m.register_forward_pre_hook(self._check, with_kwargs=True) for m in targets]

    def _check(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        samples = batch_length((args, kwargs))
        if torch.is_grad_enabled() and samples is not None and samples > self.cap:
            raise torch.OutOfMemoryError(
                f"emulated: rank {self.rank} cannot hold {samples} samples (emulate_memory_cap {self.cap})"
            )


def cap_search(fits: Callable[[int], bool], start: int, upper: int, lowest: int = 1) -> tuple[int, int]:
    """The largest size in ``[lowest, upper]`` where ``fits`` (non-increasing) holds, to within one search step below,
    and the number of trials; ``0`` when not even ``lowest`` samples fit (no smaller size is tried)."""
    tried: list[int] = []
    trial = lambda n: tried.append(n) or fits(n)  # noqa: E731
    n = min(max(start, lowest), upper)
    good, bad = (n, None) if trial(n) else (0, n)
    while bad is None and good < upper:  # double until one fails or the bound is reached
        n = min(2 * good, upper)
        good, bad = (n, None) if trial(n) else (good, n)
    while good == 0 and bad is not None and bad > lowest:  # halve until one fits
        n = max(bad // 2, lowest)
        good, bad = (n, bad) if trial(n) else (0, n)
    while bad is not None and good and bad - good > max(1, int(good * SEARCH_RESOLUTION)):
        mid = (good + bad) // 2
        good, bad = (mid, bad) if trial(mid) else (good, mid)
    return good, len(tried)


def resize_batch(batch: Any, size: int) -> Any:
    """``batch`` with ``size`` samples along the first dimension of every tensor (its samples repeated cyclically)."""
    total = batch_length(batch)
    if total is None:
        return batch
    index = torch.arange(size) % total
    return apply_to_collection(batch, Tensor, lambda t: t.index_select(0, index.to(t.device)) if t.dim() else t)


def measure_cap(
    step: Callable, batch: Any, upper: int, no_sync: Callable, module: nn.Module, accelerator: bool, least: int = 1
) -> tuple[int, int]:
    """This replica's cap (``0``: not even ``least`` samples fit) and the trial steps it took. The gradients, buffers
    (batch norm statistics) and random states come back as they were, and ``module.log`` records nothing."""
    params = [p for p in module.parameters() if p.requires_grad]

    def fits(n: int) -> bool:  # (never below `least`: a trial step batch norm cannot train)
        try:
            with no_sync():
                step_loss(step(resize_batch(batch, n))).backward()
        except torch.OutOfMemoryError:
            return False
        finally:
            take_grads(params)  # the trial's gradients dropped
            if accelerator:
                torch.cuda.empty_cache()
        return True

    grads, states = take_grads(params), (random.getstate(), numpy.random.get_state())
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    quiet = [name for name in ("log", "log_dict") if hasattr(module, name)]
    for name in quiet:
        setattr(module, name, lambda *args, **kwargs: None)
    try:
        with torch.random.fork_rng(devices=range(torch.cuda.device_count())):  # torch's states, CPU and CUDA
            cap, trials = cap_search(fits, batch_length(batch) or 1, upper, least)
    finally:
        for name in quiet:
            delattr(module, name)
        with torch.no_grad():
            for name, b in module.named_buffers():
                b.copy_(buffers.get(name, b))
        random.setstate(states[0])
        numpy.random.set_state(states[1])
        for p, g in zip(params, grads):
            p.grad = g
    return (max(int(cap * (1 - SAFETY_MARGIN)), least) if accelerator and cap else cap), trials
