"""Spectral preprocessing: nodata masks, per-band standardisation and PCA, all fitted on training pixels only."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["SpectralTransform", "fit_spectral_transform", "valid_mask"]


def valid_mask(values: np.ndarray, nodata: float | None = None) -> np.ndarray:
    """Which pixels of band-first ``values`` ``(bands, ...)`` have a finite spectrum without ``nodata``."""
    ok = np.ones(values.shape[1:], dtype=bool)
    if values.dtype.kind == "f":
        ok &= np.isfinite(values).all(axis=0)
    if nodata is not None and not np.isnan(nodata):
        ok &= (values != nodata).all(axis=0)
    return ok


@dataclass(frozen=True)
class SpectralTransform:
    """``y = components @ ((x - shift) / scale)``: standardisation, then an optional PCA projection."""

    shift: np.ndarray  # (in_bands,): the training mean, or zeros without standardisation nor PCA
    scale: np.ndarray  # (in_bands,): the training standard deviation, or ones; never zero
    components: np.ndarray | None = None  # (out_bands, in_bands) orthonormal PCA rows, decreasing variance
    explained_variance_ratio: np.ndarray | None = None  # (out_bands,) training variance kept by each component

    @property
    def in_bands(self) -> int:
        return int(self.shift.shape[0])

    @property
    def out_bands(self) -> int:
        """Bands produced: the PCA components, or ``in_bands``."""
        return int(self.components.shape[0]) if self.components is not None else self.in_bands

    def __call__(self, values: np.ndarray, valid: np.ndarray | None = None) -> np.ndarray:
        """Transform band-first ``values`` ``(in_bands, ...)`` into ``float32`` ``(out_bands, ...)``; pixels outside
        the ``valid`` mask are replaced by ``shift`` first, so they come out as ``0``."""
        if values.shape[0] != self.in_bands:
            raise ValueError(
                f"Expected an array with {self.in_bands} bands on its first axis, but got shape {values.shape}."
            )
        extra = (1,) * (values.ndim - 1)
        x = values.astype(np.float32)
        if valid is not None and not valid.all():
            x[:, ~valid] = self.shift.astype(np.float32)[:, None]
        x = (x - self.shift.astype(np.float32).reshape(-1, *extra)) / self.scale.astype(np.float32).reshape(-1, *extra)
        if self.components is not None:
            flat = self.components.astype(np.float32) @ x.reshape(self.in_bands, -1)
            x = flat.reshape(self.out_bands, *values.shape[1:])
        return np.ascontiguousarray(x, dtype=np.float32)


def fit_spectral_transform(
    spectra: np.ndarray, *, standardize: bool = True, pca_components: int | None = None
) -> SpectralTransform:
    """Fit the preprocessing on valid training ``spectra`` ``(n, bands)`` only (see ``docs/hyperspectral.md``).

    PCA components are sign-normalised (largest loading positive) so that fits are reproducible.
    """
    data = np.asarray(spectra, dtype=np.float64)
    if data.ndim != 2 or data.shape[0] == 0:
        raise ValueError(f"Expected argument `spectra` to have shape (n >= 1, bands), but got {data.shape}.")
    bands = data.shape[1]
    if pca_components is not None and not 1 <= pca_components <= bands:
        raise ValueError(
            f"You set pca_components={pca_components}, but the image has {bands} bands. HINT: choose a number in"
            f" 1..{bands}, or None to keep every band."
        )
    mean = data.mean(axis=0)
    std = data.std(axis=0)
    center = standardize or pca_components is not None
    shift = mean if center else np.zeros(bands)
    scale = np.where(std > 0, std, 1.0) if standardize else np.ones(bands)
    if pca_components is None:
        return SpectralTransform(shift=shift, scale=scale)
    z = (data - shift) / scale
    cov = z.T @ z / max(z.shape[0] - 1, 1)
    eigval, eigvec = np.linalg.eigh(cov)
    order = np.argsort(eigval)[::-1][:pca_components]
    components = eigvec[:, order].T
    signs = np.sign(components[np.arange(pca_components), np.argmax(np.abs(components), axis=1)])
    components = components * np.where(signs == 0, 1.0, signs)[:, None]
    total = float(np.clip(eigval, 0, None).sum())
    ratio = np.clip(eigval[order], 0, None) / total if total > 0 else np.zeros(pca_components)
    return SpectralTransform(shift=shift, scale=scale, components=components, explained_variance_ratio=ratio)
