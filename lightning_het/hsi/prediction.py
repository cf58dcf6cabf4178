"""Full-scene prediction maps: assemble per-pixel predictions, write a GeoTIFF and a colour PNG preview."""

from __future__ import annotations

import colorsys
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from rasterio.crs import CRS
from rasterio.transform import Affine

from lightning_het.hsi.raster import write_geotiff

__all__ = [
    "PredictionMapWriter",
    "assemble_class_map",
    "class_palette",
    "write_prediction_geotiff",
    "write_prediction_png",
]

log = logging.getLogger(__name__)

#: matplotlib's "tab20" order: dark tones first, so that up to 10 classes get clearly distinct colours
_TAB20_RGB = bytes.fromhex(
    "1f77b4ff7f0e2ca02cd627289467bd8c564be377c27f7f7fbcbd2217becf"
    "aec7e8ffbb7898df8aff9896c5b0d5c49c94f7b6d2c7c7c7dbdb8d9edae5"
)
_TAB20 = [tuple(_TAB20_RGB[i : i + 3]) for i in range(0, len(_TAB20_RGB), 3)]


def class_palette(num_classes: int) -> list[tuple[int, int, int]]:
    """RGB colours (0-255) for map values ``0..C``: black for ``0`` (no prediction), distinct colours for classes."""
    if num_classes <= len(_TAB20):
        colours = _TAB20[:num_classes]
    else:
        hsv = [(i / num_classes, 0.75 if i % 2 else 0.95, 0.9 if i % 3 else 0.7) for i in range(num_classes)]
        colours = [tuple(int(255 * v) for v in colorsys.hsv_to_rgb(*c)) for c in hsv]
    return [(0, 0, 0), *colours]  # type: ignore[list-item]


def assemble_class_map(
    pred: np.ndarray, rows: np.ndarray, cols: np.ndarray, shape: tuple[int, int], num_classes: int | None = None
) -> np.ndarray:
    """The ``(height, width)`` map of ``pred + 1`` at ``(rows, cols)``, ``0`` elsewhere and where ``pred`` is ``-1``.

    ``num_classes`` (else from ``pred``) picks the dtype: ``uint8`` below 256 classes, else ``uint16``.
    """
    pred = np.asarray(pred, dtype=np.int64)
    classes = num_classes if num_classes is not None else int(pred.max(initial=0)) + 1
    out = np.zeros(shape, dtype=np.uint8 if classes < 256 else np.uint16)
    out[np.asarray(rows, dtype=np.int64), np.asarray(cols, dtype=np.int64)] = np.clip(pred + 1, 0, None)
    return out


def write_prediction_geotiff(
    path: str | os.PathLike,
    class_map: np.ndarray,
    *,
    crs: CRS | None = None,
    transform: Affine | None = None,
    num_classes: int | None = None,
) -> Path:
    """Write a class map (``0`` = nodata, ``1..C``; ``C``: ``num_classes`` or the largest value) as a single-band
    GeoTIFF with a colour palette."""
    classes = int(num_classes if num_classes is not None else class_map.max())
    palette = {i: (*rgb, 255) for i, rgb in enumerate(class_palette(max(classes, 1)))}
    palette[0] = (0, 0, 0, 0)
    return write_geotiff(path, class_map, crs=crs, transform=transform, nodata=0, colormap=palette)


