"""The communication modes, in one place (no torch import: the app's config schema reads them too)."""

from __future__ import annotations

from typing import Literal, get_args

__all__ = ["COMM_CHOICES", "MERGE_WEIGHTS", "OUTER_OPTIMIZERS", "SYNC_DTYPES", "CommChoice", "CommMode"]

#: a resolved mode, what a :class:`~lightning_het.comm.CommController` runs
CommMode = Literal["allreduce", "hierarchical", "node_local"]
#: what users pass as ``comm=``: a mode, or ``"auto"`` (``hierarchical`` on several nodes, else ``allreduce``)
CommChoice = Literal["auto", "allreduce", "hierarchical", "node_local"]
#: accepted values of ``comm``
COMM_CHOICES: tuple[str, ...] = get_args(CommChoice)

#: ``node_local``'s sync: accepted ``sync_dtype``, ``merge_weights`` and named ``outer_optimizer`` values
SYNC_DTYPES = ("float32", "bfloat16", "int8")
MERGE_WEIGHTS = ("samples", "nodes")
OUTER_OPTIMIZERS = ("nesterov",)

assert set(COMM_CHOICES) == {"auto", *get_args(CommMode)}
