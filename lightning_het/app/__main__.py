"""``python -m lightning_het.app [overrides]``: the same as ``lightning-het-train``."""

from lightning_het.app.train import main

main()
