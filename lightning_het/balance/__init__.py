"""Load balancing: per-replica cost models, batch allocation, profiling, the step clock, rebalancing and reports."""
