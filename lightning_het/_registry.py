"""Registration of the ``"heterogeneous"`` strategy name with Lightning (the package's only import-time side effect)."""

from __future__ import annotations

import importlib.util

__all__ = ["register"]


def register() -> None:
    """Register ``"heterogeneous"`` in ``lightning.pytorch``'s StrategyRegistry, in Lightning Fabric's, and in
    ``pytorch_lightning``'s when that package is installed (the registries and class hierarchies are separate).
    Idempotent."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY as FabricStrategyRegistry
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_het.fabric import HeterogeneousFabricStrategy
    from lightning_het.strategy import HeterogeneousStrategy

    HeterogeneousStrategy.register_strategies(StrategyRegistry)
    HeterogeneousFabricStrategy.register_strategies(FabricStrategyRegistry)
    if importlib.util.find_spec("pytorch_lightning") is not None:
        from pytorch_lightning.strategies import StrategyRegistry as PLStrategyRegistry

        from lightning_het._pl_compat import HeterogeneousStrategy as PLHeterogeneousStrategy

        PLHeterogeneousStrategy.register_strategies(PLStrategyRegistry)
