"""Fixtures and helpers of the hyperspectral tests (import them into a test module to use them).

Every raster is written into a temporary folder; nothing binary is committed.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from rasterio.crs import CRS
from rasterio.transform import Affine

from lightning_het.hsi.raster import write_geotiff
from lightning_het.hsi.synthetic import write_synthetic_scene

#: A small scene: 24 x 20 pixels, 7 bands, 3 classes.
HEIGHT, WIDTH, BANDS, CLASSES = 24, 20, 7, 3
UTM = CRS.from_epsg(32616)
TRANSFORM = Affine(20.0, 0.0, 500000.0, 0.0, -20.0, 4400000.0)

#: Keyword arguments of a tiny synthetic scene that a tiny CNN learns in a few epochs.
TINY_SCENE = {"height": 40, "width": 40, "bands": 16, "classes": 4, "seed": 3, "region_scale": 5.0}


@pytest.fixture(autouse=True, scope="module")
def torch_single_thread():
    """One intra-op thread: tiny models run far faster without thread spin-waits on busy CPUs (module-scoped, so that
    module-scoped fixtures that train run under it too)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def small_arrays(seed: int = 0, dtype: str = "uint16") -> tuple[np.ndarray, np.ndarray]:
    """A random cube ``(BANDS, HEIGHT, WIDTH)`` and labels ``(HEIGHT, WIDTH)`` in ``0..CLASSES`` (all present)."""
    rng = np.random.default_rng(seed)
    cube = rng.integers(100, 5000, size=(BANDS, HEIGHT, WIDTH)).astype(dtype)
    labels = rng.integers(0, CLASSES + 1, size=(HEIGHT, WIDTH)).astype(np.uint8)
    labels[0, :CLASSES] = np.arange(1, CLASSES + 1)
    return cube, labels


@pytest.fixture
def raster_pair(tmp_path: Path) -> tuple[Path, Path, np.ndarray, np.ndarray]:
    """``(image.tif, labels.tif, cube, labels)`` of :func:`small_arrays`, georeferenced in UTM 16N."""
    cube, labels = small_arrays()
    image = write_geotiff(tmp_path / "image.tif", cube, crs=UTM, transform=TRANSFORM)
    label_path = write_geotiff(tmp_path / "labels.tif", labels, crs=UTM, transform=TRANSFORM)
    return image, label_path, cube, labels


@pytest.fixture(scope="session")
def synthetic_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny synthetic scene written as GeoTIFFs, shared by the session."""
    return write_synthetic_scene(tmp_path_factory.mktemp("synthetic"), **TINY_SCENE)


def quiet_trainer(**kwargs: object) -> pl.Trainer:
    """A CPU trainer with no logger, checkpoints, progress bar or model summary."""
    defaults: dict[str, object] = {
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    defaults.update(kwargs)
    return pl.Trainer(**defaults)  # type: ignore[arg-type]
