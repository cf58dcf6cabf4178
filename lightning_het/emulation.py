"""``EmulatedPlatform``: a heterogeneous platform reproduced on one machine, for tests, benchmarks and the app.

A Trainer callback, not a strategy setting: before the fit's setup it hands its slowdowns and memory caps to the
strategy, which then runs them exactly as on real hardware of those speeds and memory sizes (the step clock sleeps,
a forward pre-hook raises ``torch.OutOfMemoryError``).
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_het.arguments import int_list, slowdown_factors


class EmulatedPlatform(Callback):
    """Emulated heterogeneity for ``HeterogeneousStrategy``, indexed by global rank.

    ``slowdown``: replica ``r``'s steps take ``slowdown[r]`` (>= 1) times their compute time (the clock sleeps
    ``f - 1`` times the forward and the backward work it just measured, before the gradients are synchronised).
    ``memory_cap``: a training forward of more than ``memory_cap[r]`` samples raises ``torch.OutOfMemoryError`` from
    inside the model on replica ``r``.

    >>> EmulatedPlatform(slowdown=[1, 4])
    EmulatedPlatform(slowdown=[1.0, 4.0], memory_cap=None)
    >>> EmulatedPlatform(slowdown=[0.5])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    lightning_het.arguments.ArgumentError: Expected argument `slowdown` to hold factors >= 1 ...
    """

    def __init__(self, slowdown: Sequence[float] | None = None, memory_cap: Sequence[int] | None = None) -> None:
        self.slowdown = slowdown_factors("slowdown", slowdown)
        self.memory_cap = int_list("memory_cap", memory_cap)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(slowdown={self.slowdown}, memory_cap={self.memory_cap})"

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        hand_over = getattr(trainer.strategy, "emulate_platform", None)
        if hand_over is None:
            raise TypeError(
                "EmulatedPlatform needs `HeterogeneousStrategy`, but the Trainer runs"
                f" {type(trainer.strategy).__name__}. HINT: pass `strategy=HeterogeneousStrategy(...)`"
                " (or strategy='heterogeneous')."
            )
        hand_over(self.slowdown, self.memory_cap)
