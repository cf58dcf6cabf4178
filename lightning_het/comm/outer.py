"""What a ``comm="node_local"`` sync does: a weighted average, or an outer optimizer step (docs/communication.md).

Every replica holds the same outer state (``anchor``, the consensus model of the last sync, and the outer optimizer's).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from lightning_het.comm.averaging import average_parameters, unique_floating
from lightning_het.comm.compression import Codec, compressed_sum
from lightning_het.comm.hooks import HierarchicalState

#: builds the outer optimizer over the consensus model's tensors
OuterFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


class ParameterAverage:
    """The paper's sync: every parameter replaced by the weighted sum over replicas (no state)."""

    @property
    def residual(self) -> torch.Tensor | None:
        """No compression, so no error-feedback residual."""
        return None

    @residual.setter
    def residual(self, residual: torch.Tensor | None) -> None:
        """Nothing to keep: a float32 sync loses nothing."""

    def begin(self, params: list[torch.Tensor]) -> None:
        """The replicas agree on ``params`` now (nothing to remember)."""

    def merge(self, params: list[torch.Tensor], weight: float, state: HierarchicalState) -> tuple[int, int | None]:
        """Average in place; returns the float payload bytes per rank and ``None`` (no compressed stage)."""
        return average_parameters(params, weight, state), None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore."""


class OuterStep:
    """An outer optimizer (``factory`` of the anchor tensors) stepped with the merged pseudo-gradient
    ``anchor - params``, which crosses the nodes through ``codec``."""

    def __init__(self, factory: OuterFactory, codec: Codec) -> None:
        self.factory = factory
        self.codec = codec
        self.anchor: list[torch.Tensor] = []
        self.optimizer: torch.optim.Optimizer | None = None
        self._pending: dict[str, Any] | None = None

    @torch.no_grad()
    def begin(self, params: list[torch.Tensor]) -> None:
        """Remember ``params`` (the replicas agree on them) as the consensus model the next round starts from."""
        params = unique_floating(params)
        if self.optimizer is None or len(self.anchor) != len(params):
            self.anchor = [p.detach().clone() for p in params]
            self.optimizer = self.factory(self.anchor)
            if self._pending is not None:
                self.load_state_dict(self._pending)
            return
        for a, p in zip(self.anchor, params):
            a.copy_(p)

    @torch.no_grad()
    def merge(self, params: list[torch.Tensor], weight: float, state: HierarchicalState) -> tuple[int, int | None]:
        """Weighted sum of the pseudo-gradients over all replicas, one outer step, every replica set to its result;
        returns the float32 payload bytes per rank and the compressed bytes per leader (``None`` when float32)."""
        params = unique_floating(params)
        if self.optimizer is None:
            raise RuntimeError("The outer step has no consensus model: call `begin(params)` when the replicas agree.")
        device = self.anchor[0].device
        delta = torch.cat([(a - p.to(device)).reshape(-1).float() for a, p in zip(self.anchor, params)])
        delta.mul_(weight)
        compressed_sum(state, delta, self.codec)
        offset = 0
        for a in self.anchor:
            a.grad = delta[offset : offset + a.numel()].view_as(a).to(a.dtype)
            offset += a.numel()
        self.optimizer.step()
        for a, p in zip(self.anchor, params):
            a.grad = None
            p.copy_(a)
        wire = None if self.codec.dtype == "float32" else self.codec.wire_bytes(delta.numel())
        return delta.numel() * delta.element_size(), wire

    @property
    def residual(self) -> torch.Tensor | None:
        """This node leader's error-feedback residual (``None`` before the first compressed sync, or off leaders)."""
        return self.codec.residual

    @residual.setter
    def residual(self, residual: torch.Tensor | None) -> None:
        self.codec.residual = residual

    def state_dict(self) -> dict[str, Any]:
        """The outer optimizer's state and the anchor (copies; the same on every replica)."""
        return {
            "optimizer": None if self.optimizer is None else copy.deepcopy(self.optimizer.state_dict()),
            "anchor": [a.detach().clone() for a in self.anchor],
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (kept until :meth:`begin` builds the optimizer); an anchor of another
        model's size is left as :meth:`begin` set it."""
        if self.optimizer is None:
            self._pending = state
            return
        self._pending = None
        if state.get("optimizer") is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        anchor = state.get("anchor") or []
        if len(anchor) == len(self.anchor) and all(a.shape == s.shape for a, s in zip(self.anchor, anchor)):
            for a, saved in zip(self.anchor, anchor):
                a.copy_(saved)


def build_merge(
    outer_optimizer: str | OuterFactory | None, outer_lr: float, outer_momentum: float, sync_dtype: str
) -> ParameterAverage | OuterStep:
    """The sync for the keywords: ``None`` with float32 is the plain average; ``None`` with a compressed
    ``sync_dtype`` an outer SGD with lr 1 (the same average); ``"nesterov"`` DiLoCo's outer step; or a factory."""
    codec = Codec(sync_dtype)
    if outer_optimizer == "nesterov":
        return OuterStep(
            lambda ps: torch.optim.SGD(ps, lr=outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0), codec
        )
    if outer_optimizer is None:
        if sync_dtype == "float32":
            return ParameterAverage()
        return OuterStep(lambda ps: torch.optim.SGD(ps, lr=1.0), codec)
    if not callable(outer_optimizer):
        raise ValueError(
            "Expected argument `outer_optimizer` to be None, 'nesterov' or a callable building a torch optimizer"
            f" from a list of tensors, but got {outer_optimizer!r}."
        )
    return OuterStep(outer_optimizer, codec)
