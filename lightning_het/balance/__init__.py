"""Load balancing: per-replica cost models, batch allocation, profiling, the step clock, rebalancing and reports.

Everything here is called by :class:`~lightning_het.HeterogeneousStrategy` with explicit arguments; nothing reads the
strategy's private state. The pure modules (:mod:`~lightning_het.balance.allocation`,
:mod:`~lightning_het.balance.rebalance`) do not touch ``torch.distributed``.
"""

from lightning_het.balance.allocation import allocate_batch_sizes

__all__ = ["allocate_batch_sizes"]
