"""The ``comm=`` algorithms (docs/communication.md), their mode-name shorthands and the old flat keywords they replace.

>>> algorithm_for("node_local", global_sync_every=16, outer_optimizer="nesterov").outer
'nesterov'
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import fields
from typing import Any

from lightning_het.comm.allreduce import FLAT_FIELDS, AllReduce, CommAlgorithm
from lightning_het.comm.hierarchical import Auto, Hierarchical
from lightning_het.comm.node_local import NodeLocal

#: ``comm=`` shorthand -> its class
ALGORITHMS: dict[str, type[CommAlgorithm]] = {c.mode: c for c in (Auto, AllReduce, Hierarchical, NodeLocal)}


def algorithm_class(comm: str, given: Collection[str]) -> type[CommAlgorithm]:
    """The class for the mode name ``comm`` whose fields hold ``given``, else the mode that reads them.

    >>> algorithm_class("auto", ["sync_every"]).__name__
    'NodeLocal'
    """
    for cls in (ALGORITHMS.get(comm, NodeLocal), NodeLocal, Hierarchical):
        if set(given) <= {f.name for f in fields(cls)}:  # type: ignore[arg-type]
            return cls
    return NodeLocal


def algorithm_for(comm: str, **flat: Any) -> CommAlgorithm:
    """The object for the mode name ``comm`` from the old flat keywords (those the mode reads)."""
    cls = ALGORITHMS[comm]
    names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    return cls(**{FLAT_FIELDS[k]: v for k, v in flat.items() if FLAT_FIELDS[k] in names})
