"""``EmulatedPlatform``: a heterogeneous platform reproduced on one machine, for tests, benchmarks and the app."""

from __future__ import annotations

from collections.abc import Sequence

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_het.arguments import int_list, slowdown_factors


class EmulatedPlatform(Callback):
    """Emulated heterogeneity, by global rank: replica ``r``'s steps take ``slowdown[r]`` (>= 1) times their compute
    time; a training forward of more than ``memory_cap[r]`` samples raises ``torch.OutOfMemoryError`` on it."""

    def __init__(self, slowdown: Sequence[float] | None = None, memory_cap: Sequence[int] | None = None) -> None:
        self.slowdown = slowdown_factors("slowdown", slowdown)
        self.memory_cap = int_list("memory_cap", memory_cap)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(slowdown={self.slowdown}, memory_cap={self.memory_cap})"

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        policy = getattr(trainer.strategy, "policy", None)  # the heterogeneous strategies' balance policy
        if policy is None:
            raise TypeError(
                "EmulatedPlatform needs `HeterogeneousStrategy`, but the Trainer runs"
                f" {type(trainer.strategy).__name__}. HINT: pass `strategy=HeterogeneousStrategy(...)`"
                " (or strategy='heterogeneous')."
            )
        policy.emulate(self.slowdown, self.memory_cap)
