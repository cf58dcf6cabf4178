"""The Fabric strategy for the standalone ``lightning_fabric`` package, whose classes and registry are separate.

Only imported when ``lightning_fabric`` is installed; ``import lightning_het`` registers this class in
``lightning_fabric``'s strategy registry so that ``lightning_fabric.Fabric(strategy="heterogeneous")`` works too.
"""

from __future__ import annotations

from lightning_fabric.strategies import DDPStrategy as _LFDDPStrategy

from lightning_het.fabric import HeterogeneousFabricStrategyBase

__all__ = ["HeterogeneousFabricStrategy"]


class HeterogeneousFabricStrategy(HeterogeneousFabricStrategyBase, _LFDDPStrategy):
    __doc__ = HeterogeneousFabricStrategyBase.__doc__
    _fabric_ddp_cls = _LFDDPStrategy
