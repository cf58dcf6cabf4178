"""Seeded synthetic hyperspectral scenes: the embedded default data and the test fixtures."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from rasterio.crs import CRS
from rasterio.transform import Affine

from lightning_het.arguments import positive_int
from lightning_het.hsi.raster import write_geotiff

__all__ = ["SyntheticScene", "make_synthetic_scene", "write_synthetic_scene"]

#: Scale between reflectance and the stored ``uint16`` digital numbers.
DN_SCALE = 10000.0
_WATER_BANDS_NM = ((1400.0, 60.0, 0.6), (1900.0, 80.0, 0.75), (970.0, 25.0, 0.08), (1150.0, 35.0, 0.12))


@dataclass
class SyntheticScene:
    """A synthetic scene and the truth it was drawn from."""

    image: np.ndarray  # (bands, height, width), uint16 digital numbers or float32 reflectance
    labels: np.ndarray  # (height, width) uint8/uint16; 0 = unlabelled background, 1..classes
    wavelengths: np.ndarray  # (bands,) band centres in nanometres
    signatures: np.ndarray  # (classes, bands) mean reflectance of each class (before mixing and noise)
    class_names: list[str]
    crs: CRS
    transform: Affine  # pixel-to-map, north-up, square pixels

    @property
    def shape(self) -> tuple[int, int]:
        """``(height, width)`` in pixels."""
        return (int(self.labels.shape[0]), int(self.labels.shape[1]))


def _gaussian(x: np.ndarray, centre: float, width: float) -> np.ndarray:
    return np.exp(-0.5 * ((x - centre) / width) ** 2)


def _water_absorption(wavelengths: np.ndarray) -> np.ndarray:
    """Relative depth (0..1) of the atmospheric water absorption at each wavelength, shape ``(bands,)``."""
    depth = np.zeros_like(wavelengths)
    for centre, width, strength in _WATER_BANDS_NM:
        depth = np.maximum(depth, strength * _gaussian(wavelengths, centre, width))
    return depth


def _continuum(rng: np.random.Generator, wavelengths: np.ndarray) -> np.ndarray:
    """A smooth random reflectance continuum, shape ``(bands,)``, roughly in 0.05..0.6."""
    lam = (wavelengths - 400.0) / 2100.0
    base = rng.uniform(0.05, 0.25) + rng.uniform(-0.1, 0.1) * lam
    edge = rng.uniform(0.0, 0.35) / (1.0 + np.exp(-(wavelengths - rng.uniform(690, 740)) / rng.uniform(8, 20)))
    bumps = sum(
        rng.uniform(-0.08, 0.12) * _gaussian(wavelengths, rng.uniform(450, 2400), rng.uniform(80, 300))
        for _ in range(3)
    )
    return base + edge + bumps


def _class_signatures(rng: np.random.Generator, wavelengths: np.ndarray, classes: int) -> np.ndarray:
    """Two variants per material, shape ``(2, classes + 1, bands)``; material 0 is the unlabelled background."""
    families = [_continuum(rng, wavelengths) for _ in range(math.ceil((classes + 1) / 2))]
    water = _water_absorption(wavelengths)
    variants = np.empty((2, classes + 1, wavelengths.size))
    for material in range(classes + 1):
        smooth = families[material // 2] + 0.04 * sum(
            rng.normal() * _gaussian(wavelengths, rng.uniform(400, 2500), rng.uniform(100, 400)) for _ in range(3)
        )
        for _ in range(2):  # class-specific narrow absorptions (pigments, minerals)
            smooth = smooth * (1 - rng.uniform(0.1, 0.35) * _gaussian(wavelengths, rng.uniform(450, 2450), 30.0))
        smooth = smooth * (1.0 - water)
        for v, sign in enumerate((-1.0, 1.0)):
            wiggle = sign * 0.025 * _gaussian(wavelengths, rng.uniform(400, 2500), rng.uniform(200, 600))
            variants[v, material] = smooth * (1.0 + wiggle / max(float(smooth.mean()), 1e-3))
    return np.clip(variants, 0.01, 0.95)


def _smooth_fields(rng: np.random.Generator, count: int, shape: tuple[int, int], scale: float) -> np.ndarray:
    """``count`` unit-variance Gaussian random fields of correlation length ``scale`` pixels, ``(count, H, W)``."""
    noise = rng.standard_normal((count, *shape))
    fy = np.fft.fftfreq(shape[0])[:, None]
    fx = np.fft.rfftfreq(shape[1])[None, :]
    gain = np.exp(-2.0 * (math.pi * scale) ** 2 * (fx**2 + fy**2))
    fields = np.fft.irfft2(np.fft.rfft2(noise) * gain, s=shape)
    fields -= fields.mean(axis=(1, 2), keepdims=True)
    return fields / (fields.std(axis=(1, 2), keepdims=True) + 1e-12)


def _blur(x: np.ndarray, sigma: float) -> np.ndarray:
    """Separable Gaussian blur of the last two axes with reflect borders; ``sigma`` in pixels (0 = no blur)."""
    if sigma <= 0:
        return x
    radius = max(1, math.ceil(3 * sigma))
    taps = np.exp(-0.5 * (np.arange(-radius, radius + 1) / sigma) ** 2)
    taps /= taps.sum()
    for axis in (-2, -1):
        n = x.shape[axis]
        pad = [(0, 0)] * x.ndim
        pad[axis] = (radius, radius)
        padded = np.pad(x, pad, mode="reflect" if n > radius else "edge")
        out = np.zeros_like(x)
        for k, w in enumerate(taps):
            out += w * np.take(padded, np.arange(k, k + n), axis=axis)
        x = out
    return x


def make_synthetic_scene(
    height: int = 64,
    width: int = 64,
    bands: int = 32,
    classes: int = 6,
    *,
    seed: int = 0,
    noise: float = 0.02,
    region_scale: float = 6.0,
    boundary_mixing: float = 0.8,
    unlabelled_fraction: float = 0.15,
    dtype: Literal["uint16", "float32"] = "uint16",
    pixel_size: float = 20.0,
    crs: str = "EPSG:32616",
    origin: tuple[float, float] = (500000.0, 4400000.0),
) -> SyntheticScene:
    """Draw a synthetic scene (the model is in ``docs/hyperspectral.md``); every class ``1..C`` has a pixel.

    ``bands`` are evenly spaced over 400-2500 nm; ``seed`` seeds every draw (same arguments, same scene, bit for bit);
    ``noise`` is in reflectance units, ``region_scale`` and ``boundary_mixing`` in pixels, ``pixel_size`` in CRS
    units; ``dtype="uint16"`` stores ``round(10000 * reflectance)``; ``origin`` is the top-left ``(x, y)``.
    """
    height = positive_int("height", height, allow_none=False, minimum=2)
    width = positive_int("width", width, allow_none=False, minimum=2)
    bands = positive_int("bands", bands, allow_none=False)
    classes = positive_int("classes", classes, allow_none=False)
    if classes > 65535:
        raise ValueError(f"Expected argument `classes` to be at most 65535, but got {classes}.")
    if not 0 <= unlabelled_fraction < 1:
        raise ValueError(f"Expected argument `unlabelled_fraction` to be in [0, 1), but got {unlabelled_fraction}.")
    if noise < 0 or region_scale <= 0 or boundary_mixing < 0 or pixel_size <= 0:
        raise ValueError(
            "Expected arguments `noise` >= 0, `region_scale` > 0, `boundary_mixing` >= 0 and `pixel_size` > 0, but"
            f" got {noise}, {region_scale}, {boundary_mixing} and {pixel_size}."
        )
    if dtype not in ("uint16", "float32"):
        raise ValueError(f"Expected argument `dtype` to be 'uint16' or 'float32', but got {dtype!r}.")
    rng = np.random.default_rng(seed)
    wavelengths = np.linspace(400.0, 2500.0, bands)
    variants = _class_signatures(rng, wavelengths, classes)

    # regions: argmax of smooth fields; then carve the background out of a separate field
    fields = _smooth_fields(rng, classes + 2, (height, width), region_scale)
    material = 1 + np.argmax(fields[:classes], axis=0)
    if unlabelled_fraction > 0:
        material[fields[classes] > np.quantile(fields[classes], 1.0 - unlabelled_fraction)] = 0
    # guarantee every class at least a few pixels (tiny scenes may miss one): seed a 2x2 square per missing class
    for c in range(1, classes + 1):
        if not np.any(material == c):
            r, q = int(rng.integers(0, height - 1)), int(rng.integers(0, width - 1))
            material[r : r + 2, q : q + 2] = c

    onehot = (material[None] == np.arange(classes + 1)[:, None, None]).astype(np.float64)
    abundance = _blur(onehot, boundary_mixing)
    variant_mix = 0.5 + 0.5 * np.tanh(fields[classes + 1])  # (H, W) in 0..1
    spectra = (
        np.einsum("mhw,mb->bhw", abundance, variants[0]) * (1 - variant_mix)
        + np.einsum("mhw,mb->bhw", abundance, variants[1]) * variant_mix
    )
    illumination = 1.0 + 0.1 * _smooth_fields(rng, 1, (height, width), 2 * region_scale)[0]
    spectra *= illumination[None]
    sigma = noise * (1.0 + 2.0 * _water_absorption(wavelengths) / 0.75)
    spectra += sigma[:, None, None] * rng.standard_normal(spectra.shape)
    spectra = np.clip(spectra, 0.0, 6.5)

    image = np.round(spectra * DN_SCALE).astype(np.uint16) if dtype == "uint16" else spectra.astype(np.float32)
    labels = material.astype(np.uint8 if classes < 256 else np.uint16)
    return SyntheticScene(
        image=image,
        labels=labels,
        wavelengths=wavelengths,
        signatures=0.5 * (variants[0, 1:] + variants[1, 1:]),
        class_names=[f"class_{c}" for c in range(1, classes + 1)],
        crs=CRS.from_user_input(crs),
        transform=Affine(pixel_size, 0.0, origin[0], 0.0, -pixel_size, origin[1]),  # north-up
    )


def write_synthetic_scene(out_dir: str | os.PathLike, **kwargs: object) -> tuple[Path, Path]:
    """Draw a scene with :func:`make_synthetic_scene` (``kwargs``); write ``out_dir/image.tif`` and ``labels.tif``."""
    scene = make_synthetic_scene(**kwargs)  # type: ignore[arg-type]
    out = Path(out_dir)
    image = write_geotiff(
        out / "image.tif",
        scene.image,
        crs=scene.crs,
        transform=scene.transform,
        band_descriptions=[f"{w:.1f} nm" for w in scene.wavelengths],
    )
    labels = write_geotiff(out / "labels.tif", scene.labels, crs=scene.crs, transform=scene.transform)
    return image, labels
