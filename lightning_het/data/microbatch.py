"""Micro-batches: one replica's share run in pieces of at most its memory cap, with the share's exact gradient."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from itertools import groupby
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor


def micro_batch_sizes(batch_size: int, cap: int | None) -> list[int]:
    """``ceil(batch_size / cap)`` sizes as even as possible, each at most ``cap``.

    >>> micro_batch_sizes(16, 3), micro_batch_sizes(4, 64), micro_batch_sizes(5, None)
    ([3, 3, 3, 3, 2, 2], [4], [5])
    """
    if cap is None or batch_size <= cap:
        return [batch_size]
    count = math.ceil(batch_size / cap)
    base, extra = divmod(batch_size, count)
    return [base + 1] * extra + [base] * (count - extra)


def pieces_label(sizes: Sequence[int]) -> str:
    """``sizes`` as ``size x count`` terms joined by ``+``.

    >>> pieces_label(micro_batch_sizes(16, 3)), pieces_label([9])
    ('3x4+2x2', '9x1')
    """
    return "+".join(f"{n}x{len(list(group))}" for n, group in groupby(sizes))


def batch_length(batch: Any) -> int | None:
    """Samples in ``batch``: the first dimension of its first tensor (``None``: no tensor in it)."""
    if isinstance(batch, Tensor):
        return int(batch.shape[0]) if batch.dim() else None
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    for value in values:
        length = batch_length(value)
        if length is not None:
            return length
    return None


def split_batch(batch: Any, sizes: Sequence[int]) -> list[Any]:
    """``batch`` cut along every tensor's first dimension into pieces of ``sizes`` (other values repeated)."""
    sizes = list(sizes)

    def piece(tensor: Tensor, index: int) -> Tensor:
        return tensor.split(sizes)[index] if tensor.dim() else tensor

    return [apply_to_collection(batch, Tensor, piece, index) for index in range(len(sizes))]


def micro_batches(batch: Any, cap: int) -> list[tuple[Any, float]]:
    """``(piece, n_j / b)`` pieces of at most ``cap``: backward ``loss * weight`` (earlier ones in ``no_sync()``).

    >>> [(p.tolist(), w) for p, w in micro_batches(torch.arange(5), 2)]
    [([0, 1], 0.4), ([2, 3], 0.4), ([4], 0.2)]
    """
    total = batch_length(batch)
    if total is None:
        raise ValueError(f"Expected a batch holding at least one tensor with a first dimension, but got {batch!r}.")
    sizes = micro_batch_sizes(total, max(int(cap), 1))
    return [(piece, n / total) for piece, n in zip(split_batch(batch, sizes), sizes)]


def step_loss(output: Any) -> Tensor:
    """The loss a training step returned (a tensor, or a dict's ``"loss"``)."""
    loss = output.get("loss") if isinstance(output, Mapping) else output
    if not isinstance(loss, Tensor):
        raise RuntimeError(f"With micro-batches, `training_step` must return the loss, but it returned {output!r}.")
    return loss


def take_grads(params: Sequence[Tensor]) -> list[Tensor | None]:
    """``params``' gradients, each ``.grad`` left ``None``."""
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    return grads


