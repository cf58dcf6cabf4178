"""The communication modes, in one place (no torch import: the app's config schema reads them too)."""

from __future__ import annotations

from typing import Literal, get_args

__all__ = ["COMM_CHOICES", "CommChoice", "CommMode"]

#: a resolved mode, what a :class:`~lightning_het.comm.CommController` runs
CommMode = Literal["allreduce", "hierarchical", "node_local"]
#: what users pass as ``comm=``: a mode, or ``"auto"`` (``hierarchical`` on several nodes, else ``allreduce``)
CommChoice = Literal["auto", "allreduce", "hierarchical", "node_local"]
#: accepted values of ``comm``
COMM_CHOICES: tuple[str, ...] = get_args(CommChoice)

assert set(COMM_CHOICES) == {"auto", *get_args(CommMode)}
