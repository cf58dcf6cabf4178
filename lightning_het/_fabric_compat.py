"""The standalone ``lightning_fabric`` flavour: our Fabric strategy composed with that package's classes by plain class
statements (public import: :mod:`lightning_het.pl`)."""

from __future__ import annotations

from lightning_fabric.strategies import DDPStrategy
from lightning_fabric.utilities.distributed import DistributedSamplerWrapper

from lightning_het._compat import flavour_private
from lightning_het._flavour import FabricFlavour, register_fabric_flavour
from lightning_het.fabric import HeterogeneousFabricStrategyMixin
from lightning_het.reliability.lifecycle import FabricReplicaProcesses


class HeterogeneousFabricScriptLauncher(
    FabricReplicaProcesses,
    flavour_private("lightning_fabric", "strategies.launchers.subprocess_script", "_SubprocessScriptLauncher"),
):
    """``lightning_fabric``'s ``popen`` launcher, plus no orphans."""


class HeterogeneousFabricStrategy(HeterogeneousFabricStrategyMixin, DDPStrategy):
    """:class:`lightning_het.HeterogeneousFabricStrategy` on the standalone ``lightning_fabric`` package."""


FABRIC_FLAVOUR = FabricFlavour(
    DistributedSamplerWrapper=DistributedSamplerWrapper, ScriptLauncher=HeterogeneousFabricScriptLauncher
)
register_fabric_flavour(True, lambda: FABRIC_FLAVOUR)
