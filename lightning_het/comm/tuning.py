"""Measured choice between the two exact reductions: a flat all-reduce or the node hierarchy."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Literal

Reduction = Literal["flat", "hierarchical"]

#: default relative advantage the flat all-reduce needs before it replaces the hierarchy
DEFAULT_MARGIN = 0.02


def choose_reduction(flat_s: float, hierarchical_s: float, margin: float = DEFAULT_MARGIN) -> Reduction:
    """The reduction to keep, from typical step times (seconds) measured with each. Pure.

    ``"flat"`` only when ``flat_s < hierarchical_s * (1 - margin)``; ties and NaNs keep ``"hierarchical"``.

    >>> choose_reduction(0.40, 0.50)
    'flat'
    >>> choose_reduction(0.495, 0.50)
    'hierarchical'
    """
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"Expected argument `margin` in [0, 1), but got {margin!r}.")
    if flat_s > 0 and hierarchical_s > 0 and flat_s < hierarchical_s * (1.0 - margin):
        return "flat"
    return "hierarchical"


class ReductionTuner:
    """Times optimizer steps under alternating reductions; one per rank, driven once per optimizer step."""

    __slots__ = ("_clock", "_current", "_last", "_n", "_times", "choice", "margin")

    def __init__(
        self, steps_per_candidate: int, margin: float = DEFAULT_MARGIN, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        if isinstance(steps_per_candidate, bool) or not isinstance(steps_per_candidate, int) or steps_per_candidate < 1:
            raise ValueError(f"Expected argument `steps_per_candidate` >= 1, but got {steps_per_candidate!r}.")
        self._n = steps_per_candidate
        self.margin = margin
        self._clock = clock
        self._times: dict[Reduction, list[float]] = {"flat": [], "hierarchical": []}
        self._last: float | None = None
        self._current: Reduction = "hierarchical"
        #: the decision, ``None`` while measuring
        self.choice: Reduction | None = None

    @property
    def current(self) -> Reduction:
        """The reduction the step about to run must use."""
        return self.choice or self._current

    @property
    def measuring(self) -> bool:
        return self.choice is None

    def step_done(self) -> bool:
        """Record the end of an optimizer step; ``True`` once both reductions have ``steps_per_candidate`` times."""
        if self.choice is not None:
            return False
        now = self._clock()
        if self._last is not None:
            self._times[self._current].append(now - self._last)
        self._last = now
        if all(len(t) >= self._n for t in self._times.values()):
            return True
        self._current = "flat" if len(self._times["flat"]) <= len(self._times["hierarchical"]) else "hierarchical"
        return False

    def medians(self) -> list[float]:
        """This rank's median step time (s) with ``[flat, hierarchical]``; ``nan`` where none was timed."""
        return [statistics.median(t) if t else float("nan") for t in self._times.values()]

    def decide(self, medians: Sequence[float]) -> Reduction:
        """Adopt the choice for ``[flat, hierarchical]`` step times agreed by all ranks; return it."""
        flat_s, hierarchical_s = medians
        self.choice = choose_reduction(flat_s, hierarchical_s, self.margin)
        return self.choice
