"""Exceptions raised for bad input data, each naming the offending file or value and how to fix it."""

from __future__ import annotations

from collections.abc import Sequence
from os import PathLike
from typing import Any

PathType = str | PathLike


class _Pickled:
    """Pickled by its constructor arguments (``_args``), so it crosses spawned processes."""

    _args: tuple[Any, ...] = ()

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), self._args)


class RasterNotFoundError(_Pickled, FileNotFoundError):
    """A raster (or ``.mat``) file given by the user does not exist."""

    def __init__(self, path: PathType, role: str = "raster") -> None:
        self.path = str(path)
        self.role = role
        self._args = (self.path, self.role)
        super().__init__(
            f"The {role} file {self.path!r} does not exist. HINT: check the path (relative paths are resolved against"
            " the current working directory, which Hydra may change; pass an absolute path)."
        )


class RasterFormatError(_Pickled, ValueError):
    """A file exists but cannot be used as the requested raster (unreadable, wrong band count, unsupported dtype)."""

    def __init__(self, path: PathType, problem: str, hint: str = "") -> None:
        self.path = str(path)
        self.problem = problem
        self.hint = hint
        message = f"Cannot use {self.path!r}: {problem}."
        if hint:
            message += f" HINT: {hint}"
        self._args = (self.path, self.problem, self.hint)
        super().__init__(message)


class ShapeMismatchError(_Pickled, ValueError):
    """The image and the label raster do not cover the same pixel grid."""

    def __init__(
        self, image_path: PathType, image_shape: Sequence[int], labels_path: PathType, labels_shape: Sequence[int]
    ) -> None:
        self.image_path = str(image_path)
        self.image_shape = tuple(int(s) for s in image_shape)
        self.labels_path = str(labels_path)
        self.labels_shape = tuple(int(s) for s in labels_shape)
        self._args = (self.image_path, self.image_shape, self.labels_path, self.labels_shape)
        super().__init__(
            f"The image {self.image_path!r} is {self.image_shape[0]}x{self.image_shape[1]} pixels (height x width) but"
            f" the labels {self.labels_path!r} are {self.labels_shape[0]}x{self.labels_shape[1]}. HINT: the label"
            " raster must be on the same pixel grid as the image; resample or crop one of them (e.g. `gdalwarp -te"
            " ... -ts ...`)."
        )


class GeoreferenceMismatchError(_Pickled, ValueError):
    """Both rasters are georeferenced but their CRS or geotransform differ."""

    def __init__(
        self, image_path: PathType, labels_path: PathType, what: str, image_value: Any, labels_value: Any
    ) -> None:
        self.image_path = str(image_path)
        self.labels_path = str(labels_path)
        self.what = what
        self.image_value = str(image_value)
        self.labels_value = str(labels_value)
        self._args = (self.image_path, self.labels_path, self.what, self.image_value, self.labels_value)
        super().__init__(
            f"The image {self.image_path!r} and the labels {self.labels_path!r} have different {what}s:"
            f" {self.image_value!r} vs {self.labels_value!r}. HINT: reproject the labels onto the image grid"
            " (`gdalwarp -t_srs ... -tr ... -te ...`), or strip the georeferencing of one file if they are known to"
            " be aligned pixel for pixel."
        )


class LabelValueError(_Pickled, ValueError):
    """The label raster holds values outside ``0..num_classes`` (or non-integers)."""

    def __init__(
        self, path: PathType, bad_values: Sequence[Any], num_classes: int | None, non_integer: bool = False
    ) -> None:
        self.path = str(path)
        self.bad_values = list(bad_values)
        self.num_classes = num_classes
        self.non_integer = non_integer
        if non_integer:  # e.g. a probability map or a label map resampled bilinearly: no class count to speak of
            message = (
                f"The labels {self.path!r} hold values {self.bad_values} that are not class numbers: labels must be"
                " integers, 0 for unlabelled pixels and 1..C for the C classes. HINT: pass the ground-truth class map"
                " (an integer raster, resampled with nearest-neighbour), not a probability or resampled map."
            )
        else:
            allowed = "0 (unlabelled) and 1..C" if not num_classes else f"0 (unlabelled) and 1..{num_classes}"
            message = (
                f"The labels {self.path!r} hold values {self.bad_values} outside {allowed}. HINT: labels must be"
                " integers, 0 for unlabelled pixels and 1..C for the C classes; raise `num_classes` (or pass more"
                " `class_names`) if the scene really has more classes, or remap the raster."
            )
        self._args = (self.path, self.bad_values, self.num_classes, self.non_integer)
        super().__init__(message)


class NoLabelledPixelsError(_Pickled, ValueError):
    """The label raster has no labelled pixel (every value is 0, or every labelled pixel is nodata in the image)."""

    def __init__(self, path: PathType, detail: str = "") -> None:
        self.path = str(path)
        self.detail = detail
        extra = f" ({detail})" if detail else ""
        self._args = (self.path, self.detail)
        super().__init__(
            f"The labels {self.path!r} contain no labelled pixel{extra}: every usable value is 0 (unlabelled)."
            " HINT: check that you passed the ground-truth raster and not a mask, and that its nodata value is not"
            " hiding the classes."
        )


class SingleClassError(_Pickled, ValueError):
    """The label raster holds fewer than two classes, so there is nothing to classify."""

    def __init__(self, path: PathType, present: Sequence[int]) -> None:
        self.path = str(path)
        self.present = [int(c) for c in present]
        self._args = (self.path, self.present)
        super().__init__(
            f"The labels {self.path!r} contain a single class (value {self.present[0]}) besides 0 (unlabelled), but"
            " classification needs at least two. HINT: check that you passed the ground-truth raster and not a"
            " binary mask of one class; a mask's 0 means unlabelled here, not a second class."
        )


class ClassTooSmallError(_Pickled, ValueError):
    """A class has too few labelled pixels for the requested split."""

    def __init__(
        self,
        source: PathType,
        class_id: int,
        available: int,
        needed: int,
        split: str,
        hint: str = "",
        unit: str = "pixel",
    ) -> None:
        self.source = str(source)
        self.class_id = int(class_id)
        self.available = int(available)
        self.needed = int(needed)
        self.split = split
        self.unit = unit
        self.hint = hint or (
            "lower the per-class counts or fractions, merge or drop the class (set its pixels to 0), or use a"
            " smaller `block_size` for spatially disjoint splits"
        )
        self._args = (self.source, self.class_id, self.available, self.needed, self.split, self.hint, self.unit)
        super().__init__(
            f"Class {self.class_id} of the labels {self.source!r} has {self.available} usable {unit}(s), but the"
            f" split ({split}) needs at least {self.needed}. HINT: {self.hint}."
        )


class MatFileError(_Pickled, ValueError):
    """A MATLAB ``.mat`` file does not hold the arrays we look for (or is in an unsupported format)."""

    def __init__(self, path: PathType, problem: str, variables: dict[str, tuple[int, ...]] | None = None) -> None:
        self.path = str(path)
        self.problem = problem
        self.variables = dict(variables or {})
        found = ", ".join(f"{k}{list(v)}" for k, v in self.variables.items()) or "none"
        self._args = (self.path, self.problem, self.variables)
        super().__init__(
            f"Cannot read {self.path!r}: {problem}. Variables found: {found}. HINT: pass `image_key=`/`labels_key=`"
            " to pick the variables explicitly; MATLAB v7.3 files are HDF5 and must be re-saved with `save(...,"
            " '-v7')` or converted to GeoTIFF."
        )
