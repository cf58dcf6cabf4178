"""The Fabric strategy on the standalone ``lightning_fabric`` package (whose classes and registry are separate):
:mod:`lightning_het.fabric`'s code run on that package (see :func:`lightning_het._compat.mirror_module`).

Only imported when ``lightning_fabric`` is installed; ``import lightning_het`` registers the class in its strategy
registry, and :mod:`lightning_het.pl` is its public import.
"""

from __future__ import annotations

from lightning_het._compat import mirror_module

_DOC = __doc__
_PACKAGES = {"lightning.fabric": "lightning_fabric"}
HeterogeneousFabricStrategy: type = mirror_module("lightning_het.fabric", __name__, _PACKAGES)[
    "HeterogeneousFabricStrategy"
]
__doc__ = _DOC
__all__ = ["HeterogeneousFabricStrategy"]
