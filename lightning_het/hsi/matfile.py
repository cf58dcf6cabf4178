"""MATLAB ``.mat`` scenes (as the classic hyperspectral benchmarks circulate): find the cube and its label map."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np

from lightning_het.hsi.errors import MatFileError, ShapeMismatchError
from lightning_het.hsi.raster import check_exists, check_labels

__all__ = ["is_mat_file", "read_mat_scene"]

log = logging.getLogger(__name__)


def is_mat_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` names a MATLAB file (by its ``.mat`` suffix, case-insensitive)."""
    return Path(path).suffix.lower() == ".mat"


def _load_mat(path: str) -> dict[str, np.ndarray]:
    try:
        import scipy.io
    except ImportError as err:  # pragma: no cover - scipy is installed in dev environments
        raise ImportError(
            f"Reading the MATLAB file {path!r} needs scipy, which is not installed. HINT: `pip install"
            " 'lightning-het[mat]'` or convert the file to GeoTIFF."
        ) from err
    try:
        content = scipy.io.loadmat(path)
    except NotImplementedError as err:  # MATLAB v7.3 (HDF5)
        raise MatFileError(path, f"scipy cannot read this MATLAB version ({err})") from err
    except (ValueError, OSError, TypeError) as err:
        raise MatFileError(path, f"scipy cannot parse it ({err})") from err
    return {k: np.asarray(v) for k, v in content.items() if not k.startswith("__") and isinstance(v, np.ndarray)}


def _pick(arrays: dict[str, np.ndarray], key: str | None, ndim: int, path: str, what: str) -> dict[str, np.ndarray]:
    shapes = {k: tuple(v.shape) for k, v in arrays.items()}
    if key is not None:
        if key not in arrays:
            raise MatFileError(path, f"the variable {key!r} requested for the {what} is missing", shapes)
        if arrays[key].ndim != ndim or arrays[key].dtype.kind not in "uif":
            raise MatFileError(path, f"the variable {key!r} is not a {ndim}-D numeric array", shapes)
        return {key: arrays[key]}
    found = {k: v for k, v in arrays.items() if v.ndim == ndim and v.dtype.kind in "uif" and min(v.shape) > 1}
    if not found:
        raise MatFileError(path, f"no {ndim}-D numeric array to use as the {what}", shapes)
    return found


def _matching_pairs(cubes: dict[str, np.ndarray], maps: dict[str, np.ndarray]) -> list[tuple[str, str, str]]:
    """``(cube key, labels key, layout)`` of every cube with two axes equal to a label map's shape."""
    pairs = []
    for ck, cube in cubes.items():
        for lk, lab in maps.items():
            if cube.shape[:2] == lab.shape:
                pairs.append((ck, lk, "hwb"))
            elif cube.shape[1:] == lab.shape:
                pairs.append((ck, lk, "bhw"))
    return pairs


def read_mat_scene(
    image_path: str | os.PathLike,
    labels_path: str | os.PathLike | None = None,
    *,
    image_key: str | None = None,
    labels_key: str | None = None,
    num_classes: int | None = None,
) -> tuple[np.ndarray, np.ndarray, int]:
    """Read ``(cube (bands, height, width) as stored, labels (height, width) int64, number of classes)``.

    The labels come from ``image_path`` when ``labels_path`` is ``None``; ``image_key`` / ``labels_key`` name the
    variables (else found by shape).

    Raises:
        RasterNotFoundError: a file does not exist.
        ImportError: scipy is missing.
        MatFileError: no (or more than one) matching pair of variables, or an unreadable file.
        ShapeMismatchError: explicit keys whose shapes disagree.
        LabelValueError: see :func:`check_labels`.
    """
    image_text = check_exists(image_path, "image")
    labels_text = check_exists(labels_path, "labels") if labels_path is not None else image_text
    image_arrays = _load_mat(image_text)
    labels_arrays = image_arrays if labels_text == image_text else _load_mat(labels_text)
    cubes = _pick(image_arrays, image_key, 3, image_text, "image cube")
    maps = _pick(labels_arrays, labels_key, 2, labels_text, "label map")
    pairs = _matching_pairs(cubes, maps)
    if not pairs:
        if image_key is not None and labels_key is not None:
            cube, lab = cubes[image_key], maps[labels_key]
            raise ShapeMismatchError(image_text, cube.shape[:2], labels_text, lab.shape)
        shapes = {k: tuple(v.shape) for k, v in {**image_arrays, **labels_arrays}.items()}
        raise MatFileError(image_text, "no 3-D cube has two axes equal to the shape of a 2-D label map", shapes)
    if len(pairs) > 1:
        shapes = {k: tuple(v.shape) for k, v in {**image_arrays, **labels_arrays}.items()}
        raise MatFileError(image_text, f"several (cube, labels) pairs match: {[p[:2] for p in pairs]}", shapes)
    ck, lk, layout = pairs[0]
    cube = cubes[ck]
    if layout == "hwb":
        cube = np.ascontiguousarray(np.moveaxis(cube, -1, 0))
    labels, classes = check_labels(maps[lk], labels_text, num_classes)
    log.info("Read %s[%r] %s and %s[%r] %s", image_text, ck, cube.shape, labels_text, lk, labels.shape)
    return cube, labels, classes
