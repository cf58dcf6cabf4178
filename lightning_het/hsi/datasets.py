"""Patch datasets over a hyperspectral scene: one ``p x p`` window per pixel, reflect-padded at the scene borders."""

from __future__ import annotations

import os
from typing import Protocol

import numpy as np
import torch
from torch.utils.data import Dataset

from lightning_het.hsi.preprocessing import SpectralTransform, valid_mask
from lightning_het.hsi.raster import RasterHandle, read_window

__all__ = ["InMemoryPatches", "PatchDataset", "PatchSource", "WindowedPatches", "check_patch_size"]


def check_patch_size(patch_size: int) -> int:
    """Validate ``patch_size``: an odd positive integer (patches are centred on their pixel)."""
    if isinstance(patch_size, bool) or not isinstance(patch_size, (int, np.integer)) or patch_size < 1:
        raise ValueError(f"Expected argument `patch_size` to be a positive odd integer, but got {patch_size!r}.")
    if patch_size % 2 == 0:
        raise ValueError(
            f"Expected argument `patch_size` to be odd so that patches are centred on their pixel, but got"
            f" {patch_size}. HINT: use {patch_size - 1} or {patch_size + 1}."
        )
    return int(patch_size)


class PatchSource(Protocol):
    """Something that cuts preprocessed patches out of a scene."""

    patch_size: int
    bands: int
    shape: tuple[int, int]

    def read(self, row: int, col: int) -> tuple[np.ndarray, bool]:
        """The ``float32 (bands, p, p)`` patch centred on ``(row, col)`` and whether its centre pixel is valid."""
        ...


class InMemoryPatches:
    """Patches sliced from a preprocessed, reflect-padded copy of the whole ``(bands, height, width)`` cube.

    ``transform``: identity (cast to ``float32``) when ``None``; pixels outside ``valid`` (else derived from
    ``nodata``) are zero-filled after preprocessing.
    """

    def __init__(
        self,
        cube: np.ndarray,
        patch_size: int,
        transform: SpectralTransform | None = None,
        nodata: float | None = None,
        valid: np.ndarray | None = None,
    ) -> None:
        self.patch_size = check_patch_size(patch_size)
        self.valid = valid_mask(cube, nodata) if valid is None else np.asarray(valid, dtype=bool)
        data = transform(cube, self.valid) if transform is not None else _cast(cube, self.valid)
        half = self.patch_size // 2
        self.bands = int(data.shape[0])
        self.shape = (int(cube.shape[1]), int(cube.shape[2]))
        self._padded = np.pad(data, ((0, 0), (half, half), (half, half)), mode="reflect") if half else data

    def read(self, row: int, col: int) -> tuple[np.ndarray, bool]:
        p = self.patch_size
        return self._padded[:, row : row + p, col : col + p], bool(self.valid[row, col])


def _cast(values: np.ndarray, valid: np.ndarray) -> np.ndarray:
    out = values.astype(np.float32)
    if not valid.all():
        out[:, ~valid] = 0.0
    return out


class WindowedPatches:
    """Patches read window by window from the raster file (``nodata``: the file's when ``None``)."""

    def __init__(
        self,
        path: str | os.PathLike,
        patch_size: int,
        transform: SpectralTransform | None = None,
        nodata: float | None = None,
    ) -> None:
        self.patch_size = check_patch_size(patch_size)
        self.handle = RasterHandle(path, "image")
        dataset = self.handle.dataset
        self.shape = (int(dataset.height), int(dataset.width))
        self.nodata = dataset.nodata if nodata is None else nodata
        self.transform = transform
        self.bands = transform.out_bands if transform is not None else int(dataset.count)
        self.handle.close()  # reopened lazily in whichever process reads

    def read(self, row: int, col: int) -> tuple[np.ndarray, bool]:
        raw = read_window(self.handle.dataset, row, col, self.patch_size)
        valid = valid_mask(raw, self.nodata)
        half = self.patch_size // 2
        data = self.transform(raw, valid) if self.transform is not None else _cast(raw, valid)
        return data, bool(valid[half, half])


class PatchDataset(Dataset):
    """The pixels ``indices`` (``row * width + col``) of a scene as patch samples, ``targets`` their classes.

    A sample is a dict: ``image`` ``float32 (B, p, p)``, ``label`` (class index, ``-1`` unlabelled, as are all when
    ``targets`` is ``None``), ``row``, ``col``, ``valid`` (the centre pixel has a usable spectrum).
    """

    def __init__(self, source: PatchSource, indices: np.ndarray, targets: np.ndarray | None = None) -> None:
        self.source = source
        self.indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        if targets is None:
            targets = np.full(self.indices.shape, -1, dtype=np.int64)
        self.targets = np.asarray(targets, dtype=np.int64).reshape(-1)
        if self.targets.shape != self.indices.shape:
            raise ValueError(
                f"Expected `targets` to have one entry per index ({self.indices.size}), but got {self.targets.size}."
            )
        height, width = source.shape
        if self.indices.size and (self.indices.min() < 0 or self.indices.max() >= height * width):
            raise ValueError(f"Pixel indices must lie in [0, {height * width}) for a {height}x{width} scene.")

    def __len__(self) -> int:
        return int(self.indices.size)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        row, col = divmod(int(self.indices[i]), self.source.shape[1])
        patch, valid = self.source.read(row, col)
        return {
            "image": torch.from_numpy(np.array(patch, dtype=np.float32, copy=True)),
            "label": torch.tensor(int(self.targets[i]), dtype=torch.int64),
            "row": torch.tensor(row, dtype=torch.int64),
            "col": torch.tensor(col, dtype=torch.int64),
            "valid": torch.tensor(valid),
        }
