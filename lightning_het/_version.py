"""The package version, in one place: ``pyproject.toml`` (dynamic version) and ``lightning_het.__version__`` read it."""

__version__ = "0.1.0.dev0"
