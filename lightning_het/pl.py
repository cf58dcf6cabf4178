"""The strategies for the standalone ``pytorch_lightning`` and ``lightning_fabric`` packages.

Their classes and registries are separate from the unified ``lightning`` package's, so a ``pytorch_lightning.Trainer``
needs a strategy built on ``pytorch_lightning``'s ``DDPStrategy``::

    import pytorch_lightning as pl
    from lightning_het.pl import HeterogeneousStrategy

    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=HeterogeneousStrategy(timeout=60))

and ``lightning_fabric.Fabric`` one built on ``lightning_fabric``'s (:class:`HeterogeneousFabricStrategy`). The
keywords, the ``"heterogeneous"`` strategy name (registered as soon as the package is imported) and the guarantees are
those of :class:`lightning_het.HeterogeneousStrategy` and :class:`lightning_het.HeterogeneousFabricStrategy`,
including, for the Trainer, the hung/dead-replica watchdog, the ``popen`` launcher's lifecycle (no orphans, the
end-of-run barrier, exit statuses 124 and 130), preemption and telemetry.

Each name imports its package on first use, so this module imports without either; a name whose package is missing
raises ``ImportError`` with the ``pip install`` that provides it.

.. versionadded:: 0.1
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_het._fabric_compat import HeterogeneousFabricStrategy
    from lightning_het._pl_compat import HeterogeneousStrategy

__all__ = ["HeterogeneousFabricStrategy", "HeterogeneousStrategy"]

#: public name -> (the module that defines it, the package it needs, the distribution that provides that package)
_SOURCES = {
    "HeterogeneousStrategy": ("lightning_het._pl_compat", "pytorch_lightning", "pytorch-lightning"),
    "HeterogeneousFabricStrategy": ("lightning_het._fabric_compat", "lightning_fabric", "lightning-fabric"),
}


def __getattr__(name: str) -> Any:
    if name not in _SOURCES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, package, distribution = _SOURCES[name]
    try:
        importlib.import_module(package)
    except ImportError as err:
        raise ImportError(
            f"lightning_het.pl.{name} builds on the standalone `{package}` package, which is not installed ({err})."
            f' HINT: `pip install "{distribution}>=2.4,<2.7"`, or use `lightning_het.{name}` with the unified'
            " `lightning` package."
        ) from err
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
