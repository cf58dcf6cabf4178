"""The same strategy for the standalone ``pytorch_lightning`` package, whose classes and registry are separate.

Only imported when ``pytorch_lightning`` is installed; ``import lightning_het`` registers this class in
``pytorch_lightning``'s StrategyRegistry so that ``pytorch_lightning.Trainer(strategy="heterogeneous")`` works too.
"""

from __future__ import annotations

from pytorch_lightning.strategies import DDPStrategy as _PLDDPStrategy

from lightning_het._compat import flavour_private
from lightning_het.reliability.launcher import AllocationResultsMixin
from lightning_het.strategy import HeterogeneousStrategyBase

_PLMultiProcessingLauncher = flavour_private(
    "pytorch_lightning", "strategies.launchers.multiprocessing", "_MultiProcessingLauncher"
)

__all__ = ["HeterogeneousStrategy"]


class _PLHeterogeneousMultiProcessingLauncher(AllocationResultsMixin, _PLMultiProcessingLauncher):
    pass


class HeterogeneousStrategy(HeterogeneousStrategyBase, _PLDDPStrategy):
    __doc__ = HeterogeneousStrategyBase.__doc__
    _spawn_launcher_cls = _PLHeterogeneousMultiProcessingLauncher
    _trainer_loop = True  # the standalone Trainer: the watchdog and the lifecycle launcher, as on lightning.pytorch
