"""The private Lightning and torch APIs that lightning-het relies on, imported in one place.

Each name here is private upstream (a leading underscore) and may move or change in a release that the version
bounds in ``pyproject.toml`` (``lightning>=2.4,<2.7``) do not yet exclude. Importing them here, behind one guard, turns
such a change into one clear error at import time that names the missing API, rather than a failure deep inside a
training run; and it lists, for whoever updates the bounds, what to check.

What uses what:

* the strategy: ``_init_dist_connection`` (process-group set-up with our start-up timeout), ``_register_ddp_comm_hook``
  (our comm hooks on every device type), ``_MultiProcessingLauncher`` (the spawn launcher that returns the allocation
  to the parent), ``_BatchNorm`` (warning about per-replica batch statistics);
* the mixed-device accelerator: ``_check_cuda_matmul_precision``, ``_clear_cuda_memory`` (what Lightning's CUDA
  accelerator does for a CUDA replica);
* profiling: ``_collect_rng_states``, ``_set_rng_states`` (profiling leaves every random stream as it found it).

The data-loader rebuilding (:mod:`lightning_het.loaders`) and the launch code (:mod:`lightning_het.lifecycle`) import
a few more private helpers themselves; the standalone ``pytorch_lightning`` and ``lightning_fabric`` packages have
their own modules (:mod:`lightning_het._pl_compat`, :mod:`lightning_het._fabric_compat`).
"""

from __future__ import annotations

try:
    from lightning.fabric.accelerators.cuda import _check_cuda_matmul_precision, _clear_cuda_memory
    from lightning.fabric.utilities.distributed import _init_dist_connection
    from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
    from lightning.pytorch.overrides.distributed import _register_ddp_comm_hook
    from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
    from torch.nn.modules.batchnorm import _BatchNorm
except ImportError as err:  # pragma: no cover - only with an untested Lightning/torch release
    import lightning
    import torch

    raise ImportError(
        f"lightning-het needs a private API that this lightning {lightning.__version__} / torch {torch.__version__}"
        f" does not have: {err}. HINT: install the versions lightning-het supports (`pip install"
        ' "lightning>=2.4,<2.7"`), or report the incompatibility; lightning_het/_compat.py lists every such API.'
    ) from err

__all__ = [
    "_BatchNorm",
    "_MultiProcessingLauncher",
    "_check_cuda_matmul_precision",
    "_clear_cuda_memory",
    "_collect_rng_states",
    "_init_dist_connection",
    "_register_ddp_comm_hook",
    "_set_rng_states",
]
