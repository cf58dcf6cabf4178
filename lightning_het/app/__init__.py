"""The Hydra app (``lightning-het-train``): structured configs, the entry point, outputs and sweeps."""

from __future__ import annotations

from pathlib import Path

__all__ = ["config_dir"]


def config_dir() -> Path:
    """The directory of the app's Hydra configs (``train.yaml`` and the config groups)."""
    package = Path(__file__).resolve().parents[1]
    for candidate in (package / "conf", package.parent / "conf"):
        if (candidate / "train.yaml").is_file():
            return candidate
    raise FileNotFoundError(
        f"lightning-het cannot find its configs: no train.yaml in {package / 'conf'} or {package.parent / 'conf'}."
        " HINT: reinstall the package (`pip install lightning-het[app]`) or run from a full source checkout."
    )
