"""Registration of the ``"heterogeneous"`` strategy name with Lightning (the package's only import-time side effect).

Registers once Lightning and this package are both imported, so ``import lightning_het`` never imports Lightning.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

__all__ = ["after_import", "register", "register_on_import"]

_lock = threading.RLock()
#: module name -> callbacks to run once that module has finished executing
_pending: dict[str, list[Callable[[], None]]] = {}
#: this package's submodules: when one finishes executing, registration runs if nothing of the package is half-built
_FAMILY = "lightning_het."
#: the Lightning flavours whose registries we fill
_FLAVOURS = ("lightning", "pytorch_lightning", "lightning_fabric")


def _is_loaded(name: str) -> bool:
    """Whether module ``name`` is imported and has finished executing (not half-way through its own imports)."""
    module = sys.modules.get(name)
    return module is not None and not getattr(getattr(module, "__spec__", None), "_initializing", False)


class _RunAfterLoader(importlib.abc.Loader):
    """Wraps a module's real loader: executes the module, then the callbacks waiting for it."""

    def __init__(self, name: str, loader: importlib.abc.Loader) -> None:
        self._name = name
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        # the module sees its real loader (source lookups, pickling, reloads); only this one execution is wrapped
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        if module.__spec__ is not None:  # executed: the callbacks may import from it (importlib resets it too)
            module.__spec__._initializing = False
        with _lock:
            callbacks = _pending.pop(self._name, [])
        if self._name.startswith(_FAMILY):
            callbacks.append(_when_settled)
        for callback in callbacks:
            try:
                callback()
            except Exception as err:  # never break the user's import of Lightning because of the registration
                warnings.warn(
                    f"lightning-het could not register strategy='heterogeneous' after importing {self._name}:"
                    f" {type(err).__name__}: {err}. HINT: `import lightning_het.strategy` shows the full error.",
                    stacklevel=2,
                )

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class _RunAfterFinder(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path``; finds only the modules that callbacks wait for, and this package's submodules."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _pending and not fullname.startswith(_FAMILY):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _RunAfterLoader(fullname, spec.loader)
                return spec
        return None


_finder = _RunAfterFinder()


def after_import(name: str, callback: Callable[[], None]) -> None:
    """Run ``callback()`` once module ``name`` is imported and executed: now if it already is, else right after (in
    the importing thread)."""
    with _lock:
        if not _is_loaded(name):
            _pending.setdefault(name, []).append(callback)
            if _finder not in sys.meta_path:
                sys.meta_path.insert(0, _finder)
            return
    callback()


def _settled() -> bool:
    """No submodule of this package is half-way through its own imports."""
    return all(_is_loaded(name) for name in list(sys.modules) if name.startswith(_FAMILY))


def _when_settled() -> None:
    """Register once nothing of ours is half-built (the outermost importing module calls this again when complete)."""
    if _settled() and any(_is_loaded(flavour) for flavour in _FLAVOURS):
        _register_all()


def _ready(name: str) -> bool:
    """Whether module ``name`` is complete (or absent and imported here); ``False`` while half-built."""
    if _is_loaded(name):
        return True
    if name in sys.modules:
        return False
    importlib.import_module(name)
    return True


def _register_all() -> None:
    """Register in every registry whose Lightning flavour is loaded (idempotent; safe from any hook)."""
    if not _ready("lightning_het.strategy"):  # the other two build on it
        return
    _register("lightning.pytorch.strategies.StrategyRegistry", "lightning_het.strategy.HeterogeneousStrategy")
    if _is_loaded("pytorch_lightning") and _ready("lightning_het._pl_compat"):
        _register("pytorch_lightning.strategies.StrategyRegistry", "lightning_het._pl_compat.HeterogeneousStrategy")
    if not _ready("lightning_het.fabric"):
        return
    _register("lightning.fabric.strategies.STRATEGY_REGISTRY", "lightning_het.fabric.HeterogeneousFabricStrategy")
    if _is_loaded("lightning_fabric") and _ready("lightning_het._fabric_compat"):
        _register(
            "lightning_fabric.strategies.STRATEGY_REGISTRY", "lightning_het._fabric_compat.HeterogeneousFabricStrategy"
        )


def _register(registry: str, strategy: str) -> None:
    """``<strategy>.register_strategies(<registry>)``, both given as ``module.attribute``."""
    _attribute(strategy).register_strategies(_attribute(registry))


def _attribute(path: str) -> Any:
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def register() -> None:
    """Register ``"heterogeneous"`` now in every loaded Lightning flavour's registry (imports Lightning; idempotent)."""
    _register_all()


def register_on_import() -> None:
    """Register ``"heterogeneous"`` with every Lightning flavour as soon as it is imported (imports nothing heavy)."""
    for flavour in _FLAVOURS:
        after_import(flavour, _when_settled)
    with _lock:
        if _finder not in sys.meta_path:  # our own submodules report when they are complete (see _when_settled)
            sys.meta_path.insert(0, _finder)
