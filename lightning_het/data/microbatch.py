"""Micro-batches: one replica's share of a global batch run in pieces of at most its memory cap (samples).

A share of ``b`` samples runs as ``ceil(b / m)`` pieces split along the first dimension; every piece but the last is
backwarded at once, its loss weighted ``n_j / b``, without gradient communication; the last piece's loss, weighted
the same, is returned (plus the others' weighted losses, detached) for the usual backward, which synchronises the
accumulated gradients. The gradient is the share's, exactly. Under the Trainer the earlier pieces take a cheap path
(:class:`DirectPieces`: the LightningModule's ``training_step`` and a plain backward, past DDP and Lightning's hooks)
where that is safe. A ``torch.OutOfMemoryError`` raised by any piece's step (a whole share run at once included)
lowers the cap once and the rest of the share runs in smaller pieces. See ``docs/balancing.md`` (memory,
micro-batches).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from lightning_het._compat import broadcast_ddp_buffers, ddp_forward_skippable, inside_log_sync, logged_batch


def micro_batch_sizes(batch_size: int, cap: int | None) -> list[int]:
    """``ceil(batch_size / cap)`` sizes as even as possible, each at most ``cap``, summing to ``batch_size``.

    >>> micro_batch_sizes(16, 3), micro_batch_sizes(4, 64), micro_batch_sizes(5, None)
    ([3, 3, 3, 3, 2, 2], [4], [5])
    """
    if cap is None or batch_size <= cap:
        return [batch_size]
    count = math.ceil(batch_size / cap)
    base, extra = divmod(batch_size, count)
    return [base + 1] * extra + [base] * (count - extra)


def pieces_label(sizes: Sequence[int]) -> str:
    """``sizes`` (those of :func:`micro_batch_sizes`) as ``size x count`` terms joined by ``+``.

    >>> pieces_label(micro_batch_sizes(16, 3)), pieces_label([3, 3, 3]), pieces_label([9])
    ('3x4+2x2', '3x3', '9x1')
    """
    terms: list[list[int]] = []
    for n in sizes:
        if terms and terms[-1][0] == n:
            terms[-1][1] += 1
        else:
            terms.append([n, 1])
    return "+".join(f"{n}x{count}" for n, count in terms)


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
    """``batch`` cut along the first dimension of every tensor into pieces of ``sizes`` samples, each piece of the same
    structure (Lightning's ``apply_to_collection``: tuples, named tuples, lists, dicts, dataclasses); scalars and
    other values are repeated in every piece."""
    sizes = list(sizes)

    def piece(tensor: Tensor, index: int) -> Tensor:
        return tensor.split(sizes)[index] if tensor.dim() else tensor

    return [apply_to_collection(batch, Tensor, piece, index) for index in range(len(sizes))]


def micro_batches(batch: Any, cap: int) -> list[tuple[Any, float]]:
    """For a loop of your own (manual optimization, Fabric): ``batch`` as ``(piece, weight)`` pairs of at most
    ``cap`` samples, ``weight = n_j / b``; backward ``loss(piece) * weight`` for each, all but the last under
    ``no_sync()``, and the accumulated gradient is the whole batch's.

    >>> [(p.tolist(), w) for p, w in micro_batches(torch.arange(5), 2)]
    [([0, 1], 0.4), ([2, 3], 0.4), ([4], 0.2)]
    """
    total = batch_length(batch)
    if total is None:
        raise ValueError(f"Expected a batch holding at least one tensor with a first dimension, but got {batch!r}.")
    sizes = micro_batch_sizes(total, max(int(cap), 1))
    return [(piece, n / total) for piece, n in zip(split_batch(batch, sizes), sizes)]


def step_loss(output: Any) -> Tensor:
    """The loss a training step returned (a tensor, or a dict's ``"loss"``); a clear error otherwise."""
    loss = output.get("loss") if isinstance(output, Mapping) else output
    if not isinstance(loss, Tensor):
        raise RuntimeError(
            "HeterogeneousStrategy runs this replica's share as micro-batches (`max_micro_batch_sizes`), so"
            f" `training_step` must return the loss (a tensor, or a dict with 'loss'), but it returned {output!r}."
        )
    return loss


def _with_loss(output: Any, loss: Tensor) -> Any:
    return {**output, "loss": loss} if isinstance(output, Mapping) else loss


class MicroBatcher:
    """One replica's micro-batching: ``cap`` (most samples run at once, ``None``: the whole share), ``min_piece`` (the
    fewest samples a piece may hold: 2 with batch norm layers, which need 2 in training), and the one fallback after
    an out-of-memory error.
    """

    def __init__(self, rank: int, cap: int | None = None, min_piece: int = 1) -> None:
        self.rank = rank
        self.cap = cap
        self.min_piece = min_piece
        self.lowered_from: int | None = None  # the cap (or the share) a mid-training OOM lowered, once
        self.pending = False  # the cap changed since the replicas last agreed on it
        self.search_steps = 0  # trial steps the "auto" search took on this replica
        self.search_s = 0.0  # seconds the "auto" search held the first step (the slowest replica's)
        self._grads: list[Tensor | None] | None = None  # the earlier pieces' gradients, held until the last backward
        self.in_earlier_piece = False  # running a piece before the step's last one (or a trial step of the search)

    @property
    def least_cap(self) -> int:
        """The smallest cap whose even split of any share (of ``min_piece`` samples or more) leaves no piece under
        ``min_piece`` (3 for pieces of at least 2: a cap of 2 splits 3 samples as ``[2, 1]``)."""
        return 2 * self.min_piece - 1

    @contextmanager
    def earlier_piece(self, no_sync: Callable[[], AbstractContextManager[Any]]) -> Iterator[None]:
        """Run a piece before the step's last (or a trial step): ``no_sync()``, and collectives held back or refused
        (:func:`piece_collective`), as the replicas run different numbers of pieces."""
        self.in_earlier_piece = True
        try:
            with no_sync():
                yield
        finally:
            self.in_earlier_piece = False

    def refuse_manual(self, batch: Any) -> None:
        """Manual optimization runs its own backward: a share over the cap is the user's to split."""
        samples = batch_length(batch)
        if self.cap is not None and samples is not None and samples > self.cap:
            raise RuntimeError(
                f"HeterogeneousStrategy: rank {self.rank}'s share of {samples} samples exceeds its micro-batch cap"
                f" {self.cap} (`max_micro_batch_sizes`), which manual optimization cannot split for you. HINT: in"
                " `training_step`, loop over `lightning_het.data.microbatch.micro_batches(batch, cap)` and call"
                " `self.manual_backward(loss * weight)` for each piece (inside `self.trainer.model.no_sync()` for all"
                " but the last), or use automatic optimization."
            )

    def lower(self, samples: int, error: BaseException) -> None:
        """A piece of ``samples`` ran out of memory: halve the cap once (not below :attr:`least_cap`); the second
        time, or when no smaller piece is possible, end with advice."""
        least = self.least_cap
        if self.lowered_from is not None or samples <= least:
            why = (
                f"lowered from {self.lowered_from} after an earlier out-of-memory error"
                if self.lowered_from is not None
                else f"no smaller micro-batch is possible{' with batch norm layers' if self.min_piece > 1 else ''}"
            )
            raise RuntimeError(
                f"HeterogeneousStrategy: rank {self.rank} ran out of memory on a micro-batch of {samples} samples with"
                f" its cap at {self.cap} ({why}). HINT: set `max_micro_batch_sizes[{self.rank}]` to at most"
                f" {max(samples // 2, least)} (or lower `global_batch_size`), or free memory on that device."
            ) from error
        self.lowered_from = self.cap if self.cap is not None else samples
        self.cap = max(samples // 2, least)
        self.pending = True

    @staticmethod
    def _recover(retry: Callable[[], None] | None) -> None:
        """After the handler (the failed piece's activations freed with its traceback): ``retry()``, and the freed
        memory back to the device."""
        if retry is not None:
            retry()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def training_step(
        self,
        step: Callable[..., Any],
        args: Sequence[Any],
        kwargs: dict[str, Any],
        module: Any,
        backward: Callable[[Tensor], None],
        no_sync: Callable[[], AbstractContextManager[Any]],
        measure: Callable[[Callable[[Any], Any], Any], None] | None = None,
        direct: DirectPieces | None = None,
        retry: Callable[[], None] | None = None,
    ) -> Any:
        """A Lightning ``training_step(batch, *rest)`` of ``module`` through :meth:`run`; ``measure(piece_step,
        batch)`` first when the cap is still to be measured. Manual optimization is refused over the cap. With
        ``direct``, the earlier pieces take its cheap path; the last one always goes through ``step``. Each piece
        counts for Lightning's logging as the batch it is (a value logged without ``batch_size`` weighs its size)."""
        if not args:
            return step(*args, **kwargs)
        if not module.automatic_optimization:
            self.refuse_manual(args[0])
            return step(*args, **kwargs)
        rest = args[1:]

        def piece_step(piece: Any) -> Any:
            return step(piece, *rest, **kwargs)

        if measure is not None:  # max_micro_batch_sizes="auto": measured on the first training batch
            measure(piece_step, args[0])
        early = None
        if direct is not None:
            early = (lambda piece: direct.step(piece, *rest, **kwargs)), direct.backward
        params = list(module.parameters())
        return self.run(
            piece_step, args[0], backward, no_sync, params, early, retry=retry, log_as=lambda p: logged_batch(module, p)
        )

    def run(
        self,
        step: Callable[[Any], Any],
        batch: Any,
        backward: Callable[[Tensor], None],
        no_sync: Callable[[], AbstractContextManager[Any]],
        params: Sequence[Tensor] = (),
        early: tuple[Callable[[Any], Any], Callable[[Tensor], None]] | None = None,
        *,
        retry: Callable[[], None] | None = None,
        log_as: Callable[[Any], AbstractContextManager[Any]] | None = None,
    ) -> Any:
        """``step(batch)`` as micro-batches of at most ``cap`` samples (see the module); ``backward(loss)`` backwards
        a piece without synchronising (``no_sync()`` around it); ``early``: another ``(step, backward)`` for every
        piece but the last; ``log_as(piece)``: a context around each piece's step of a split share. A
        ``torch.OutOfMemoryError`` from any piece's step (the whole share's, when it runs at once) lowers the cap once,
        ``retry()`` is called, and the rest of the share runs in smaller pieces: the gradient stays exact.

        The pieces' gradients are held apart from ``params``' ``.grad`` (which the loop zeroes between the step and
        its backward) until :meth:`restore_grads`, which the backward of the returned loss calls first.
        """
        total = batch_length(batch)
        if total is None:
            return step(batch)
        if len(micro_batch_sizes(total, self.cap)) == 1:
            try:
                return step(batch)  # the share at once, as without micro-batching
            except torch.OutOfMemoryError as error:
                self.lower(total, error)
            self._recover(retry)
        held = take_grads(params)
        try:
            return self._pieces((step, backward), early or (step, backward), batch, total, no_sync, retry, log_as)
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

    def _pieces(
        self,
        last_path: tuple[Callable[[Any], Any], Callable[[Tensor], None]],
        early: tuple[Callable[[Any], Any], Callable[[Tensor], None]],
        batch: Any,
        total: int,
        no_sync: Callable[[], AbstractContextManager[Any]],
        retry: Callable[[], None] | None,
        log_as: Callable[[Any], AbstractContextManager[Any]] | None,
    ) -> Any:
        done, rest, earlier = 0, batch, []
        while True:
            sizes = micro_batch_sizes(total - done, self.cap)
            pieces = split_batch(rest, sizes) if len(sizes) > 1 else [rest]
            failed = False
            for n, piece in zip(sizes, pieces):
                last = done + n == total
                step, backward = last_path if last else early
                try:
                    with nullcontext() if last else self.earlier_piece(no_sync):
                        with log_as(piece) if log_as is not None else nullcontext():
                            output = step(piece)
                        if not last:
                            backward(step_loss(output) * (n / total))
                except torch.OutOfMemoryError as error:
                    self.lower(n, error)
                    failed = True
                    break
                if last:
                    if not earlier:
                        return output
                    return _with_loss(output, step_loss(output) * (n / total) + sum(earlier))
                earlier.append(step_loss(output).detach() * (n / total))
                done += n
            if failed:
                self._recover(retry)
                rest = split_batch(batch, [done, total - done])[1] if done else batch


def piece_collective(micro: MicroBatcher | None, collective: str) -> bool:
    """Whether ``collective`` (a strategy's ``reduce`` or ``all_gather``), called now, must stay local: in a piece
    before the step's last, ``self.log(..., sync_dist=True)``'s on-step reduction does (the last piece logs the value
    synchronised; the replicas run different numbers of pieces, so only the last may communicate), and any other
    collective raises ``RuntimeError``. ``False`` outside such pieces."""
    if micro is None or not micro.in_earlier_piece:
        return False
    if collective == "reduce" and inside_log_sync():
        return True
    raise RuntimeError(
        f"HeterogeneousStrategy: rank {micro.rank} called `{collective}` in `training_step` while running its share"
        f" in micro-batches of at most {micro.cap} samples (`max_micro_batch_sizes`): the replicas run different"
        " numbers of micro-batches, so a collective there would pair with another replica's different one. HINT:"
        " move the collective to `on_train_batch_end` (once per step), or log with `self.log(..., sync_dist=True)`,"
        " which synchronises the step's last micro-batch only."
    )


def take_grads(params: Sequence[Tensor]) -> list[Tensor | None]:
    """``params``' gradients, each ``.grad`` left ``None``."""
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    return grads


#: the precision plugins (``<flavour>.plugins.precision.<module>``, class) whose backward is ``loss.backward()``, after
#: the grad scaler's ``scale`` for 16-bit mixed precision: the earlier pieces' cheap path honours them
_PLAIN_PRECISIONS = {
    ("precision", "Precision"),
    ("amp", "MixedPrecision"),
    ("half", "HalfPrecision"),
    ("double", "DoublePrecision"),
}


class DirectPieces:
    """The cheap path of a step's earlier micro-batches: the LightningModule's ``training_step`` under the precision
    plugin's step context, past DDP's forward (its reducer ignores a backward whose forward it did not prepare), and
    ``loss.backward()`` (scaled by the grad scaler under 16-bit mixed precision), past Lightning's backward hooks.
    ``scale()``: the factor Lightning's backward applies to the step's loss, read once, applied to each piece's.
    Built by :meth:`of`, which returns ``None`` where the full path is needed.
    """

    def __init__(self, module: Any, precision: Any, ddp: Any, scale: Callable[[], float]) -> None:
        self.module = module
        self.precision = precision
        self.ddp = ddp  # the DistributedDataParallel wrapper (None: the module is not wrapped)
        self._scale = scale
        self.scale: float | None = None
        self._first = True

    @classmethod
    def of(cls, model: Any, module: Any, precision: Any, scale: Callable[[], float]) -> DirectPieces | None:
        """The cheap path for ``module`` wrapped as ``model``, or ``None``: a precision plugin with a backward of its
        own (not in ``_PLAIN_PRECISIONS``), a module that overrides ``backward``, or a DDP wrapper that has not run
        a forward yet, has a static graph, delays its all-reduce or has a buffer communication hook (or a torch
        without the buffer broadcast this path calls)."""
        kind = type(precision)
        plain = (kind.__module__.rpartition(".")[2], kind.__name__) in _PLAIN_PRECISIONS
        if not plain or getattr(type(module).backward, "__qualname__", "") != "LightningModule.backward":
            return None
        ddp = model if isinstance(model, torch.nn.parallel.DistributedDataParallel) else None
        if ddp is not None and not ddp_forward_skippable(ddp):
            return None
        if ddp is None and model is not module:
            return None  # another wrapper: its forward may matter
        return cls(module, precision, ddp, scale)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """``training_step(*args, **kwargs)`` of the module; before the step's first piece, the buffers are
        broadcast as DDP's forward of that piece would have done (the last piece's forward then does not)."""
        if self._first:
            self._first = False
            ddp = self.ddp
            if ddp is not None:
                broadcast_ddp_buffers(ddp)
        with self.precision.train_step_context():
            return self.module.training_step(*args, **kwargs)

    def backward(self, loss: Tensor) -> None:
        """Backward ``loss`` times ``scale`` (and the grad scaler's scale, if any) into the parameters' ``.grad``."""
        if self.scale is None:
            self.scale = self._scale()
        loss = loss * self.scale if self.scale != 1.0 else loss
        scaler = getattr(self.precision, "scaler", None)
        (scaler.scale(loss) if scaler is not None else loss).backward()
