"""Patch datasets (in memory vs windowed) and HyperspectralDataModule: shapes, equivalence, errors."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import scipy.io
import torch
from rasterio.crs import CRS
from torch.utils.data import DataLoader

from lightning_het.hsi import HyperspectralDataModule
from lightning_het.hsi.datasets import InMemoryPatches, PatchDataset, WindowedPatches
from lightning_het.hsi.errors import (
    ClassTooSmallError,
    GeoreferenceMismatchError,
    LabelValueError,
    NoLabelledPixelsError,
    RasterNotFoundError,
    ShapeMismatchError,
)
from lightning_het.hsi.preprocessing import fit_spectral_transform
from lightning_het.hsi.raster import write_geotiff
from tests.conftest_hsi import (
    BANDS,
    CLASSES,
    HEIGHT,
    TRANSFORM,
    UTM,
    WIDTH,
    raster_pair,
    small_arrays,
    synthetic_files,
    torch_single_thread,
)

__all__ = ["raster_pair", "synthetic_files", "torch_single_thread"]


class _CountingDataset:
    """Wraps a rasterio dataset and records every window read."""

    def __init__(self, dataset):
        self._dataset = dataset
        self.windows = []

    def read(self, *args, window=None, **kwargs):
        self.windows.append(window)
        return self._dataset.read(*args, window=window, **kwargs)

    def __getattr__(self, name):
        return getattr(self._dataset, name)


class TestPatchSources:
    @pytest.mark.parametrize("pca", [None, 3])
    def test_windowed_equals_in_memory_everywhere(self, raster_pair, pca):
        image, _, cube, _ = raster_pair
        transform = fit_spectral_transform(cube.reshape(BANDS, -1).T[::3], pca_components=pca)
        memory = InMemoryPatches(cube, 5, transform)
        windowed = WindowedPatches(image, 5, transform)
        assert memory.bands == windowed.bands == (pca or BANDS) and memory.shape == windowed.shape == (HEIGHT, WIDTH)
        for row in range(HEIGHT):
            for col in range(WIDTH):
                a, va = memory.read(row, col)
                b, vb = windowed.read(row, col)
                assert a.shape == (pca or BANDS, 5, 5) and va and vb
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
        windowed.handle.close()

    def test_windowed_reads_only_the_window(self, raster_pair):
        image, *_ = raster_pair
        source = WindowedPatches(image, 3)
        spy = _CountingDataset(source.handle.dataset)
        source.handle._dataset = spy
        for row, col in [(0, 0), (10, 10), (HEIGHT - 1, 4)]:
            source.read(row, col)
        assert len(spy.windows) == 3 and all(w.width <= 3 and w.height <= 3 for w in spy.windows)
        source.handle._dataset = spy._dataset
        source.handle.close()

    def test_nodata_is_zero_filled_and_flagged(self, tmp_path):
        cube, _ = small_arrays()
        cube[:, 4, 4] = 0
        path = write_geotiff(tmp_path / "nd.tif", cube, nodata=0)
        transform = fit_spectral_transform(cube.reshape(BANDS, -1).T[1:100])
        for source in (InMemoryPatches(cube, 3, transform, nodata=0), WindowedPatches(path, 3, transform)):
            patch, valid = source.read(4, 4)
            assert not valid and np.all(patch[:, 1, 1] == 0)
            patch, valid = source.read(4, 5)
            assert valid and np.all(patch[:, 1, 0] == 0)

    def test_even_patch_size_is_rejected(self):
        with pytest.raises(ValueError, match=r"`patch_size` to be odd.*HINT: use 3 or 5"):
            InMemoryPatches(np.zeros((2, 8, 8)), 4)


class TestPatchDataset:
    def test_sample_dict(self, raster_pair):
        _, _, cube, labels = raster_pair
        flat = np.array([0, 5 * WIDTH + 7])
        ds = PatchDataset(InMemoryPatches(cube, 3), flat, labels.reshape(-1)[flat] - 1)
        sample = ds[1]
        assert set(sample) == {"image", "label", "row", "col", "valid"}
        assert sample["image"].shape == (BANDS, 3, 3) and sample["image"].dtype == torch.float32
        assert (int(sample["row"]), int(sample["col"])) == (5, 7)
        assert int(sample["label"]) == labels[5, 7] - 1 and bool(sample["valid"])
        torch.testing.assert_close(sample["image"][:, 1, 1], torch.from_numpy(cube[:, 5, 7].astype(np.float32)))
        batch = next(iter(DataLoader(ds, batch_size=2)))
        assert batch["image"].shape == (2, BANDS, 3, 3) and batch["label"].dtype == torch.int64

    def test_unlabelled_default_and_checks(self, raster_pair):
        _, _, cube, _ = raster_pair
        source = InMemoryPatches(cube, 1)
        assert int(PatchDataset(source, [3])[0]["label"]) == -1
        with pytest.raises(ValueError, match="one entry per index"):
            PatchDataset(source, [1, 2], [0])
        with pytest.raises(ValueError, match=r"must lie in \[0, 480\)"):
            PatchDataset(source, [480])

    def test_windowed_dataset_pickles_and_works_in_forked_workers(self, raster_pair):
        image, *_ = raster_pair
        ds = PatchDataset(WindowedPatches(image, 3), np.arange(40))
        ds[0]  # opens the file in this process
        clone = pickle.loads(pickle.dumps(ds))
        torch.testing.assert_close(clone[5]["image"], ds[5]["image"])
        loader = DataLoader(ds, batch_size=8, num_workers=2, multiprocessing_context="fork")
        rows = torch.cat([b["row"] for b in loader])
        assert rows.tolist() == (np.arange(40) // WIDTH).tolist()
        ds.source.handle.close()
        clone.source.handle.close()


class TestDataModuleConstruction:
    @pytest.mark.parametrize(
        ("kwargs", "message"),
        [
            ({"labels": "gt.tif"}, "You set labels='gt.tif', but no `image`"),
            ({"image": "x.tif"}, "no `labels` raster"),
            ({"split": "kfold"}, "`split` to be 'random' or 'blocks'"),
            ({"patch_size": 4}, "`patch_size` to be odd"),
            ({"train_fraction": 0.7, "val_fraction": 0.3}, "must sum to less than 1"),
            ({"train_fraction": 0.0}, r"`train_fraction` to be in \(0, 1\)"),
            ({"train_per_class": 0}, "`train_per_class` to be an integer >= 1"),
            ({"in_memory": False}, "synthetic scenes exist only in memory"),
            ({"image": "a.mat", "in_memory": False}, "is a .mat file"),
            ({"image": "a.tif", "labels": "b.tif", "synthetic": {}}, "both `image` and `synthetic`"),
            ({"num_classes": 3, "class_names": ["a"]}, "num_classes=3, but gave 1 class_names"),
            ({"pca_components": 0}, "`pca_components` to be an integer >= 1 or None"),
            ({"global_batch_size": 0}, "`global_batch_size`"),
        ],
    )
    def test_bad_values_fail_at_construction(self, kwargs, message):
        with pytest.raises(ValueError, match=message):
            HyperspectralDataModule(**kwargs)


class TestDataModuleScenes:
    def test_synthetic_default(self):
        dm = HyperspectralDataModule(synthetic={"height": 32, "width": 30, "bands": 10, "classes": 4}, patch_size=3)
        dm.setup("fit")
        assert (dm.num_bands, dm.num_classes, dm.patch_size, dm.shape) == (10, 4, 3, (32, 30))
        assert dm.class_names == ["class_1", "class_2", "class_3", "class_4"]
        assert dm.crs == CRS.from_epsg(32616) and dm.transform.a == 20.0
        n_labelled = int(np.count_nonzero(dm.scene.labels))
        assert len(dm.train_dataset) + len(dm.val_dataset) + len(dm.test_dataset) == n_labelled
        assert len(dm.predict_dataset) == 32 * 30
        counts = dm.class_counts
        assert all(n > 0 for n in counts["train"]) and sum(counts["train"]) == len(dm.train_dataset)
        sample = dm.train_dataset[0]
        assert sample["image"].shape == (10, 3, 3) and 0 <= int(sample["label"]) < 4

    def test_standardisation_is_fitted_on_training_pixels_only(self):
        dm = HyperspectralDataModule(synthetic={"height": 24, "width": 24, "bands": 5, "classes": 3}, patch_size=1)
        dm.setup()
        images = torch.stack([dm.train_dataset[i]["image"][:, 0, 0] for i in range(len(dm.train_dataset))])
        torch.testing.assert_close(images.mean(0), torch.zeros(5), atol=1e-4, rtol=0)
        others = torch.stack([dm.test_dataset[i]["image"][:, 0, 0] for i in range(len(dm.test_dataset))])
        assert others.mean(0).abs().max() > 1e-3  # not re-centred on the test pixels

    def test_geotiff_in_memory_and_windowed_serve_the_same_samples(self, synthetic_files):
        image, labels = synthetic_files
        kwargs = {"patch_size": 5, "pca_components": 4, "split": "blocks", "block_size": 12, "seed": 1}
        memory = HyperspectralDataModule(image, labels, in_memory=True, **kwargs)
        windowed = HyperspectralDataModule(image, labels, memory_budget=0, **kwargs)  # too big for the budget
        memory.setup()
        windowed.setup()
        assert isinstance(memory.scene.source, InMemoryPatches)
        assert isinstance(windowed.scene.source, WindowedPatches)
        assert memory.num_bands == windowed.num_bands == 4 and memory.crs == windowed.crs == UTM
        np.testing.assert_array_equal(memory.scene.split.test, windowed.scene.split.test)
        for i in range(0, len(memory.test_dataset), 37):
            a, b = memory.test_dataset[i], windowed.test_dataset[i]
            torch.testing.assert_close(a["image"], b["image"], atol=1e-5, rtol=1e-5)
            assert int(a["label"]) == int(b["label"])
        windowed.scene.source.handle.close()

    def test_mat_pair(self, tmp_path):
        cube, labels = small_arrays()
        scipy.io.savemat(tmp_path / "scene.mat", {"scene": np.moveaxis(cube, 0, -1)})
        scipy.io.savemat(tmp_path / "scene_gt.mat", {"scene_gt": labels})
        dm = HyperspectralDataModule(
            tmp_path / "scene.mat", tmp_path / "scene_gt.mat", patch_size=3, train_per_class=5, val_per_class=2
        )
        dm.prepare_data()
        dm.setup()
        assert (dm.num_bands, dm.num_classes, dm.shape, dm.crs, dm.transform) == (
            BANDS,
            CLASSES,
            (HEIGHT, WIDTH),
            None,
            None,
        )
        assert dm.class_counts["train"] == [5] * CLASSES and dm.class_counts["val"] == [2] * CLASSES

    def test_nodata_labelled_pixels_are_dropped(self, tmp_path):
        cube, labels = small_arrays()
        cube[:, labels == 2] = 65535
        image = write_geotiff(tmp_path / "img.tif", cube, crs=UTM, transform=TRANSFORM, nodata=65535)
        gt = write_geotiff(tmp_path / "gt.tif", labels, crs=UTM, transform=TRANSFORM)
        dm = HyperspectralDataModule(image, gt, num_classes=3, patch_size=3)
        dm.setup()
        assert dm.class_counts["train"][1] == 0 and dm.scene.labels[labels == 2].max() == 0
        sample = dm.predict_dataset[int(np.argmax(labels.reshape(-1) == 2))]
        assert not bool(sample["valid"])


class TestDataModuleFileErrors:
    def test_missing_file(self, raster_pair, tmp_path):
        image, *_ = raster_pair
        dm = HyperspectralDataModule(image, tmp_path / "missing_gt.tif")
        with pytest.raises(RasterNotFoundError, match=r"labels file .*missing_gt.tif"):
            dm.prepare_data()
        with pytest.raises(RasterNotFoundError, match=r"missing_gt.tif"):
            dm.setup()

    def test_shape_mismatch(self, raster_pair, tmp_path):
        image, _, _, labels = raster_pair
        gt = write_geotiff(tmp_path / "crop.tif", labels[:10], crs=UTM, transform=TRANSFORM)
        with pytest.raises(ShapeMismatchError, match=r"image.tif' is 24x20 .*crop.tif' are 10x20"):
            HyperspectralDataModule(image, gt).setup()

    def test_crs_mismatch(self, raster_pair, tmp_path):
        image, _, _, labels = raster_pair
        gt = write_geotiff(tmp_path / "gt4326.tif", labels, crs="EPSG:4326", transform=TRANSFORM)
        with pytest.raises(GeoreferenceMismatchError, match=r"gt4326.tif.*different CRSs"):
            HyperspectralDataModule(image, gt).prepare_data()

    def test_labels_above_class_count(self, raster_pair):
        image, gt, *_ = raster_pair
        with pytest.raises(LabelValueError, match=r"labels.tif.*\[3\] outside 0 \(unlabelled\) and 1..2"):
            HyperspectralDataModule(image, gt, class_names=["a", "b"]).setup()

    def test_no_labelled_pixels(self, raster_pair, tmp_path):
        image, _, _, labels = raster_pair
        gt = write_geotiff(tmp_path / "zeros.tif", np.zeros_like(labels), crs=UTM, transform=TRANSFORM)
        with pytest.raises(NoLabelledPixelsError, match=r"zeros.tif' contain no labelled pixel"):
            HyperspectralDataModule(image, gt).setup()

    def test_class_too_small(self, raster_pair, tmp_path):
        image, _, _, labels = raster_pair
        labels = labels.copy()
        labels[labels == 3] = 0
        labels[0, 0] = 3
        gt = write_geotiff(tmp_path / "rare.tif", labels, crs=UTM, transform=TRANSFORM)
        with pytest.raises(ClassTooSmallError, match=r"Class 3 of the labels .*rare.tif' has 1 usable pixel"):
            HyperspectralDataModule(image, gt).setup()