class MicroBatcher:
    """One replica's micro-batching: ``cap`` (``None``: whole share), ``min_piece`` and the one fallback after OOM."""

    def __init__(self, rank: int, cap: int | None = None, min_piece: int = 1) -> None:
        self.rank, self.cap, self.min_piece = rank, cap, min_piece
        self.lowered_from: int | None = None  # the cap (or the share) a mid-training OOM lowered, once
        self.pending = False  # the cap changed since the replicas last agreed on it
        self.search_steps = 0  # trial steps the "auto" search took on this replica
        self.search_s = 0.0  # seconds the "auto" search held the first step (the slowest replica's)
        self._grads: list[Tensor | None] | None = None  # the earlier pieces' gradients, held until the last backward
        self.in_earlier_piece = False  # running a piece before the step's last one (or a trial step of the search)
        self.in_log = False  # inside the module's ``self.log`` during a piece

    @property
    def least_cap(self) -> int:
        """The smallest cap that leaves no piece under ``min_piece``."""
        return 2 * self.min_piece - 1

    @contextmanager
    def earlier_piece(self, no_sync: Callable[[], AbstractContextManager[Any]]) -> Iterator[None]:
        """A piece before the step's last (or a trial step): ``no_sync()``, collectives refused."""
        self.in_earlier_piece = True
        try:
            with no_sync():
                yield
        finally:
            self.in_earlier_piece = False

    def lower(self, samples: int, error: BaseException) -> None:
        """A piece of ``samples`` ran out of memory: halve the cap once (not below :attr:`least_cap`), else raise."""
        least = self.least_cap
        if self.lowered_from is not None or samples <= least:
            why = (
                f"lowered from {self.lowered_from} after an earlier out-of-memory error"
                if self.lowered_from is not None
                else f"no smaller micro-batch is possible{' with batch norm layers' if self.min_piece > 1 else ''}"
            )
            raise RuntimeError(
                f"Rank {self.rank} ran out of memory on a micro-batch of {samples} samples with its cap at {self.cap}"
                f" ({why}). HINT: set `max_micro_batch_sizes[{self.rank}]` to at most {max(samples // 2, least)}."
            ) from error
        self.lowered_from = self.cap if self.cap is not None else samples
        self.cap = max(samples // 2, least)
        self.pending = True

    def training_step(
        self,
        step: Callable[..., Any],
        args: Sequence[Any],
        kwargs: dict[str, Any],
        module: Any,
        backward: Callable[[Tensor], None],
        no_sync: Callable[[], AbstractContextManager[Any]],
        measure: Callable[[Callable[[Any], Any], Any], None] | None = None,
    ) -> Any:
        """A Lightning ``training_step(batch, *rest)`` through :meth:`run` (``measure``: the cap's search)."""
        if not args:
            return step(*args, **kwargs)
        if not module.automatic_optimization:  # its own backward: a share over the cap is the user's to split
            samples = batch_length(args[0])
            if self.cap is not None and samples is not None and samples > self.cap:
                raise RuntimeError(
                    f"Rank {self.rank}'s share of {samples} samples exceeds its micro-batch cap {self.cap} under manual"
                    " optimization. HINT: loop over `lightning_het.data.microbatch.micro_batches(batch, cap)`."
                )
            return step(*args, **kwargs)

        def piece_step(piece: Any) -> Any:
            """The step on ``piece``: ``module.log`` without ``batch_size`` weighs the value by the piece's size."""
            log, own, samples = module.log, vars(module).get("log"), batch_length(piece)  # own: a trial's silenced log

            def piece_log(*log_args: Any, batch_size: int | None = None, **log_kwargs: Any) -> Any:
                self.in_log = True
                try:
                    return log(*log_args, batch_size=samples if batch_size is None else batch_size, **log_kwargs)
                finally:
                    self.in_log = False

            module.log = piece_log
            try:
                return step(piece, *args[1:], **kwargs)
            finally:
                if own is None:
                    del module.log
                else:
                    module.log = own

        if measure is not None:  # max_micro_batch_sizes="auto": measured on the first training batch
            measure(piece_step, args[0])
        return self.run(piece_step, args[0], backward, no_sync, list(module.parameters()))

    def run(
        self,
        step: Callable[[Any], Any],
        batch: Any,
        backward: Callable[[Tensor], None],
        no_sync: Callable[[], AbstractContextManager[Any]],
        params: Sequence[Tensor] = (),
    ) -> Any:
        """``step(batch)`` as micro-batches of at most ``cap``; earlier pieces' grads held for :meth:`restore_grads`."""
        total = batch_length(batch)
        if total is None:
            return step(batch)
        if len(micro_batch_sizes(total, self.cap)) == 1:
            try:
                return step(batch)  # the share at once, as without micro-batching
            except torch.OutOfMemoryError as error:
                self.lower(total, error)
            torch.cuda.empty_cache()
        held, done, rest, earlier = take_grads(params), 0, batch, []
        try:
            while True:
                sizes = micro_batch_sizes(total - done, self.cap)
                for n, piece in zip(sizes, split_batch(rest, sizes) if len(sizes) > 1 else [rest]):
                    last = done + n == total
                    try:
                        with nullcontext() if last else self.earlier_piece(no_sync):
                            output = step(piece)
                            if not last:
                                backward(step_loss(output) * (n / total))
                    except torch.OutOfMemoryError as error:
                        self.lower(n, error)
                        break
                    if last and not earlier:
                        return output
                    if last:
                        loss = step_loss(output) * (n / total) + sum(earlier)
                        return {**output, "loss": loss} if isinstance(output, Mapping) else loss
                    earlier.append(step_loss(output).detach() * (n / total))
                    done += n
                torch.cuda.empty_cache()  # after an out-of-memory error: the rest of the share in smaller pieces
                rest = split_batch(batch, [done, total - done])[1] if done else batch
        finally:
            self._grads = take_grads(params)
            for p, g in zip(params, held):
                p.grad = g

    def restore_grads(self, params: Sequence[Tensor]) -> None:
        """Add the held gradients of the step's earlier pieces to ``params``' ``.grad`` (before the last backward)."""
        grads, self._grads = self._grads, None
        for p, g in zip(params, grads or ()):
            if g is not None:
                p.grad = g if p.grad is None else p.grad.add_(g)


def piece_collective(micro: MicroBatcher | None, collective: str) -> bool:
    """Whether ``collective`` must stay local (``self.log(sync_dist=True)`` in an earlier piece); others there raise."""
    if micro is None or not micro.in_earlier_piece:
        return False
    if collective == "reduce" and micro.in_log:
        return True
    raise RuntimeError(
        f"Rank {micro.rank} called `{collective}` in `training_step` in micro-batches of at most {micro.cap} samples,"
        " where replicas run different numbers of pieces. HINT: move it to `on_train_batch_end`."
    )
