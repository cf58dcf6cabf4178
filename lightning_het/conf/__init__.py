"""Hydra config tree of the lightning-het app (a package so that Hydra finds it as ``pkg://lightning_het.conf``)."""
