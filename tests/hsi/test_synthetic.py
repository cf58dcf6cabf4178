"""Synthetic scenes: determinism, speed, realism checks, GeoTIFF output and the command-line script."""

from __future__ import annotations

import runpy
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from lightning_het.hsi.raster import raster_info, read_image, read_labels
from lightning_het.hsi.splits import dilate
from lightning_het.hsi.synthetic import make_synthetic_scene, write_synthetic_scene

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "make_synthetic_scene.py"


def test_default_scene_shapes_dtypes_and_georeference():
    scene = make_synthetic_scene()
    assert scene.image.shape == (32, 64, 64) and scene.image.dtype == np.uint16
    assert scene.labels.shape == (64, 64) and scene.labels.dtype == np.uint8
    assert set(np.unique(scene.labels)) == set(range(7))  # 0 = unlabelled background, 1..6
    assert 0.08 < np.mean(scene.labels == 0) < 0.25
    assert scene.signatures.shape == (6, 32) and scene.wavelengths[0] == 400 and scene.wavelengths[-1] == 2500
    assert scene.crs.to_epsg() == 32616 and scene.transform.a == 20.0 and scene.transform.e == -20.0
    assert len(scene.class_names) == 6 and scene.shape == (64, 64)


def test_seeded_and_fast():
    start = time.perf_counter()
    a = make_synthetic_scene(seed=5)
    assert time.perf_counter() - start < 0.5  # "well under a second" for 64 x 64 x 32
    b = make_synthetic_scene(seed=5)
    c = make_synthetic_scene(seed=6)
    np.testing.assert_array_equal(a.image, b.image)
    np.testing.assert_array_equal(a.labels, b.labels)
    assert not np.array_equal(a.labels, c.labels)


@pytest.mark.parametrize(("height", "width", "bands", "classes"), [(9, 13, 3, 8), (30, 20, 50, 2), (16, 16, 1, 1)])
def test_configurable_sizes_and_every_class_present(height, width, bands, classes):
    scene = make_synthetic_scene(height, width, bands, classes, dtype="float32", unlabelled_fraction=0.0)
    assert scene.image.shape == (bands, height, width) and scene.image.dtype == np.float32
    assert set(np.unique(scene.labels)) == set(range(1, classes + 1))


def test_spectra_are_smooth_with_water_absorption():
    scene = make_synthetic_scene(bands=211, noise=0.0)  # 10 nm sampling
    sig = scene.signatures
    at = {w: int(np.argmin(np.abs(scene.wavelengths - w))) for w in (1250, 1400, 1650, 1900, 2200)}
    assert np.all(sig[:, at[1400]] < 0.7 * sig[:, at[1250]])
    assert np.all(sig[:, at[1900]] < 0.7 * sig[:, at[1650]])
    assert np.all(sig[:, at[1900]] < 0.7 * sig[:, at[2200]])
    # smooth: band-to-band changes are small compared with the signal
    assert np.median(np.abs(np.diff(sig, axis=1))) < 0.02


def test_boundary_pixels_are_mixed_and_noise_is_present():
    scene = make_synthetic_scene(noise=0.0, unlabelled_fraction=0.0)
    reflectance = scene.image.astype(float) / 10000.0
    labels = scene.labels
    boundary = np.zeros_like(labels, dtype=bool)
    for c in range(1, 7):
        mask = labels == c
        boundary |= mask & dilate(~mask, 1)
    interior = ~dilate(boundary, 2)
    # distance of each pixel to its own class's mean spectrum (relative), interior vs boundary
    dist = np.linalg.norm(reflectance - scene.signatures[labels - 1].transpose(2, 0, 1), axis=0)
    dist /= np.linalg.norm(scene.signatures[labels - 1], axis=-1)
    assert dist[boundary].mean() > 1.5 * dist[interior].mean()
    noisy = make_synthetic_scene(noise=0.02, unlabelled_fraction=0.0)
    assert np.abs(noisy.image.astype(float) - scene.image).mean() > 50  # 0.02 reflectance = 200 DN (std)


def test_invalid_arguments():
    with pytest.raises(ValueError, match="`height` to be an integer >= 2"):
        make_synthetic_scene(height=1)
    with pytest.raises(ValueError, match="`unlabelled_fraction` to be in"):
        make_synthetic_scene(unlabelled_fraction=1.0)
    with pytest.raises(ValueError, match="`dtype`"):
        make_synthetic_scene(dtype="int8")  # type: ignore[arg-type]


def test_write_geotiffs(tmp_path):
    image, labels = write_synthetic_scene(tmp_path / "out", height=20, width=30, bands=5, classes=3, seed=1)
    cube, info = read_image(image)
    gt, classes, gt_info = read_labels(labels)
    scene = make_synthetic_scene(20, 30, 5, 3, seed=1)
    np.testing.assert_array_equal(cube, scene.image)
    np.testing.assert_array_equal(gt, scene.labels)
    assert classes == 3 and info.crs == scene.crs and gt_info.transform == scene.transform
    assert raster_info(image).dtype == "uint16"


def test_script(tmp_path, monkeypatch, capsys):
    out = tmp_path / "scene"
    argv = [str(SCRIPT), "--height", "12", "--width", "10", "--bands", "4", "--classes", "2", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(SCRIPT), run_name="__main__")
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out.split()
    assert printed == [str(out / "image.tif"), str(out / "labels.tif")]
    assert raster_info(out / "image.tif").count == 4 and raster_info(out / "labels.tif").shape == (12, 10)
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--classes", "0", "--out", str(out)])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(SCRIPT), run_name="__main__")
    assert exit_info.value.code == 2 and "`classes`" in capsys.readouterr().err
