"""Prediction maps: assembly, GeoTIFF with the input's georeferencing, PNG preview, and the trainer.predict writer."""

from __future__ import annotations

import numpy as np
import pytest
import rasterio
import torch
from rasterio.crs import CRS
from rasterio.transform import Affine

from lightning_het.hsi import HyperspectralDataModule
from lightning_het.hsi.model import HSIClassifier
from lightning_het.hsi.prediction import (
    PredictionMapWriter,
    assemble_class_map,
    class_palette,
    write_prediction_geotiff,
    write_prediction_png,
)
from lightning_het.hsi.raster import raster_info, read_image, write_geotiff
from tests.conftest_hsi import quiet_trainer, synthetic_files, torch_single_thread

__all__ = ["synthetic_files", "torch_single_thread"]

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_assemble_class_map():
    out = assemble_class_map(np.array([0, 2, -1]), np.array([0, 1, 1]), np.array([1, 0, 2]), (2, 3), num_classes=3)
    assert out.dtype == np.uint8
    np.testing.assert_array_equal(out, [[0, 1, 0], [3, 0, 0]])
    assert assemble_class_map(np.array([299]), [0], [0], (1, 1)).dtype == np.uint16


def test_palette():
    assert class_palette(3)[0] == (0, 0, 0) and len(class_palette(3)) == 4
    assert len(set(class_palette(40))) == 41


def test_geotiff_and_png(tmp_path):
    class_map = np.random.default_rng(0).integers(0, 4, size=(30, 20)).astype(np.uint8)
    transform = Affine(30.0, 0.0, 300000.0, 0.0, -30.0, 5000000.0)
    tif = write_prediction_geotiff(tmp_path / "map.tif", class_map, crs=CRS.from_epsg(32633), transform=transform)
    with rasterio.open(tif) as ds:
        assert (ds.crs, ds.transform, ds.shape) == (CRS.from_epsg(32633), transform, (30, 20))
        assert (ds.count, ds.nodata) == (1, 0)
        assert ds.colormap(1)[1][:3] == class_palette(3)[1]
        np.testing.assert_array_equal(ds.read(1), class_map)
    png = write_prediction_png(tmp_path / "map.png", class_map, ["water", "crops", "forest"], reference=class_map)
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 1000


def test_full_scene_prediction_keeps_the_input_georeferencing(synthetic_files, tmp_path):
    image, labels = synthetic_files
    cube, info = read_image(image)
    cube[:, 0, 0] = 65535  # one nodata pixel
    nodata_image = write_geotiff(tmp_path / "img.tif", cube, crs=info.crs, transform=info.transform, nodata=65535)
    dm = HyperspectralDataModule(nodata_image, labels, patch_size=3, eval_batch_size=256)
    torch.manual_seed(0)
    model = HSIClassifier("spectral1d")
    writer = PredictionMapWriter(tmp_path / "out", name="pred")
    quiet_trainer(callbacks=[writer]).predict(model, dm, return_predictions=False)
    out = raster_info(tmp_path / "out" / "pred.tif")
    assert (out.crs, out.transform, out.shape) == (info.crs, info.transform, info.shape)
    with rasterio.open(tmp_path / "out" / "pred.tif") as ds:
        values = ds.read(1)
    assert values[0, 0] == 0 and values.reshape(-1)[1:].min() >= 1 and values.max() <= dm.num_classes
    np.testing.assert_array_equal(values, writer.class_map)
    assert (tmp_path / "out" / "pred.png").read_bytes()[:8] == PNG_MAGIC
    assert writer.paths == [tmp_path / "out" / "pred.tif", tmp_path / "out" / "pred.png"]


def test_writer_needs_a_shape(tmp_path):
    loader = torch.utils.data.DataLoader(
        [{"image": torch.zeros(3, 1, 1), "label": torch.tensor(0), "row": torch.tensor(0), "col": torch.tensor(0)}]
    )
    model = HSIClassifier("spectral1d", in_bands=3, num_classes=2, patch_size=1)
    with pytest.raises(RuntimeError, match="does not know the scene shape"):
        quiet_trainer(callbacks=[PredictionMapWriter(tmp_path)]).predict(model, loader)
    writer = PredictionMapWriter(tmp_path, shape=(1, 1), png=False)
    quiet_trainer(callbacks=[writer]).predict(model, loader)
    assert raster_info(tmp_path / "prediction.tif").shape == (1, 1) and writer.paths == [tmp_path / "prediction.tif"]
