"""The standalone ``lightning_fabric`` flavour: our Fabric strategy composed with that package's classes by plain class
statements (public import: :mod:`lightning_het.pl`)."""

from __future__ import annotations

from lightning_fabric.strategies import DDPStrategy
from lightning_fabric.utilities.distributed import DistributedSamplerWrapper

from lightning_het.fabric import HeterogeneousFabricStrategyMixin


class HeterogeneousFabricStrategy(HeterogeneousFabricStrategyMixin, DDPStrategy):
    """:class:`lightning_het.HeterogeneousFabricStrategy` on the standalone ``lightning_fabric`` package."""

    sampler_wrapper = DistributedSamplerWrapper
