"""Package list for setuptools (everything else is in ``pyproject.toml``).

The package tree ``lightning_het/`` is found automatically, so a new subpackage needs no edit here. The top-level
``conf/`` directory (the app's Hydra configs) is mapped into the wheel as the package ``lightning_het.conf``.
"""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["lightning_het", "lightning_het.*"]), "lightning_het.conf"],
    package_dir={"lightning_het.conf": "conf"},
)
