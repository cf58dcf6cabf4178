"""``HyperspectralDataModule``: a hyperspectral scene, split and served as patches to the heterogeneous strategy."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from rasterio.crs import CRS
from rasterio.transform import Affine

from lightning_het.data.datamodule import HeterogeneousDataModule
from lightning_het.hsi.datasets import InMemoryPatches, PatchDataset, PatchSource, WindowedPatches, check_patch_size
from lightning_het.hsi.errors import NoLabelledPixelsError, RasterNotFoundError, SingleClassError
from lightning_het.hsi.matfile import is_mat_file, read_mat_scene
from lightning_het.hsi.preprocessing import SpectralTransform, fit_spectral_transform, valid_mask
from lightning_het.hsi.raster import (
    RasterHandle,
    RasterInfo,
    check_alignment,
    check_labels,
    raster_info,
    read_image,
    read_labels,
    read_pixels,
)
from lightning_het.hsi.splits import Split, block_split, format_class_counts, random_split
from lightning_het.hsi.synthetic import make_synthetic_scene

__all__ = ["HyperspectralDataModule"]

log = logging.getLogger(__name__)


def _default_memory_budget() -> int:
    """An eighth of physical memory (each replica holds its own copy of an in-memory scene), or 2 GiB if unknown."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) // 8
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 2 * 2**30


@dataclass
class _Input:
    """What was read, before any pixel is dropped or split."""

    cube: np.ndarray | None  # (B, H, W); None when patches are read from the file
    labels: np.ndarray  # (H, W) int64
    num_classes: int
    class_names: list[str]
    crs: CRS | None
    geo_transform: Affine | None
    nodata: float | None
    source: str  # the label file, for messages


@dataclass
class _Scene:
    """Everything ``setup`` derives from the input files; built once per process."""

    labels: np.ndarray  # (H, W) int64, 0 = unlabelled or unusable
    num_classes: int
    split: Split
    transform: SpectralTransform
    source: PatchSource
    crs: CRS | None
    geo_transform: Affine | None
    class_names: list[str]
    labels_source: str


