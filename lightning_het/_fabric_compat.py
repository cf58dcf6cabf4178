"""The standalone ``lightning_fabric`` flavour: our Fabric strategy composed with that package's ``DDPStrategy`` by a
plain class statement (see :mod:`lightning_het._flavour`).

``import lightning_het`` imports it when ``lightning_fabric`` is installed, and registers its strategy in that
package's strategy registry; :mod:`lightning_het.pl` is its public import.
"""

from __future__ import annotations

from lightning_fabric.strategies import DDPStrategy
from lightning_fabric.utilities.distributed import DistributedSamplerWrapper

from lightning_het._flavour import FabricFlavour, register_fabric_flavour
from lightning_het.fabric import HeterogeneousFabricStrategyMixin


class HeterogeneousFabricStrategy(HeterogeneousFabricStrategyMixin, DDPStrategy):
    """:class:`lightning_het.HeterogeneousFabricStrategy` on the standalone ``lightning_fabric`` package."""


#: what a ``lightning_fabric`` run uses (:func:`lightning_het._flavour.fabric_flavour`)
FABRIC_FLAVOUR = FabricFlavour(DistributedSamplerWrapper=DistributedSamplerWrapper)
register_fabric_flavour(True, lambda: FABRIC_FLAVOUR)
