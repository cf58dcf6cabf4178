"""Raster I/O for hyperspectral scenes: open, validate, read (whole or windowed) and write GeoTIFF."""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import rasterio
from rasterio.crs import CRS
from rasterio.errors import NotGeoreferencedWarning, RasterioIOError
from rasterio.transform import Affine
from rasterio.windows import Window

from lightning_het.hsi.errors import (
    GeoreferenceMismatchError,
    LabelValueError,
    RasterFormatError,
    RasterNotFoundError,
    ShapeMismatchError,
)

__all__ = [
    "RasterHandle",
    "RasterInfo",
    "check_alignment",
    "check_exists",
    "check_labels",
    "raster_info",
    "read_image",
    "read_labels",
    "read_pixels",
    "read_window",
    "reflect_indices",
    "write_geotiff",
]

log = logging.getLogger(__name__)

#: Bytes read at once by :func:`read_pixels` (a strip of whole rows).
STRIP_BYTES = 32 * 2**20


@dataclass(frozen=True)
class RasterInfo:
    """Metadata of one raster, read without its pixels (sizes in pixels; dtype and nodata of the first band)."""

    path: str
    height: int
    width: int
    count: int  # bands
    dtype: str  # numpy dtype name, "uint16", "float32", ...
    crs: CRS | None
    transform: Affine | None  # pixel-to-map; None when not georeferenced
    nodata: float | None
    driver: str  # GDAL short name: "GTiff", "ENVI", "MAT" for MATLAB files

    @property
    def shape(self) -> tuple[int, int]:
        """``(height, width)`` in pixels."""
        return (self.height, self.width)

    @property
    def georeferenced(self) -> bool:
        """Whether the raster has a CRS or a non-identity transform."""
        return self.crs is not None or self.transform is not None


def check_exists(path: str | os.PathLike, role: str) -> str:
    """``path`` as a string; a `RasterNotFoundError` naming ``role`` when it is missing."""
    text = os.fspath(path)
    if not os.path.exists(text):
        raise RasterNotFoundError(text, role)
    return text


def open_raster(path: str | os.PathLike, role: str = "image") -> rasterio.io.DatasetReader:
    """Open ``path`` for reading with rasterio, turning GDAL's errors into ones that name the file."""
    text = check_exists(path, role)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NotGeoreferencedWarning)
            return rasterio.open(text)
    except RasterioIOError as err:
        raise RasterFormatError(
            text, f"GDAL cannot open it as a raster ({err})", "pass a GeoTIFF, an ENVI data file or a .mat file"
        ) from err


def _info_from_dataset(dataset: Any, path: str) -> RasterInfo:
    transform = dataset.transform
    georef = transform is not None and not transform.is_identity
    return RasterInfo(
        path=path,
        height=int(dataset.height),
        width=int(dataset.width),
        count=int(dataset.count),
        dtype=str(dataset.dtypes[0]),
        crs=dataset.crs,
        transform=transform if georef else None,
        nodata=dataset.nodata,
        driver=str(dataset.driver),
    )


def raster_info(path: str | os.PathLike, role: str = "image") -> RasterInfo:
    """Read the metadata of a raster without its pixels (see :func:`open_raster` for errors)."""
    with open_raster(path, role) as dataset:
        return _info_from_dataset(dataset, os.fspath(path))


def _check_numeric(dtype: np.dtype | str, path: str) -> None:
    kind = np.dtype(dtype).kind
    if kind not in "uif":
        raise RasterFormatError(
            path,
            f"its data type {np.dtype(dtype).name} is not a real number type",
            "convert it to an integer or float type",
        )


def read_image(path: str | os.PathLike) -> tuple[np.ndarray, RasterInfo]:
    """Read a whole multi-band image: the cube ``(bands, height, width)`` in the file's dtype, and its metadata.

    Raises:
        RasterNotFoundError: the file does not exist.
        RasterFormatError: unreadable file or a non-numeric data type.
    """
    with open_raster(path, "image") as dataset:
        info = _info_from_dataset(dataset, os.fspath(path))
        _check_numeric(info.dtype, info.path)
        cube = dataset.read()
    return cube, info


