"""Batch norm layers under uneven per-replica batches and micro-batches: the warning, and the settings refused."""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn

#: every batch norm layer of torch (they share only a private base class)
_BATCH_NORMS = (
    torch.nn.BatchNorm1d,
    torch.nn.BatchNorm2d,
    torch.nn.BatchNorm3d,
    torch.nn.LazyBatchNorm1d,
    torch.nn.LazyBatchNorm2d,
    torch.nn.LazyBatchNorm3d,
    torch.nn.SyncBatchNorm,
)


def _norm_layers(module: torch.nn.Module | None, synced: bool) -> list[str]:
    """The names of ``module``'s ``SyncBatchNorm`` layers (``synced``), or of its other batch norm layers."""
    modules = module.named_modules() if module is not None else []
    return [n for n, m in modules if isinstance(m, _BATCH_NORMS) and isinstance(m, torch.nn.SyncBatchNorm) == synced]


def _shown(names: list[str]) -> str:
    return ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")


def per_replica_batchnorm(module: torch.nn.Module | None, world_size: int) -> list[str]:
    """The batch norm layers that normalise each replica's batch apart, with a warning (rank 0) naming them."""
    layers = _norm_layers(module, synced=False)
    if layers and world_size > 1:
        rank_zero_warn(
            f"The model has {len(layers)} batch norm layer(s) ({_shown(layers)}) that normalise each"
            " replica's batch separately: with uneven per-replica batches the gradient is no longer exactly the"
            " global-batch gradient, and every replica now gets at least 2 samples per step. HINT: pass"
            " `Trainer(sync_batchnorm=True)` for global batch statistics (not with micro-batching)."
        )
    return layers


def refuse_synced_norm_in_pieces(module: torch.nn.Module | None, world_size: int, micro_batching: bool) -> None:
    """Raise when micro-batching meets ``SyncBatchNorm``: its forward is a collective, and replicas that run their
    shares in different numbers of micro-batches would pair different collectives."""
    synced = _norm_layers(module, synced=True) if micro_batching and world_size > 1 else []
    if synced:
        raise ValueError(
            f"`max_micro_batch_sizes` (or `emulate_memory_cap`) runs a share as several forward passes, but the model's"
            f" SyncBatchNorm layer(s) ({_shown(synced)}) make every training forward a collective that all replicas"
            " must run equally often. HINT: drop `Trainer(sync_batchnorm=True)` (each micro-batch is then normalised by"
            " its own statistics), or bound the shares with `max_batch_sizes` instead."
        )


def refuse_single_sample_pieces(layers: list[str], caps: Any, least: int) -> None:
    """Raise when a micro-batch cap below ``least`` could leave a piece of one sample, which the model's batch norm
    ``layers`` cannot normalise in training (a cap of 2 splits a share of 3 as ``[2, 1]``)."""
    small = [(r, c) for r, c in enumerate(caps if isinstance(caps, list) else []) if c < least]
    if layers and small:
        rank, cap = small[0]
        raise ValueError(
            f"`max_micro_batch_sizes[{rank}]` is {cap}, but the model's batch norm layer(s) ({_shown(layers)}) need at"
            f" least 2 samples per micro-batch in training, and pieces of at most {cap} samples can leave one of 1"
            f" (a share of 3 runs as [2, 1]). HINT: set `max_micro_batch_sizes[{rank}]` to {least} or more, or bound"
            " the share itself with `max_batch_sizes` instead."
        )
