"""The core plugin is layered one way: each part imports only from the parts below it (and itself), so no two
subpackages import each other. Function-local and ``TYPE_CHECKING`` imports count too (a lazy import that dodges a
cycle is still one); the few that remain are listed in ``ALLOWED`` with their reason. ``hsi/`` and ``app/`` sit above
the core and are not checked here."""

from __future__ import annotations

import ast
from pathlib import Path

import lightning_het

PACKAGE = Path(lightning_het.__file__).parent

#: bottom to top; a part may import from its own layer's parts and from any layer below. A part is a top-level module
#: (``config``) or a subpackage (``balance``: all its modules)
LAYERS: list[set[str]] = [
    {"_version", "_compat", "arguments", "allocation"},  # foundations: no package import but each other
    {"_flavour"},  # which Lightning package a run uses
    {"cluster"},  # process group, rendezvous, topology, devices
    {"comm"},  # the comm algorithms (on the topology)
    {"config"},  # the validated keywords (checks the comm ones)
    {"reliability"},  # watchdog, preemption, checkpoint records, resume
    {"data"},  # samplers and loaders (positioned from the checkpoint record)
    {"balance"},  # the allocation of one strategy and everything that sets it
    {"strategy", "sharded", "fabric", "emulation", "_pl_compat", "_fabric_compat", "pl", "train", "__init__"},  # glue
]
ABOVE_CORE = {"hsi", "app"}

#: (importing module, imported module prefix): why the import goes up a layer
ALLOWED: dict[tuple[str, str], str] = {}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _layer(part: str) -> int:
    for index, layer in enumerate(LAYERS):
        if part in layer:
            return index
    raise AssertionError(f"lightning_het.{part} is in no layer of tests/test_layering.py: add it to LAYERS")


def _imports(path: Path, module: str) -> list[tuple[int, str]]:
    """Every ``lightning_het`` module ``path`` imports, anywhere in the file (function bodies and ``TYPE_CHECKING``
    blocks included), with its line."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            names = [base] if node.module else [f"{base}.{alias.name}" for alias in node.names]
            found += [(node.lineno, name) for name in names]
    return [(line, name) for line, name in found if name.split(".")[0] == "lightning_het"]


def _allowed(module: str, target: str) -> bool:
    return any(module == mod and (target + ".").startswith(prefix + ".") for mod, prefix in ALLOWED)


def _core_files() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py")) if _part(_module_name(p)) not in ABOVE_CORE]


def test_every_part_imports_only_from_the_layers_below_it():
    wrong = []
    for path in _core_files():
        module = _module_name(path)
        source = _layer(_part(module))
        for line, target in _imports(path, module):
            if target == "lightning_het" or (_part(target) in ABOVE_CORE and _part(module) == "train"):
                continue  # the package's own namespace; `python -m lightning_het.train` forwards to the app
            if _layer(_part(target)) <= source or _allowed(module, target):
                continue
            wrong.append(
                f"{path.relative_to(PACKAGE.parent)}:{line}: {module} (layer {source}: {_part(module)}) imports"
                f" {target} (layer {_layer(_part(target))}: {_part(target)})"
            )
    assert not wrong, "imports going up a layer (see LAYERS in tests/test_layering.py):\n" + "\n".join(wrong)


def test_the_allowed_exceptions_are_still_needed():
    used = {
        (mod, prefix)
        for path in _core_files()
        for module in [_module_name(path)]
        for _, target in _imports(path, module)
        for mod, prefix in ALLOWED
        if module == mod and (target + ".").startswith(prefix + ".")
    }
    assert set(ALLOWED) == used, f"ALLOWED lists imports that no longer exist: {sorted(set(ALLOWED) - used)}"


def test_no_two_subpackages_import_each_other():
    edges = set()
    for path in _core_files():
        module = _module_name(path)
        for _, target in _imports(path, module):
            if _part(target) != _part(module) and not _allowed(module, target):
                edges.add((_part(module), _part(target)))
    subpackages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()} - ABOVE_CORE
    both_ways = sorted((a, b) for a, b in edges if a < b and (b, a) in edges and {a, b} <= subpackages)
    assert not both_ways, f"subpackages importing each other: {both_ways}"


#: the modules whose ``__all__`` lists public names: the package's, the standalone flavours' import, the subpackage
#: facades; ``_compat``'s lists the private upstream names it re-exports (tests/test_fence.py reads it)
ADVERTISING = {
    "lightning_het",
    "lightning_het.pl",
    "lightning_het._compat",
    "lightning_het.balance",
    "lightning_het.comm",
}


def test_internal_modules_advertise_no_names():
    advertising = []
    for path in _core_files():
        module = _module_name(path)
        for node in ast.parse(path.read_text(), str(path)).body:
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets) and module not in ADVERTISING:
                advertising.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not advertising, "internal modules with an `__all__` (not public names):\n" + "\n".join(advertising)
