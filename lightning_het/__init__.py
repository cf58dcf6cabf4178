"""lightning-het: data-parallel training on heterogeneous platforms. Importing it registers ``"heterogeneous"`` with
``lightning.pytorch``, ``lightning.fabric`` and, where installed, ``pytorch_lightning`` / ``lightning_fabric``."""

from __future__ import annotations

import importlib
import importlib.util

from lightning_het._version import __version__
from lightning_het.allocation import allocate_batch_sizes
from lightning_het.comm import AllReduce, Auto, CommAlgorithm, Hierarchical, NodeLocal
from lightning_het.config import Profiling, Reliability
from lightning_het.data.datamodule import HeterogeneousDataModule
from lightning_het.data.sampler import ProportionalDistributedSampler, UnpaddedDistributedSampler
from lightning_het.emulation import EmulatedPlatform
from lightning_het.fabric import HeterogeneousFabricStrategy
from lightning_het.sharded import HeterogeneousFSDPStrategy
from lightning_het.strategy import HeterogeneousStrategy

__all__ = [
    "AllReduce",
    "Auto",
    "CommAlgorithm",
    "EmulatedPlatform",
    "HeterogeneousDataModule",
    "HeterogeneousFSDPStrategy",
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


def _register() -> None:
    """``"heterogeneous"`` in the registry of every installed Lightning package (idempotent)."""
    from lightning_het import pl
    from lightning_het._compat import keep_rank_zero_log

    ours = {"lightning.pytorch": HeterogeneousStrategy, "lightning.fabric": HeterogeneousFabricStrategy}
    for name, (_, package, _) in pl.SOURCES.items():
        if importlib.util.find_spec(package) is not None:
            ours[package] = getattr(pl, name)
    for package, cls in ours.items():
        strategies = importlib.import_module(f"{package}.strategies")
        registry = getattr(strategies, "StrategyRegistry", None) or strategies.STRATEGY_REGISTRY  # Trainer's, Fabric's
        if "heterogeneous" not in registry:
            registry.register("heterogeneous", cls, description="Heterogeneous data parallelism")
    strategies = importlib.import_module("lightning.pytorch.strategies")
    if "heterogeneous_fsdp" not in strategies.StrategyRegistry:
        strategies.StrategyRegistry.register("heterogeneous_fsdp", HeterogeneousFSDPStrategy, description="Sharded")
    keep_rank_zero_log()  # each Lightning package points the rank-zero logger at its own when imported: the run's stays


_register()
