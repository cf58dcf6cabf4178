"""lightning-het: Lightning strategy for data-parallel training on heterogeneous platforms.

Importing it imports neither torch nor Lightning; it registers ``strategy="heterogeneous"`` once Lightning is imported,
and the public names load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lightning_het._registry import register_on_import as _register_on_import
from lightning_het._version import __version__

if TYPE_CHECKING:
    from lightning_het.balance.allocation import allocate_batch_sizes
    from lightning_het.comm.algorithms import AllReduce, Auto, CommAlgorithm, Hierarchical, NodeLocal
    from lightning_het.data.datamodule import HeterogeneousDataModule
    from lightning_het.data.sampler import ProportionalDistributedSampler, UnpaddedDistributedSampler
    from lightning_het.emulation import EmulatedPlatform
    from lightning_het.fabric import HeterogeneousFabricStrategy
    from lightning_het.options import Profiling, Reliability
    from lightning_het.strategy import HeterogeneousStrategy

__all__ = [
    "AllReduce",
    "Auto",
    "CommAlgorithm",
    "EmulatedPlatform",
    "HeterogeneousDataModule",
    "HeterogeneousFabricStrategy",
    "HeterogeneousStrategy",
    "Hierarchical",
    "NodeLocal",
    "Profiling",
    "ProportionalDistributedSampler",
    "Reliability",
    "UnpaddedDistributedSampler",
    "__version__",
    "allocate_batch_sizes",
]

#: public name -> module that defines it (imported on first access)
_LAZY = {
    "AllReduce": "lightning_het.comm.algorithms",
    "Auto": "lightning_het.comm.algorithms",
    "CommAlgorithm": "lightning_het.comm.algorithms",
    "EmulatedPlatform": "lightning_het.emulation",
    "Hierarchical": "lightning_het.comm.algorithms",
    "NodeLocal": "lightning_het.comm.algorithms",
    "Profiling": "lightning_het.options",
    "Reliability": "lightning_het.options",
    "HeterogeneousDataModule": "lightning_het.data.datamodule",
    "HeterogeneousFabricStrategy": "lightning_het.fabric",
    "HeterogeneousStrategy": "lightning_het.strategy",
    "ProportionalDistributedSampler": "lightning_het.data.sampler",
    "UnpaddedDistributedSampler": "lightning_het.data.sampler",
    "allocate_batch_sizes": "lightning_het.balance.allocation",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'lightning_het' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


_register_on_import()
