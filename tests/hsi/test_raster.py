"""Raster I/O: GeoTIFF / ENVI / .mat round trips, validation errors, windowed and scattered reads."""

from __future__ import annotations

import pickle
import sys

import numpy as np
import pytest
import rasterio
import scipy.io
from rasterio.crs import CRS
from rasterio.transform import Affine

from lightning_het.hsi.errors import (
    GeoreferenceMismatchError,
    LabelValueError,
    MatFileError,
    RasterFormatError,
    RasterNotFoundError,
    ShapeMismatchError,
)
from lightning_het.hsi.matfile import read_mat_scene
from lightning_het.hsi.raster import (
    RasterHandle,
    check_alignment,
    raster_info,
    read_image,
    read_labels,
    read_pixels,
    read_window,
    reflect_indices,
    write_geotiff,
)
from tests.conftest_hsi import BANDS, CLASSES, HEIGHT, TRANSFORM, UTM, WIDTH, raster_pair, small_arrays

__all__ = ["raster_pair"]  # fixture used below


class TestRoundTrip:
    @pytest.mark.parametrize("dtype", ["uint16", "int16", "float32", "float64"])
    def test_geotiff(self, tmp_path, dtype):
        cube, _ = small_arrays(dtype=dtype)
        path = write_geotiff(tmp_path / "x.tif", cube, crs=UTM, transform=TRANSFORM, band_descriptions=list("abcdefg"))
        data, info = read_image(path)
        assert data.shape == (BANDS, HEIGHT, WIDTH) and data.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(data, cube)
        assert (info.count, info.height, info.width, info.dtype) == (BANDS, HEIGHT, WIDTH, dtype)
        assert info.crs == UTM and info.transform == TRANSFORM and info.driver == "GTiff" and info.georeferenced
        with rasterio.open(path) as ds:
            assert ds.descriptions[0] == "a"

    def test_envi(self, tmp_path):
        cube, labels = small_arrays()
        profile = {"driver": "ENVI", "height": HEIGHT, "width": WIDTH, "crs": UTM, "transform": TRANSFORM}
        with rasterio.open(tmp_path / "scene.img", "w", count=BANDS, dtype="uint16", **profile) as dst:
            dst.write(cube)
        with rasterio.open(tmp_path / "gt.img", "w", count=1, dtype="uint8", **profile) as dst:
            dst.write(labels[None])
        data, info = read_image(tmp_path / "scene.img")
        assert info.driver == "ENVI" and data.dtype == np.uint16 and data.shape == (BANDS, HEIGHT, WIDTH)
        np.testing.assert_array_equal(data, cube)
        gt, classes, gt_info = read_labels(tmp_path / "gt.img")
        assert gt.dtype == np.int64 and classes == CLASSES
        np.testing.assert_array_equal(gt, labels)
        check_alignment(info, gt_info)  # ENVI writes -0.0 rotation terms: still aligned

    def test_not_georeferenced(self, tmp_path):
        cube, _ = small_arrays()
        info = raster_info(write_geotiff(tmp_path / "plain.tif", cube))
        assert info.crs is None and info.transform is None and not info.georeferenced

    def test_label_nodata_becomes_unlabelled(self, tmp_path):
        _, labels = small_arrays()
        labels[5, 5] = 255
        gt, classes, _ = read_labels(write_geotiff(tmp_path / "gt.tif", labels, nodata=255))
        assert gt[5, 5] == 0 and classes == CLASSES