def check_labels(labels: np.ndarray, path: str | os.PathLike, num_classes: int | None = None) -> tuple[np.ndarray, int]:
    """Validate a label map and convert it to ``int64``."""
    values = np.asarray(labels)
    _check_numeric(values.dtype, os.fspath(path))
    bad = values < 0
    fractional = np.zeros(values.shape, dtype=bool)
    if values.dtype.kind == "f":
        with np.errstate(invalid="ignore"):
            fractional = ~(np.isfinite(values) & (values == np.floor(values)))
        bad |= fractional
    largest = int(values[~bad].max()) if np.any(~bad) else 0
    classes = largest if num_classes is None else int(num_classes)
    bad |= values > classes
    if bad.any():
        # non-integer values: a message about integers, not about a class count inferred from the rest (e.g. "1..0")
        raise LabelValueError(path, np.unique(values[bad])[:5].tolist(), classes, non_integer=bool(fractional.any()))
    return values.astype(np.int64), classes


def read_labels(path: str | os.PathLike, num_classes: int | None = None) -> tuple[np.ndarray, int, RasterInfo]:
    """Read and validate a single-band label raster: labels ``(height, width)`` ``int64``, ``C`` and the metadata.

    Raises:
        RasterNotFoundError: the file does not exist.
        RasterFormatError: more than one band or a non-numeric type.
        LabelValueError: see :func:`check_labels`.
    """
    with open_raster(path, "labels") as dataset:
        info = _info_from_dataset(dataset, os.fspath(path))
        if info.count != 1:
            raise RasterFormatError(
                info.path,
                f"a label raster must have one band, but it has {info.count}",
                "pass the ground-truth class map, not the image",
            )
        raw = dataset.read(1)
    if info.nodata is not None:
        raw = np.where(raw == info.nodata, 0, raw) if not np.isnan(info.nodata) else np.nan_to_num(raw, nan=0)
    labels, classes = check_labels(raw, info.path, num_classes)
    return labels, classes, info


def check_alignment(image: RasterInfo, labels: RasterInfo) -> None:
    """Check that ``labels`` lies on the pixel grid of ``image``.

    Raises:
        ShapeMismatchError: different heights or widths (naming both files and both shapes).
        GeoreferenceMismatchError: different CRS or transform.
    """
    if image.shape != labels.shape:
        raise ShapeMismatchError(image.path, image.shape, labels.path, labels.shape)
    if image.crs is not None and labels.crs is not None and image.crs != labels.crs:
        raise GeoreferenceMismatchError(image.path, labels.path, "CRS", image.crs, labels.crs)
    if (
        image.transform is not None
        and labels.transform is not None
        and not image.transform.almost_equals(labels.transform, precision=1e-6 * max(abs(image.transform.a), 1e-12))
    ):
        raise GeoreferenceMismatchError(image.path, labels.path, "transform", image.transform, labels.transform)


def reflect_indices(start: int, size: int, length: int) -> np.ndarray:
    """Indices ``start .. start+size-1`` folded into ``0..length-1`` by reflection without repeating the edge.

    >>> reflect_indices(-2, 5, 4).tolist()
    [2, 1, 0, 1, 2]
    >>> reflect_indices(2, 4, 4).tolist()
    [2, 3, 2, 1]
    """
    idx = np.arange(start, start + size)
    if length == 1:
        return np.zeros(size, dtype=np.int64)
    period = 2 * (length - 1)
    idx = np.mod(idx, period)
    return np.where(idx >= length, period - idx, idx).astype(np.int64)


def read_window(dataset: Any, row: int, col: int, size: int, indexes: Sequence[int] | None = None) -> np.ndarray:
    """Read the ``size x size`` window centred on pixel ``(row, col)``, reflect-padded at the scene borders."""
    half = size // 2
    rows = reflect_indices(row - half, size, dataset.height)
    cols = reflect_indices(col - half, size, dataset.width)
    r0, r1 = int(rows.min()), int(rows.max()) + 1
    c0, c1 = int(cols.min()), int(cols.max()) + 1
    block = dataset.read(list(indexes) if indexes is not None else None, window=Window(c0, r0, c1 - c0, r1 - r0))
    if r1 - r0 == size and c1 - c0 == size and rows[0] == r0 and cols[0] == c0:
        return block  # interior window: already in order
    return block[:, rows - r0][:, :, cols - c0]


