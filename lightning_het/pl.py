"""Our strategies on the standalone ``pytorch_lightning`` / ``lightning_fabric`` (each needs its package installed),
with the keywords and guarantees of ``lightning_het.HeterogeneousStrategy`` / ``HeterogeneousFabricStrategy``."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_het._fabric_compat import HeterogeneousFabricStrategy
    from lightning_het._pl_compat import HeterogeneousStrategy

__all__ = ["HeterogeneousFabricStrategy", "HeterogeneousStrategy"]

#: public name -> (the module that defines it, the package it needs, the distribution that provides that package)
SOURCES = {
    "HeterogeneousStrategy": ("lightning_het._pl_compat", "pytorch_lightning", "pytorch-lightning"),
    "HeterogeneousFabricStrategy": ("lightning_het._fabric_compat", "lightning_fabric", "lightning-fabric"),
}


def __getattr__(name: str) -> Any:
    if name not in SOURCES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, package, distribution = SOURCES[name]
    try:
        importlib.import_module(package)
    except ImportError as err:
        raise ImportError(
            f"lightning_het.pl.{name} builds on the standalone `{package}` package, which is not installed ({err})."
            f' HINT: `pip install "{distribution}>=2.4,<2.7"`, or use `lightning_het.{name}` with `lightning`.'
        ) from err
    value = globals()[name] = getattr(importlib.import_module(module), name)
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
