"""Spectral preprocessing: nodata masks, standardisation fitted on training pixels, PCA."""

from __future__ import annotations

import numpy as np
import pytest

from lightning_het.hsi.preprocessing import fit_spectral_transform, valid_mask


def _spectra(n: int = 200, bands: int = 6, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    mixing = rng.normal(size=(3, bands))
    return (rng.normal(size=(n, 3)) @ mixing * [1, 5, 10, 50, 100, 500][:bands] + 1000).astype(np.uint16)


class TestValidMask:
    def test_nan_inf_and_nodata(self):
        cube = np.ones((3, 2, 4), dtype=np.float32)
        cube[1, 0, 0] = np.nan
        cube[2, 1, 3] = np.inf
        cube[0, 1, 1] = -9999
        np.testing.assert_array_equal(valid_mask(cube, -9999), [[False, True, True, True], [True, False, True, False]])
        assert valid_mask(cube, np.nan).sum() == 6  # NaN nodata is covered by the finiteness test

    def test_integer_nodata(self):
        cube = np.full((2, 3), 7, dtype=np.uint16)
        cube[0, 1] = 0
        np.testing.assert_array_equal(valid_mask(cube, 0), [True, False, True])
        assert valid_mask(cube, None).all()


class TestStandardisation:
    def test_training_pixels_become_zero_mean_unit_std(self):
        train = _spectra()
        t = fit_spectral_transform(train)
        z = t(train.T)  # band-first
        assert z.dtype == np.float32 and z.shape == (6, 200)
        np.testing.assert_allclose(z.mean(axis=1), 0, atol=1e-4)
        np.testing.assert_allclose(z.std(axis=1), 1, atol=1e-4)

    def test_fit_uses_only_what_it_is_given(self):
        train, other = _spectra(seed=0), _spectra(seed=1) + 300
        t = fit_spectral_transform(train)
        np.testing.assert_allclose(t.shift, train.mean(axis=0))
        assert np.abs(t(other.T).mean(axis=1)).min() > 0.5  # other pixels are *not* centred

    def test_constant_band_and_no_standardisation(self):
        train = _spectra().astype(np.float64)
        train[:, 2] = 5.0
        t = fit_spectral_transform(train)
        assert t.scale[2] == 1.0 and np.all(t(train.T)[2] == 0)
        raw = fit_spectral_transform(train, standardize=False)
        np.testing.assert_array_equal(raw(train.T), train.T.astype(np.float32))

    def test_invalid_pixels_are_filled_with_zero(self):
        train = _spectra()
        t = fit_spectral_transform(train)
        cube = np.stack([train[:10].T.reshape(6, 2, 5)] * 1)[0].astype(np.float32)
        cube[3, 1, 2] = np.nan
        out = t(cube, valid_mask(cube))
        assert np.all(out[:, 1, 2] == 0) and np.isfinite(out).all()

    def test_shapes_are_checked(self):
        t = fit_spectral_transform(_spectra())
        with pytest.raises(ValueError, match="6 bands on its first axis"):
            t(np.zeros((5, 3, 3)))
        with pytest.raises(ValueError, match=r"shape \(n >= 1, bands\)"):
            fit_spectral_transform(np.zeros((0, 6)))


class TestPCA:
    def test_components_match_svd_and_are_ordered(self):
        train = _spectra()
        t = fit_spectral_transform(train, pca_components=3)
        assert t.out_bands == 3 and t.in_bands == 6
        np.testing.assert_allclose(t.components @ t.components.T, np.eye(3), atol=1e-10)
        assert np.all(np.diff(t.explained_variance_ratio) <= 0) and t.explained_variance_ratio.sum() > 0.99
        z = (train - train.mean(0)) / train.std(0)
        _, _, vt = np.linalg.svd(z, full_matrices=False)
        np.testing.assert_allclose(np.abs(t.components), np.abs(vt[:3]), atol=1e-8)

    def test_projection_of_cube_and_patch_agree(self):
        train = _spectra()
        t = fit_spectral_transform(train, pca_components=2)
        cube = train[:60].T.reshape(6, 6, 10)
        np.testing.assert_allclose(t(cube)[:, 1:4, 2:5], t(cube[:, 1:4, 2:5]), rtol=1e-5, atol=1e-5)
        projected = t(train.T)
        np.testing.assert_allclose(projected.mean(axis=1), 0, atol=1e-4)
        assert projected.var(axis=1)[0] > projected.var(axis=1)[1]

    def test_too_many_components(self):
        with pytest.raises(ValueError, match=r"pca_components=7, but the image has 6 bands.*HINT"):
            fit_spectral_transform(_spectra(), pca_components=7)

    def test_deterministic_signs(self):
        a = fit_spectral_transform(_spectra(), pca_components=3).components
        b = fit_spectral_transform(_spectra()[::-1], pca_components=3).components
        np.testing.assert_allclose(a, b, atol=1e-8)
