"""The private Lightning and torch APIs that lightning-het relies on, imported in one place.

Each name here is private upstream (a leading underscore) and may move or change in a release that the version
bounds in ``pyproject.toml`` (``lightning>=2.4,<2.7``) do not yet exclude. Importing them here, behind one guard, turns
such a change into one clear error at import time that names the missing API, rather than a failure deep inside a
training run; and it lists, for whoever updates the bounds, what to check. No other module of the package imports a
private Lightning or torch name, or reaches into ``torch.distributed.distributed_c10d``.

What uses what:

* the strategy: ``_init_dist_connection`` (process-group set-up with our start-up timeout), ``_register_ddp_comm_hook``
  (our comm hooks on every device type), ``_MultiProcessingLauncher`` (the spawn launcher that returns the allocation
  to the parent), ``_BatchNorm`` (warning about per-replica batch statistics);
* the launcher (:mod:`lightning_het.lifecycle`): ``_SubprocessScriptLauncher`` (the ``popen`` launcher it extends),
  ``_basic_subprocess_cmd`` / ``_hydra_subprocess_cmd`` (each replica's command line), ``_set_num_threads_if_needed``;
* the data-loader rebuilding (:mod:`lightning_het.loaders`): ``_get_dataloader_init_args_and_kwargs`` and
  ``_reinstantiate_wrapped_cls`` (a user's DataLoader subclass re-created with a new sampler);
* the mixed-device accelerator: ``_check_cuda_matmul_precision``, ``_clear_cuda_memory`` (what Lightning's CUDA
  accelerator does for a CUDA replica);
* profiling: ``_collect_rng_states``, ``_set_rng_states`` (profiling leaves every random stream as it found it);
* the watchdog and the start-up timeout: torch's ``_get_default_store`` and ``_set_pg_timeout``, wrapped in
  :func:`default_store` and :func:`set_default_group_timeout`;
* the strategies on the standalone packages (``pytorch_lightning``, ``lightning_fabric``) and Fabric's spawn
  launcher: that package's ``_MultiProcessingLauncher``, through :func:`flavour_private` (imported only when that
  package is used).

The standalone ``pytorch_lightning`` and ``lightning_fabric`` packages have their own modules
(:mod:`lightning_het._pl_compat`, :mod:`lightning_het._fabric_compat`): they subclass that package's classes, so they
can only be imported when it is installed, while this module must import without them.
"""

from __future__ import annotations

import contextlib
import importlib
from datetime import timedelta
from typing import Any


def _missing_api_error(what: str, err: BaseException) -> ImportError:
    import lightning
    import torch

    return ImportError(
        f"lightning-het needs a private API that this lightning {lightning.__version__} / torch {torch.__version__}"
        f" does not have: {what} ({err}). HINT: install the versions lightning-het supports (`pip install"
        ' "lightning>=2.4,<2.7"`), or report the incompatibility; lightning_het/_compat.py lists every such API.'
    )


try:
    from lightning.fabric.accelerators.cuda import _check_cuda_matmul_precision, _clear_cuda_memory
    from lightning.fabric.strategies.launchers.subprocess_script import _basic_subprocess_cmd, _hydra_subprocess_cmd
    from lightning.fabric.utilities.data import _reinstantiate_wrapped_cls
    from lightning.fabric.utilities.distributed import _init_dist_connection, _set_num_threads_if_needed
    from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
    from lightning.pytorch.overrides.distributed import _register_ddp_comm_hook
    from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
    from lightning.pytorch.utilities.data import _get_dataloader_init_args_and_kwargs
    from torch.distributed.distributed_c10d import _get_default_store, _set_pg_timeout
    from torch.nn.modules.batchnorm import _BatchNorm
except ImportError as err:  # pragma: no cover - only with an untested Lightning/torch release
    raise _missing_api_error("one of the imports of lightning_het/_compat.py", err) from err

__all__ = [
    "_BatchNorm",
    "_MultiProcessingLauncher",
    "_SubprocessScriptLauncher",
    "_basic_subprocess_cmd",
    "_check_cuda_matmul_precision",
    "_clear_cuda_memory",
    "_collect_rng_states",
    "_get_dataloader_init_args_and_kwargs",
    "_hydra_subprocess_cmd",
    "_init_dist_connection",
    "_register_ddp_comm_hook",
    "_reinstantiate_wrapped_cls",
    "_set_num_threads_if_needed",
    "_set_rng_states",
    "default_store",
    "flavour_private",
    "set_default_group_timeout",
]


def default_store() -> object:
    """The ``torch.distributed.Store`` of the default process group (it must exist)."""
    return _get_default_store()


def set_default_group_timeout(timeout: timedelta) -> None:
    """Make ``timeout`` the default process group's collective timeout and its store's timeout (best effort for the
    store: some store types cannot change it)."""
    _set_pg_timeout(timeout)
    with contextlib.suppress(Exception):
        _get_default_store().set_timeout(timeout)


def flavour_private(package: str, module: str, name: str) -> Any:
    """The private ``name`` of ``<package>.<module>`` in one Lightning flavour, imported on demand.

    For the flavours that may be absent or have separate classes: ``package`` is ``"pytorch_lightning"``,
    ``"lightning_fabric"`` or ``"lightning.fabric"``; e.g. ``flavour_private("pytorch_lightning",
    "strategies.launchers.multiprocessing", "_MultiProcessingLauncher")``.

    Raises:
        ImportError: naming the API and the installed versions when the flavour no longer has it.
    """
    try:
        return getattr(importlib.import_module(f"{package}.{module}"), name)
    except (ImportError, AttributeError) as err:  # pragma: no cover - only with an untested Lightning release
        raise _missing_api_error(f"{package}.{module}.{name}", err) from err
