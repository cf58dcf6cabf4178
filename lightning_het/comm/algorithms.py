"""The communication algorithms users pass as ``comm=`` (no torch): small frozen value objects that check their own
arguments when built, usable from Python, from a Hydra ``_target_`` node and from LightningCLI's ``class_path``.

The mode names stay as shorthands: ``comm="node_local"`` is ``comm=NodeLocal()``. For now each object maps onto the
strategy's validated settings (:meth:`CommAlgorithm.keywords`); the strategy's communication controller runs it.

>>> NodeLocal(sync_every=16, sync_dtype="int8").keywords()["global_sync_every"]
16
>>> NodeLocal(sync_every=0)
Traceback (most recent call last):
...
lightning_het.arguments.ArgumentError: Expected argument `sync_every` to be an integer >= 1, but got 0.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Literal

from lightning_het.arguments import SYNC_DEFAULTS, ArgumentError, check_sync_args, positive_int

#: the strategy's old flat keyword -> the field of the algorithm object that replaces it
FLAT_FIELDS: dict[str, str] = {
    "global_sync_every": "sync_every",
    "comm_warmup_steps": "warmup_steps",
    "comm_autotune_steps": "autotune_steps",
    "outer_optimizer": "outer",
    "outer_lr": "outer_lr",
    "outer_momentum": "outer_momentum",
    "sync_dtype": "sync_dtype",
    "merge_weights": "merge",
}


class CommAlgorithm:
    """Base of the ``comm=`` objects: a mode name and the settings of that mode (subclasses are frozen dataclasses)."""

    #: the mode it runs (``comm=`` shorthand)
    mode: ClassVar[str] = ""

    def keywords(self) -> dict[str, Any]:
        """The strategy's flat settings this object stands for (``comm`` plus the fields, under their flat names)."""
        by_field = {new: old for old, new in FLAT_FIELDS.items()}
        return {"comm": self.mode} | {by_field[f.name]: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]


@dataclass(frozen=True)
class AllReduce(CommAlgorithm):
    """DDP's flat all-reduce of the share-weighted gradients, every step (exact)."""

    mode: ClassVar[str] = "allreduce"


def _autotune(value: Any) -> int:
    return positive_int("autotune_steps", value, allow_none=False, minimum=0)  # type: ignore[return-value]


@dataclass(frozen=True)
class Hierarchical(CommAlgorithm):
    """Exact two-level reduction: inside each node, then between the nodes' leaders, then back (a flat all-reduce
    when no node holds several replicas). ``autotune_steps``: the first ``2 * n + 1`` steps alternate the hierarchy
    with a flat all-reduce and keep the faster; 0: always the hierarchy."""

    mode: ClassVar[str] = "hierarchical"
    autotune_steps: int = 5

    def __post_init__(self) -> None:
        _autotune(self.autotune_steps)


@dataclass(frozen=True)
class Auto(Hierarchical):
    """``comm="auto"``: :class:`Hierarchical` when the job spans several nodes of several replicas, else
    :class:`AllReduce`."""

    mode: ClassVar[str] = "auto"


@dataclass(frozen=True)
class NodeLocal(CommAlgorithm):
    """Node-local steps (gradients reduced inside each node every step) and a merge of the replicas' models every
    ``sync_every`` optimizer steps (``None``: at the epoch ends). ``warmup_steps``: exact steps first. ``outer``:
    what a sync does with the merged pseudo-gradient: ``None`` (the plain weighted average), ``"nesterov"``
    (DiLoCo's outer step with ``outer_lr`` and ``outer_momentum``) or a callable building a ``torch.optim`` optimizer
    from a list of tensors. ``sync_dtype``: the exchange's dtype (``"float32"``, ``"bfloat16"``, ``"int8"``);
    ``merge``: the replicas' weights in it (``"samples"`` trained since the last sync, or ``"nodes"`` equally)."""

    mode: ClassVar[str] = "node_local"
    sync_every: int | None = None
    warmup_steps: int = 0
    outer: Literal["nesterov"] | Callable[..., Any] | None = SYNC_DEFAULTS["outer_optimizer"]
    outer_lr: float = SYNC_DEFAULTS["outer_lr"]
    outer_momentum: float = SYNC_DEFAULTS["outer_momentum"]
    sync_dtype: Literal["float32", "bfloat16", "int8"] = SYNC_DEFAULTS["sync_dtype"]
    merge: Literal["samples", "nodes"] = SYNC_DEFAULTS["merge_weights"]

    def __post_init__(self) -> None:
        positive_int("sync_every", self.sync_every)
        positive_int("warmup_steps", self.warmup_steps, allow_none=False, minimum=0)
        try:
            check_sync_args(self.outer, self.outer_lr, self.outer_momentum, self.sync_dtype, self.merge)
        except ArgumentError as err:  # the same rule, told with this object's names
            name = FLAT_FIELDS[err.argument]
            message = str(err).replace("outer_optimizer", "outer").replace("merge_weights", "merge")
            raise ArgumentError(name, message) from None


#: ``comm=`` shorthand -> its class
ALGORITHMS: dict[str, type[CommAlgorithm]] = {c.mode: c for c in (Auto, AllReduce, Hierarchical, NodeLocal)}


def algorithm_class(comm: str, given: Collection[str]) -> type[CommAlgorithm]:
    """The class for the mode name ``comm`` whose fields hold ``given``; when that mode reads none of them, the mode
    that does (``"auto"`` with ``sync_every``: :class:`NodeLocal`).

    >>> algorithm_class("auto", ["sync_every"]).__name__
    'NodeLocal'
    """
    candidates = [ALGORITHMS[comm]] if comm in ALGORITHMS else []
    for cls in [*candidates, NodeLocal, Hierarchical]:
        if set(given) <= {f.name for f in fields(cls)}:  # type: ignore[arg-type]
            return cls
    return NodeLocal


def algorithm_for(comm: str, **flat: Any) -> CommAlgorithm:
    """The object for the mode name ``comm`` and the old flat keywords (``global_sync_every=16``, ...), those the
    chosen mode reads.

    >>> algorithm_for("node_local", global_sync_every=16, outer_optimizer="nesterov").outer
    'nesterov'
    """
    given = {FLAT_FIELDS[name]: value for name, value in flat.items()}
    cls = ALGORITHMS[comm]
    names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    return cls(**{k: v for k, v in given.items() if k in names})