class TestErrors:
    def test_missing_file_names_it(self, tmp_path):
        with pytest.raises(RasterNotFoundError, match=r"image file .*nope.tif.* does not exist") as err:
            read_image(tmp_path / "nope.tif")
        assert isinstance(err.value, FileNotFoundError)

    def test_not_a_raster(self, tmp_path):
        (tmp_path / "notes.txt").write_text("hello")
        with pytest.raises(RasterFormatError, match=r"notes.txt.*GDAL cannot open"):
            raster_info(tmp_path / "notes.txt")

    def test_multiband_labels(self, raster_pair):
        image, *_ = raster_pair
        with pytest.raises(RasterFormatError, match=r"image.tif.*must have one band, but it has 7"):
            read_labels(image)

    def test_label_above_class_count(self, raster_pair):
        _, labels, *_ = raster_pair
        with pytest.raises(LabelValueError, match=r"labels.tif.*values \[3\] outside 0 \(unlabelled\) and 1..2"):
            read_labels(labels, num_classes=2)

    def test_negative_and_fractional_labels(self, tmp_path):
        bad = np.zeros((4, 4), dtype=np.float32)
        bad[0, 0], bad[1, 1] = 1.5, -2
        with pytest.raises(LabelValueError, match=r"gt.tif.*\[-2.0, 1.5\]"):
            read_labels(write_geotiff(tmp_path / "gt.tif", bad))

    def test_float_labels_name_the_file_and_ask_for_integers(self, tmp_path):
        """A float map (probabilities, a bilinearly resampled class map) has no integer class to infer a count from:
        the message says labels must be integers, not "outside 0 (unlabelled) and 1..0"."""
        soft = np.full((4, 4), 0.25, dtype=np.float32)
        soft[0, 0] = 0.75
        with pytest.raises(LabelValueError, match=r"gt.tif.*\[0.25, 0.75\].*labels must be integers") as info:
            read_labels(write_geotiff(tmp_path / "gt.tif", soft))
        assert "1..0" not in str(info.value) and info.value.non_integer
        with pytest.raises(LabelValueError, match=r"outside 0 \(unlabelled\) and 1..C\. HINT") as info:
            read_labels(write_geotiff(tmp_path / "neg.tif", np.full((4, 4), -1, dtype=np.int16)))
        assert "1..0" not in str(info.value)

    def test_shape_mismatch_names_both_files_and_shapes(self, raster_pair, tmp_path):
        image, *_ = raster_pair
        other = write_geotiff(tmp_path / "small.tif", np.ones((10, 12), np.uint8), crs=UTM, transform=TRANSFORM)
        with pytest.raises(ShapeMismatchError, match=r"image.tif.* is 24x20 .*small.tif.* are 10x12"):
            check_alignment(raster_info(image), raster_info(other, "labels"))

    def test_crs_mismatch(self, raster_pair, tmp_path):
        image, _, _, labels = raster_pair
        other = write_geotiff(tmp_path / "wgs.tif", labels, crs=CRS.from_epsg(4326), transform=TRANSFORM)
        with pytest.raises(GeoreferenceMismatchError, match=r"different CRSs: 'EPSG:32616' vs 'EPSG:4326'"):
            check_alignment(raster_info(image), raster_info(other))

    def test_transform_mismatch_and_ungeoreferenced_is_aligned(self, raster_pair, tmp_path):
        image, _, _, labels = raster_pair
        shifted = write_geotiff(tmp_path / "s.tif", labels, crs=UTM, transform=Affine(20, 0, 500020, 0, -20, 4400000))
        with pytest.raises(GeoreferenceMismatchError, match="different transforms"):
            check_alignment(raster_info(image), raster_info(shifted))
        check_alignment(raster_info(image), raster_info(write_geotiff(tmp_path / "plain.tif", labels)))

    def test_errors_pickle(self):
        err = ShapeMismatchError("a.tif", (1, 2), "b.tif", (3, 4))
        assert str(pickle.loads(pickle.dumps(err))) == str(err)


class TestWindows:
    def test_reflect_indices_match_numpy(self):
        for length in (1, 2, 3, 7):
            padded = np.pad(np.arange(length), 9, mode="reflect")
            for start in range(-9, length):
                np.testing.assert_array_equal(reflect_indices(start, 5, length), padded[start + 9 : start + 14])

    @pytest.mark.parametrize("size", [1, 3, 7])
    def test_read_window_is_reflect_padding(self, raster_pair, size):
        image, _, cube, _ = raster_pair
        half = size // 2
        padded = np.pad(cube, ((0, 0), (half, half), (half, half)), mode="reflect")
        with rasterio.open(image) as ds:
            for row, col in [(0, 0), (HEIGHT - 1, WIDTH - 1), (0, WIDTH - 1), (5, 7), (1, 18)]:
                expected = padded[:, row : row + size, col : col + size]
                np.testing.assert_array_equal(read_window(ds, row, col, size), expected)

    def test_read_pixels_in_strips(self, raster_pair):
        image, _, cube, _ = raster_pair
        rng = np.random.default_rng(1)
        rows, cols = rng.integers(0, HEIGHT, 50), rng.integers(0, WIDTH, 50)
        with rasterio.open(image) as ds:
            got = read_pixels(ds, rows, cols, strip_bytes=WIDTH * BANDS * 2 * 3)  # 3 rows per strip
        np.testing.assert_array_equal(got, cube[:, rows, cols].T)

    def test_handle_is_lazy_picklable_and_reopens_in_a_new_process(self, raster_pair):
        image, *_ = raster_pair
        handle = RasterHandle(image)
        assert handle._dataset is None
        first = handle.dataset
        assert handle.dataset is first
        clone = pickle.loads(pickle.dumps(handle))
        assert clone._dataset is None and clone.dataset.count == BANDS
        handle._pid = -1  # as if we were a forked child
        assert handle.dataset is not first
        handle.close()
        clone.close()