def write_prediction_png(
    path: str | os.PathLike,
    class_map: np.ndarray,
    class_names: Sequence[str],
    *,
    reference: np.ndarray | None = None,
    title: str = "Predicted land cover",
    dpi: int = 100,
) -> Path:
    """Write a colour preview of a class map (``0`` = none, ``1..C``) with a legend of the ``C`` ``class_names``,
    and the ``reference`` labels (``0`` = unlabelled) in a left panel when given."""
    from matplotlib.colors import ListedColormap
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    classes = len(class_names)
    colours = np.array(class_palette(classes), dtype=float) / 255.0
    cmap = ListedColormap(colours)
    panels = [("Reference labels", reference)] if reference is not None else []
    panels.append((title, class_map))
    height, width = class_map.shape
    panel_w = 4.0 * width / max(height, width)
    fig = Figure(figsize=(panel_w * len(panels) + 1.9, 4.0 * height / max(height, width) + 0.6), dpi=dpi)
    for i, (name, data) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        ax.imshow(data, cmap=cmap, vmin=-0.5, vmax=classes + 0.5, interpolation="nearest")
        ax.set_title(name)
        ax.set_xticks([])
        ax.set_yticks([])
    handles = [Patch(facecolor=colours[0], label="no data / unlabelled")]
    handles += [Patch(facecolor=colours[c], label=str(class_names[c - 1])) for c in range(1, classes + 1)]
    fig.legend(handles=handles, loc="center right", fontsize="small", frameon=False)
    fig.subplots_adjust(left=0.02, right=1 - 1.9 / fig.get_figwidth(), top=0.9, bottom=0.03, wspace=0.05)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    return out


def _gather(local: np.ndarray) -> np.ndarray:
    """Concatenate ``(k, n_r)`` arrays from all ranks (uneven ``n_r`` allowed); the local array when not distributed."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return local
    parts: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(parts, local)
    return np.concatenate(parts, axis=1)


class PredictionMapWriter(pl.Callback):
    """Collects ``predict_step`` outputs of every replica; rank 0 writes ``out_dir/<name>.tif`` (and ``.png``).

    ``shape``, ``crs``, ``transform`` and ``class_names`` come from the datamodule when ``None``. After a predict
    loop, ``class_map`` holds the map on every rank and ``paths`` the files rank 0 wrote.
    """

    def __init__(
        self,
        out_dir: str | os.PathLike,
        name: str = "prediction",
        *,
        png: bool = True,
        shape: tuple[int, int] | None = None,
        crs: CRS | None = None,
        transform: Affine | None = None,
        class_names: Sequence[str] | None = None,
    ) -> None:
        self.out_dir = Path(out_dir)
        self.name = name
        self.png = png
        self.shape = shape
        self.crs = crs
        self.transform = transform
        self.class_names = list(class_names) if class_names is not None else None
        self.class_map: np.ndarray | None = None
        self.paths: list[Path] = []
        self._chunks: list[np.ndarray] = []

    def on_predict_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._chunks = []

    def on_predict_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *args: Any
    ) -> None:
        self._chunks.append(
            np.stack([outputs[k].detach().cpu().numpy().astype(np.int64) for k in ("pred", "row", "col")])
        )

    def on_predict_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        local = np.concatenate(self._chunks, axis=1) if self._chunks else np.zeros((3, 0), dtype=np.int64)
        self._chunks = []
        merged = _gather(local)
        dm = trainer.datamodule
        shape = self.shape or getattr(dm, "shape", None)
        if shape is None:
            raise RuntimeError(
                "PredictionMapWriter does not know the scene shape. HINT: pass shape=(height, width) or use a"
                " datamodule with a `shape` attribute (HyperspectralDataModule)."
            )
        names = self.class_names or list(getattr(dm, "class_names", None) or [])
        classes = len(names) or int(merged[0].max(initial=0)) + 1
        names = names or [f"class_{c}" for c in range(1, classes + 1)]
        self.class_map = assemble_class_map(merged[0], merged[1], merged[2], tuple(shape), classes)
        if trainer.global_rank != 0:
            return
        crs = self.crs if self.crs is not None else getattr(dm, "crs", None)
        transform = self.transform if self.transform is not None else getattr(dm, "transform", None)
        tif = write_prediction_geotiff(
            self.out_dir / f"{self.name}.tif", self.class_map, crs=crs, transform=transform, num_classes=classes
        )
        self.paths = [tif]
        if self.png:
            reference = getattr(getattr(dm, "scene", None), "labels", None)
            self.paths.append(
                write_prediction_png(self.out_dir / f"{self.name}.png", self.class_map, names, reference=reference)
            )
        log.info("Wrote the prediction map to %s", ", ".join(map(str, self.paths)))
