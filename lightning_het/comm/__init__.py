"""Communication modes of lightning-het: flat all-reduce, exact hierarchical reduction, node-local steps.

The strategy drives one :class:`CommController` per process; the hooks, the averaging function and the byte model
are usable on their own with a raw :class:`~torch.nn.parallel.DistributedDataParallel`.
"""

from lightning_het.comm.averaging import average_parameters, share_weights
from lightning_het.comm.controller import (
    COMM_CHOICES,
    CommController,
    CommMode,
    resolve_comm_mode,
    validate_comm_args,
)
from lightning_het.comm.hooks import (
    HierarchicalState,
    NodeLocalState,
    hierarchical_hook,
    hierarchical_sum,
    node_local_hook,
)
from lightning_het.comm.stats import CommStats, Traffic

__all__ = [
    "COMM_CHOICES",
    "CommController",
    "CommMode",
    "CommStats",
    "HierarchicalState",
    "NodeLocalState",
    "Traffic",
    "average_parameters",
    "hierarchical_hook",
    "hierarchical_sum",
    "node_local_hook",
    "resolve_comm_mode",
    "share_weights",
    "validate_comm_args",
]
