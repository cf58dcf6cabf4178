"""The standalone ``pytorch_lightning`` flavour: our Trainer strategy and the classes its parts give a trainer, composed
with that package's classes by plain class statements (public import: :mod:`lightning_het.pl`)."""

from __future__ import annotations

import sys

from lightning_fabric.utilities.seed import reset_seed  # noqa: F401 - the flavour's (lightning_het._flavour)
from pytorch_lightning.accelerators import Accelerator
from pytorch_lightning.callbacks import Callback, ModelCheckpoint  # noqa: F401
from pytorch_lightning.strategies import DDPStrategy
from pytorch_lightning.trainer.states import RunningStage, TrainerFn, TrainerStatus  # noqa: F401
from pytorch_lightning.utilities.exceptions import SIGTERMException

from lightning_het._flavour import FLAVOURS
from lightning_het.balance.monitor import BalanceMonitor
from lightning_het.cluster.accelerators import MixedAcceleratorMixin
from lightning_het.reliability.launch import PreemptedMixin, PreemptionCallbackMixin
from lightning_het.reliability.watchdog import WatchdogCallbackMixin
from lightning_het.strategy import HeterogeneousStrategyMixin


class WatchdogCallback(WatchdogCallbackMixin, Callback):
    """Feeds the strategy's watchdog (``pytorch_lightning``)."""


class PreemptionCallback(PreemptionCallbackMixin, Callback):
    """Runs the preemption agreement after optimizer steps (``pytorch_lightning``)."""


class HeterogeneousBalanceCallback(BalanceMonitor, Callback):
    """Forwards the fit loop's epoch hooks to the balance monitor (``pytorch_lightning``)."""


class MixedAccelerator(MixedAcceleratorMixin, Accelerator):
    """Accelerator for jobs that mix CPU and CUDA replicas (``pytorch_lightning``)."""


class Preempted(PreemptedMixin, SIGTERMException):
    """Raised on every replica after the preemption checkpoint is written (``pytorch_lightning``)."""


class HeterogeneousStrategy(HeterogeneousStrategyMixin, DDPStrategy):
    """:class:`lightning_het.HeterogeneousStrategy` on the standalone ``pytorch_lightning`` package."""


FLAVOURS[True] = sys.modules[__name__]