class TestMat:
    def _cube_hwb(self):
        cube, labels = small_arrays()
        return np.moveaxis(cube, 0, -1), labels, cube

    def test_pair_of_files(self, tmp_path):
        hwb, labels, cube = self._cube_hwb()
        scipy.io.savemat(tmp_path / "Scene.mat", {"scene_corrected": hwb})
        scipy.io.savemat(tmp_path / "Scene_gt.mat", {"scene_gt": labels})
        got, gt, classes = read_mat_scene(tmp_path / "Scene.mat", tmp_path / "Scene_gt.mat")
        assert got.shape == (BANDS, HEIGHT, WIDTH) and got.dtype == np.uint16 and classes == CLASSES
        np.testing.assert_array_equal(got, cube)
        np.testing.assert_array_equal(gt, labels)

    def test_one_file_band_first_with_distractors(self, tmp_path):
        _, labels, cube = self._cube_hwb()
        scipy.io.savemat(tmp_path / "both.mat", {"cube": cube, "gt": labels, "wavelength": np.arange(7.0)})
        got, gt, _ = read_mat_scene(tmp_path / "both.mat")
        np.testing.assert_array_equal(got, cube)
        np.testing.assert_array_equal(gt, labels)

    def test_ambiguous_and_unmatched(self, tmp_path):
        hwb, labels, _ = self._cube_hwb()
        scipy.io.savemat(tmp_path / "two.mat", {"a": hwb, "b": hwb, "gt": labels})
        with pytest.raises(MatFileError, match=r"two.mat.*several .* pairs"):
            read_mat_scene(tmp_path / "two.mat")
        read_mat_scene(tmp_path / "two.mat", image_key="b")  # explicit key resolves it
        scipy.io.savemat(tmp_path / "odd.mat", {"a": hwb, "gt": labels[:5]})
        with pytest.raises(MatFileError, match=r"no 3-D cube .* Variables found: a\[24, 20, 7\], gt\[5, 20\]"):
            read_mat_scene(tmp_path / "odd.mat")
        with pytest.raises(ShapeMismatchError, match=r"odd.mat.* is 24x20 .* are 5x20"):
            read_mat_scene(tmp_path / "odd.mat", image_key="a", labels_key="gt")
        with pytest.raises(MatFileError, match="'nope' requested"):
            read_mat_scene(tmp_path / "odd.mat", image_key="nope")

    def test_v73_and_missing_scipy(self, tmp_path, monkeypatch):
        header = b"MATLAB 7.3 MAT-file, Platform: GLNXA64, Created on: Mon Jan  1 00:00:00 2024 HDF5 schema 1.00 ."
        (tmp_path / "v73.mat").write_bytes(header.ljust(116) + b"\0" * 8 + b"\x00\x02IM" + b"\0" * 64)
        with pytest.raises(MatFileError, match=r"v73.mat.*MATLAB version.*'-v7'"):
            read_mat_scene(tmp_path / "v73.mat")
        with pytest.raises(RasterNotFoundError, match="labels file"):
            read_mat_scene(tmp_path / "v73.mat", tmp_path / "gt.mat")
        monkeypatch.setitem(sys.modules, "scipy.io", None)
        with pytest.raises(ImportError, match=r"needs scipy.*lightning-het\[mat\]"):
            read_mat_scene(tmp_path / "v73.mat")
