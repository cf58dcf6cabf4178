"""Hydra config tree of the lightning-het app: the repository's ``conf/``, installed as ``lightning_het.conf``.

The app finds it with :func:`lightning_het.app.config_dir`; Hydra users can also name it ``pkg://lightning_het.conf``
in an installed copy.
"""