def read_pixels(dataset: Any, rows: np.ndarray, cols: np.ndarray, strip_bytes: int = STRIP_BYTES) -> np.ndarray:
    """Read the spectra of scattered pixels, one strip of whole rows at a time."""
    rows = np.asarray(rows, dtype=np.int64)
    cols = np.asarray(cols, dtype=np.int64)
    out = np.empty((rows.size, dataset.count), dtype=dataset.dtypes[0])
    if rows.size == 0:
        return out
    row_bytes = dataset.width * dataset.count * np.dtype(dataset.dtypes[0]).itemsize
    strip = max(1, strip_bytes // max(row_bytes, 1))
    strip_of = rows // strip
    for s in np.unique(strip_of):
        mine = np.nonzero(strip_of == s)[0]
        r0 = int(s) * strip
        height = min(strip, dataset.height - r0)
        block = dataset.read(window=Window(0, r0, dataset.width, height))
        out[mine] = block[:, rows[mine] - r0, cols[mine]].T
    return out


class RasterHandle:
    """A lazily opened, per-process rasterio dataset that survives pickling and ``fork``."""

    def __init__(self, path: str | os.PathLike, role: str = "image") -> None:
        self.path = os.fspath(path)
        self.role = role
        self._dataset: Any = None
        self._pid: int | None = None

    @property
    def dataset(self) -> Any:
        if self._dataset is None or self._pid != os.getpid():
            self._dataset = open_raster(self.path, self.role)
            self._pid = os.getpid()
        return self._dataset

    def close(self) -> None:
        if self._dataset is not None and self._pid == os.getpid():
            self._dataset.close()
        self._dataset = None
        self._pid = None

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "role": self.role, "_dataset": None, "_pid": None}


def write_geotiff(
    path: str | os.PathLike,
    array: np.ndarray,
    *,
    crs: CRS | str | None = None,
    transform: Affine | None = None,
    nodata: float | None = None,
    band_descriptions: Sequence[str] | None = None,
    colormap: dict[int, tuple[int, int, int, int]] | None = None,
    compress: str = "deflate",
) -> Path:
    """Write ``array`` (``(bands, height, width)`` or ``(height, width)``) as a tiled, compressed GeoTIFF.

    ``crs``: anything ``CRS.from_user_input`` takes; ``transform``: pixel-to-map, identity when ``None``;
    ``colormap``: a palette ``{value: (r, g, b, a)}`` for a single-band ``uint8``/``uint16`` raster.
    """
    data = np.asarray(array)
    if data.ndim == 2:
        data = data[None]
    if data.ndim != 3:
        raise ValueError(f"Expected argument `array` to have shape (bands, height, width), but got {data.shape}.")
    count, height, width = data.shape
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    profile: dict[str, Any] = {
        "driver": "GTiff",
        "height": height,
        "width": width,
        "count": count,
        "dtype": data.dtype.name,
        "crs": CRS.from_user_input(crs) if crs is not None else None,
        "transform": transform if transform is not None else Affine.identity(),
        "nodata": nodata,
        "compress": compress,
        "interleave": "pixel",  # one tile holds all bands: windowed patch reads touch few blocks
    }
    if height >= 16 and width >= 16:
        profile.update(tiled=True, blockxsize=64 if width >= 64 else 16, blockysize=64 if height >= 64 else 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotGeoreferencedWarning)
        with rasterio.open(out, "w", **profile) as dst:
            dst.write(data)
            if band_descriptions is not None:
                for band, text in enumerate(band_descriptions, start=1):
                    dst.set_band_description(band, str(text))
            if colormap is not None:
                dst.write_colormap(1, colormap)
    return out
