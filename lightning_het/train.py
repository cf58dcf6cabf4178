"""``python -m lightning_het.train [overrides]``: the Hydra app's command line, kept at this path for users' scripts."""

from __future__ import annotations

from lightning_het.app.train import main

if __name__ == "__main__":
    main()