class HyperspectralDataModule(HeterogeneousDataModule):
    """Hyperspectral land-cover classification data: read, check, split, preprocess, cut patches.

    ``image`` and ``labels`` are a raster or ``.mat`` file each (``labels`` omitted when the image ``.mat`` holds
    both; ``image_key``/``labels_key`` name its variables); ``image=None`` draws a synthetic scene. ``patch_size`` is
    the odd side of the square patches in pixels (``1`` = spectra only); ``split`` is ``"random"`` (stratified) or
    ``"blocks"`` (spatially disjoint); ``train_fraction``/``val_fraction`` (``0``: none) are fractions of each
    class's pixels, ``train_per_class``/``val_per_class`` counts that take precedence; ``pca_components`` is a
    number, ``"auto"`` (``min(30, bands - 1)``) or ``None`` (every band); ``num_classes`` defaults to
    ``len(class_names)`` or the largest label; ``in_memory=None`` decides by size against ``memory_budget`` bytes.
    Every keyword is described in ``docs/hyperspectral.md``; bad values raise ``ValueError`` at construction.
    """

    def __init__(
        self,
        image: str | os.PathLike | None = None,
        labels: str | os.PathLike | None = None,
        *,
        synthetic: dict[str, Any] | None = None,
        patch_size: int = 5,
        split: Literal["random", "blocks"] = "random",
        train_fraction: float = 0.3,
        train_per_class: int | None = None,
        val_fraction: float = 0.1,
        val_per_class: int | None = None,
        block_size: int = 16,
        pca_components: int | Literal["auto"] | None = None,
        standardize: bool = True,
        num_classes: int | None = None,
        class_names: Sequence[str] | None = None,
        image_key: str | None = None,
        labels_key: str | None = None,
        seed: int = 0,
        in_memory: bool | None = None,
        memory_budget: int | None = None,
        global_batch_size: int = 64,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
        pin_memory: bool = False,
    ) -> None:
        super().__init__(
            global_batch_size=global_batch_size,
            eval_batch_size=eval_batch_size,
            num_workers=num_workers,
            pin_memory=pin_memory,
        )
        self.save_hyperparameters()
        self.image = os.fspath(image) if image is not None else None
        self.labels = os.fspath(labels) if labels is not None else None
        self._mat = self.image is not None and is_mat_file(self.image)
        _check_inputs(self.image, self.labels, mat=self._mat, synthetic=synthetic, in_memory=in_memory)
        if split not in ("random", "blocks"):
            raise ValueError(f"Expected argument `split` to be 'random' or 'blocks', but got {split!r}.")
        self.patch_size = check_patch_size(patch_size)
        self.split = split
        self.train_amount: float | int = _amount("train", train_fraction, train_per_class, allow_zero=False)
        self.val_amount: float | int = _amount("val", val_fraction, val_per_class, allow_zero=True)
        _check_fractions(self.train_amount, self.val_amount)
        _check_counts(block_size, pca_components, num_classes, memory_budget)
        class_names = _check_class_names(class_names, num_classes)
        self.synthetic = dict(synthetic or {})
        self.block_size = block_size
        self.pca_components = pca_components
        self.standardize = standardize
        self._num_classes_arg = num_classes if num_classes is not None else (len(class_names) if class_names else None)
        self._class_names_arg = class_names
        self.image_key = image_key
        self.labels_key = labels_key
        self.seed = seed
        self.in_memory = in_memory
        self.memory_budget = _default_memory_budget() if memory_budget is None else int(memory_budget)
        self._scene: _Scene | None = None

    # the scene and what derives from it are built on first access (``setup`` does it on every rank)
    @property
    def scene(self) -> _Scene:
        if self._scene is None:
            self._scene = self._build()
        return self._scene

    @property
    def num_bands(self) -> int:
        return self.scene.source.bands

    @property
    def num_classes(self) -> int:
        return self.scene.num_classes

    @property
    def class_names(self) -> list[str]:
        return self.scene.class_names

    @property
    def crs(self) -> CRS | None:
        return self.scene.crs

    @property
    def transform(self) -> Affine | None:
        """Pixel-to-map transform of the scene (``None`` when not georeferenced)."""
        return self.scene.geo_transform

    @property
    def shape(self) -> tuple[int, int]:
        return self.scene.source.shape

    @property
    def class_counts(self) -> dict[str, list[int]]:
        """Pixels per class in the ``train``/``val``/``test`` subsets."""
        return self.scene.split.class_counts(self.scene.labels, self.scene.num_classes)

    def prepare_data(self) -> None:
        """Fail fast on missing or unreadable files (metadata only; nothing is downloaded or written)."""
        if self.image is None:
            return
        if self._mat:
            for path, role in ((self.image, "image"), (self.labels, "labels")):
                if path is not None and not os.path.exists(path):
                    raise RasterNotFoundError(path, role)
            return
        check_alignment(raster_info(self.image, "image"), raster_info(self.labels, "labels"))

    def setup(self, stage: str | None = None) -> None:
        """Build the datasets (once per process; later calls reuse them)."""
        scene = self.scene
        split, labels = scene.split, scene.labels.reshape(-1)
        if self.train_dataset is None:
            self.train_dataset = PatchDataset(scene.source, split.train, labels[split.train] - 1)
            self.val_dataset = PatchDataset(scene.source, split.val, labels[split.val] - 1)
            self.test_dataset = PatchDataset(scene.source, split.test, labels[split.test] - 1)
            self.predict_dataset = PatchDataset(scene.source, np.arange(labels.size), labels - 1)

    def _build(self) -> _Scene:
        scene = self._read()
        source = scene.source
        labelled = np.nonzero(scene.labels.reshape(-1) > 0)[0]
        if labelled.size == 0:
            raise NoLabelledPixelsError(source)
        valid, labels, spectra = self._drop_nodata(scene, labelled)

        present = np.unique(labels[labels > 0])
        if present.size < 2:
            raise SingleClassError(source, present.tolist())

        split = self._split(labels, scene.num_classes, source)
        counts = format_class_counts(split.class_counts(labels, scene.num_classes), scene.class_names)
        log.info("Split %r of %s (seed %d), pixels per class:\n%s", self.split, source, self.seed, counts)

        if scene.cube is not None:
            train_spectra = scene.cube[:, split.train // labels.shape[1], split.train % labels.shape[1]].T
        else:
            train_spectra = spectra[np.searchsorted(labelled, split.train)]
        pca = resolve_pca_components(self.pca_components, train_spectra.shape[1], log_choice=True)
        transform = fit_spectral_transform(train_spectra, standardize=self.standardize, pca_components=pca)
        patches: PatchSource
        if scene.cube is not None:
            patches = InMemoryPatches(scene.cube, self.patch_size, transform, scene.nodata, valid=valid)
        else:
            patches = WindowedPatches(self.image, self.patch_size, transform, scene.nodata)  # type: ignore[arg-type]
        crs, geo, names = scene.crs, scene.geo_transform, scene.class_names
        return _Scene(labels, scene.num_classes, split, transform, patches, crs, geo, names, source)

    def _drop_nodata(self, scene: _Input, labelled: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """``(valid mask, labels with nodata unlabelled, labelled spectra or None)``."""
        labels, source, spectra = scene.labels, scene.source, None
        if scene.cube is not None:
            valid = valid_mask(scene.cube, scene.nodata)
        else:  # windowed: read the spectra of the labelled pixels only (needed for the nodata check and the fit)
            handle = RasterHandle(self.image, "image")  # type: ignore[arg-type]
            spectra = read_pixels(handle.dataset, *np.divmod(labelled, labels.shape[1]))
            handle.close()
            valid = np.zeros(labels.shape, dtype=bool)
            valid.reshape(-1)[labelled] = valid_mask(spectra.T, scene.nodata)
        dropped = int(np.count_nonzero(~valid.reshape(-1)[labelled]))
        if dropped:
            log.warning(
                "%d labelled pixels of %s have nodata/NaN spectra and are treated as unlabelled.", dropped, source
            )
            labels = np.where(valid, labels, 0)
            if not np.any(labels > 0):
                raise NoLabelledPixelsError(source, f"all {dropped} labelled pixels are nodata in the image")
        return valid, labels, spectra

    def _read(self) -> _Input:
        """Labels, metadata and (unless patches will be read from the file) the cube, validated."""
        if self.image is None:
            synthetic = make_synthetic_scene(**self.synthetic)
            source = "<synthetic scene>"
            labels, classes = check_labels(
                synthetic.labels, source, self._num_classes_arg or len(synthetic.class_names)
            )
            names = self._class_names_arg or synthetic.class_names
            return _Input(synthetic.image, labels, classes, names, synthetic.crs, synthetic.transform, None, source)
        if self._mat:
            cube, labels, classes = read_mat_scene(
                self.image,
                self.labels,
                image_key=self.image_key,
                labels_key=self.labels_key,
                num_classes=self._num_classes_arg,
            )
            return _Input(cube, labels, classes, self._names(classes), None, None, None, self.labels or self.image)
        assert self.labels is not None  # checked at construction
        info = raster_info(self.image, "image")
        labels, classes, labels_info = read_labels(self.labels, self._num_classes_arg)
        check_alignment(info, labels_info)
        cube = read_image(self.image)[0] if self._in_memory(info) else None
        return _Input(cube, labels, classes, self._names(classes), info.crs, info.transform, info.nodata, self.labels)

    def _names(self, classes: int) -> list[str]:
        return list(self._class_names_arg) if self._class_names_arg else [f"class_{c}" for c in range(1, classes + 1)]

    def _split(self, labels: np.ndarray, classes: int, source: str) -> Split:
        common = dict(train=self.train_amount, val=self.val_amount, seed=self.seed, num_classes=classes, source=source)
        if self.split == "random":
            return random_split(labels, **common)
        return block_split(labels, block_size=self.block_size, patch_size=self.patch_size, **common)

    def _in_memory(self, info: RasterInfo) -> bool:
        """Whether to load the cube: ``in_memory`` when set, else whether raw + preprocessed copies fit the budget."""
        if self.in_memory is not None:
            return self.in_memory
        out_bands = resolve_pca_components(self.pca_components, info.count) or info.count
        needed = info.height * info.width * (info.count * np.dtype(info.dtype).itemsize + out_bands * 4)
        decision = needed <= self.memory_budget
        log.info(
            "Scene needs ~%.1f MiB in memory (budget %.1f MiB): %s.",
            needed / 2**20,
            self.memory_budget / 2**20,
            "loading it" if decision else "reading patches from the file",
        )
        return decision


#: ``pca_components="auto"``: keep ``min(PCA_AUTO_MAX, bands - 1)`` components
PCA_AUTO = "auto"
PCA_AUTO_MAX = 30


def resolve_pca_components(value: int | str | None, bands: int, *, log_choice: bool = False) -> int | None:
    """The number of principal components to keep for an image of ``bands`` bands."""
    if value != PCA_AUTO:
        return value  # type: ignore[return-value]
    chosen = min(PCA_AUTO_MAX, bands - 1) if bands > 1 else None
    if log_choice:
        log.info(
            "pca_components=auto: %s of the image's %d bands (min(%d, bands - 1)).",
            f"keeping {chosen} principal components" if chosen else "no PCA",
            bands,
            PCA_AUTO_MAX,
        )
    return chosen


def _check_int(name: str, value: object, minimum: int, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        extra = " or None" if optional else ""
        raise ValueError(f"Expected argument `{name}` to be an integer >= {minimum}{extra}, but got {value!r}.")


def _check_inputs(
    image: str | None, labels: str | None, *, mat: bool, synthetic: dict[str, Any] | None, in_memory: bool | None
) -> None:
    """Refuse inputs that name no scene, or two."""
    if image is None:
        if labels is not None:
            raise ValueError(
                f"You set labels={labels!r}, but no `image`. HINT: pass the image raster too, or neither to"
                " use a synthetic scene."
            )
        if in_memory is False:
            raise ValueError(
                "You set in_memory=False, but synthetic scenes exist only in memory. HINT: write one"
                " with scripts/make_synthetic_scene.py and pass its files as `image`/`labels`."
            )
    elif mat:
        if in_memory is False:
            raise ValueError(
                f"You set in_memory=False, but {image!r} is a .mat file, which is read whole."
                " HINT: convert it to GeoTIFF for windowed reads."
            )
    elif labels is None:
        raise ValueError(
            f"You set image={image!r}, but no `labels` raster. HINT: pass the single-band ground-truth"
            " raster (0 = unlabelled, 1..C = classes) as `labels`."
        )
    if synthetic is not None and image is not None:
        raise ValueError("You set both `image` and `synthetic`. HINT: `synthetic` applies only when image=None.")


def _check_counts(block_size: int, pca_components: Any, num_classes: int | None, memory_budget: int | None) -> None:
    _check_int("block_size", block_size, 1)
    if pca_components != PCA_AUTO:
        _check_int("pca_components", pca_components, 1, optional=True)
    _check_int("num_classes", num_classes, 1, optional=True)
    _check_int("memory_budget", memory_budget, 0, optional=True)


def _check_fractions(train: float | int, val: float | int) -> None:
    if isinstance(train, float) and isinstance(val, float) and (train + val >= 1):
        raise ValueError(
            f"You set train_fraction={train} and val_fraction={val}, but they must sum"
            " to less than 1 to leave test pixels. HINT: lower one of them."
        )


def _check_class_names(class_names: Sequence[str] | None, num_classes: int | None) -> list[str] | None:
    if class_names is not None:
        class_names = [str(n) for n in class_names]
        if num_classes is not None and len(class_names) != num_classes:
            raise ValueError(
                f"You set num_classes={num_classes}, but gave {len(class_names)} class_names. HINT: give one name"
                " per class, or drop `num_classes`."
            )
    return class_names


def _amount(name: str, fraction: float | None, per_class: int | None, allow_zero: bool) -> float | int:
    """``per_class`` when given (a count), else ``fraction``; validated."""
    if per_class is not None:
        _check_int(f"{name}_per_class", per_class, 0 if allow_zero else 1)
        return per_class
    if fraction is None or isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
        raise ValueError(f"Expected argument `{name}_fraction` to be a number, but got {fraction!r}.")
    fraction = float(fraction)
    if not (0 <= fraction < 1 if allow_zero else 0 < fraction < 1):
        interval = "[0, 1)" if allow_zero else "(0, 1)"
        raise ValueError(f"Expected argument `{name}_fraction` to be in {interval}, but got {fraction}.")
    return fraction
