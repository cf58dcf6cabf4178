"""Load balancing: per-replica cost models, batch allocation, profiling, the step clock, rebalancing and reports."""

from lightning_het.allocation import allocate_batch_sizes

__all__ = ["allocate_batch_sizes"]
