"""lightning-het: Lightning strategy for data-parallel training on heterogeneous platforms."""

from lightning_het._registry import register as _register
from lightning_het.balance.allocation import allocate_batch_sizes
from lightning_het.datamodule import HeterogeneousDataModule
from lightning_het.fabric import HeterogeneousFabricStrategy
from lightning_het.sampler import ProportionalDistributedSampler, UnpaddedDistributedSampler
from lightning_het.strategy import HeterogeneousStrategy

__version__ = "0.1.0.dev0"

__all__ = [
    "HeterogeneousDataModule",
    "HeterogeneousFabricStrategy",
    "HeterogeneousStrategy",
    "ProportionalDistributedSampler",
    "UnpaddedDistributedSampler",
    "__version__",
    "allocate_batch_sizes",
]

_register()
