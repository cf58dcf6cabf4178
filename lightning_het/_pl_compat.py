"""The Trainer strategy on the standalone ``pytorch_lightning`` package (whose classes and registry are separate):
:mod:`lightning_het.strategy`'s code run on that package (see :func:`lightning_het._compat.mirror_module`).

Only imported when ``pytorch_lightning`` is installed; ``import lightning_het`` registers the class in its
StrategyRegistry, and :mod:`lightning_het.pl` is its public import.
"""

from __future__ import annotations

from lightning_het._compat import flavour_private, mirror_module
from lightning_het.reliability.launcher import AllocationResultsMixin

_DOC = __doc__
_PACKAGES = {"lightning.pytorch": "pytorch_lightning", "lightning.fabric": "lightning_fabric"}
HeterogeneousStrategy: type = mirror_module("lightning_het.strategy", __name__, _PACKAGES)["HeterogeneousStrategy"]
__doc__ = _DOC
__all__ = ["HeterogeneousStrategy"]


class _PLHeterogeneousMultiProcessingLauncher(
    AllocationResultsMixin,
    flavour_private("pytorch_lightning", "strategies.launchers.multiprocessing", "_MultiProcessingLauncher"),
):
    pass


HeterogeneousStrategy.spawn_launcher_cls = _PLHeterogeneousMultiProcessingLauncher  # type: ignore[attr-defined]
