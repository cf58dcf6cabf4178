"""Registration of the ``"heterogeneous"`` strategy name with Lightning (the package's only import-time side effect)."""

from __future__ import annotations

__all__ = ["register"]


def register() -> None:
    """Register ``"heterogeneous"`` in ``lightning.pytorch``'s StrategyRegistry (idempotent)."""
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_het.strategy import HeterogeneousStrategy

    HeterogeneousStrategy.register_strategies(StrategyRegistry)
