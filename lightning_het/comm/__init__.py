"""Communication modes of lightning-het: flat all-reduce, exact hierarchical reduction, node-local steps."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lightning_het.arguments import COMM_CHOICES, CommChoice, CommMode

if TYPE_CHECKING:
    from lightning_het.comm.allreduce import FlatAllReduce
    from lightning_het.comm.averaging import average_parameters, merge_weights, share_weights
    from lightning_het.comm.compression import Codec
    from lightning_het.comm.controller import CommController, resolve_comm_mode, validate_comm_args
    from lightning_het.comm.hierarchical import Hierarchical
    from lightning_het.comm.hooks import (
        HierarchicalState,
        NodeLocalState,
        hierarchical_hook,
        hierarchical_sum,
        node_local_hook,
    )
    from lightning_het.comm.node_local import NodeLocal
    from lightning_het.comm.outer import OuterStep, ParameterAverage, build_merge
    from lightning_het.comm.stats import CommStats, Traffic

#: public name -> defining module, imported on first access (the mode names, from `arguments`, need no torch)
_LAZY = {
    "FlatAllReduce": "allreduce",
    "Hierarchical": "hierarchical",
    "NodeLocal": "node_local",
    "average_parameters": "averaging",
    "share_weights": "averaging",
    "merge_weights": "averaging",
    "Codec": "compression",
    "OuterStep": "outer",
    "ParameterAverage": "outer",
    "build_merge": "outer",
    "CommController": "controller",
    "resolve_comm_mode": "controller",
    "validate_comm_args": "controller",
    "HierarchicalState": "hooks",
    "NodeLocalState": "hooks",
    "hierarchical_hook": "hooks",
    "hierarchical_sum": "hooks",
    "node_local_hook": "hooks",
    "CommStats": "stats",
    "Traffic": "stats",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f"lightning_het.comm.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'lightning_het.comm' has no attribute {name!r}")


__all__ = [
    "COMM_CHOICES",
    "Codec",
    "CommChoice",
    "CommController",
    "CommMode",
    "CommStats",
    "FlatAllReduce",
    "Hierarchical",
    "HierarchicalState",
    "NodeLocal",
    "NodeLocalState",
    "OuterStep",
    "ParameterAverage",
    "Traffic",
    "average_parameters",
    "build_merge",
    "hierarchical_hook",
    "hierarchical_sum",
    "merge_weights",
    "node_local_hook",
    "resolve_comm_mode",
    "share_weights",
    "validate_comm_args",
]
