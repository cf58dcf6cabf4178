"""Train/validation/test splits of the labelled pixels of a scene: stratified random or spatially disjoint blocks."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import numpy as np

from lightning_het.hsi.errors import ClassTooSmallError, NoLabelledPixelsError

__all__ = ["Split", "block_split", "dilate", "footprint_mask", "format_class_counts", "random_split"]

log = logging.getLogger(__name__)

SPLITS = ("train", "val", "test")


@dataclass(frozen=True)
class Split:
    """Flat pixel indices (``row * width + col``, sorted ``int64``) of each subset (``val`` may be empty)."""

    train: np.ndarray
    val: np.ndarray
    test: np.ndarray
    shape: tuple[int, int]  # (height, width) of the scene

    def class_counts(self, labels: np.ndarray, num_classes: int) -> dict[str, list[int]]:
        """Pixels per class (index ``c - 1`` for class ``c``) in each subset."""
        flat = labels.reshape(-1)
        return {name: np.bincount(flat[getattr(self, name)], minlength=num_classes + 1)[1:].tolist() for name in SPLITS}


def format_class_counts(counts: dict[str, list[int]], class_names: list[str] | None = None) -> str:
    """A small text table of :meth:`Split.class_counts`, one row per class, for logs.

    Example:
        >>> print(format_class_counts({"train": [1, 1], "val": [0, 0], "test": [3, 2]}, ["grass", "water"]))
        class      train     val    test
        grass          1       0       3
        water          1       0       2
        total          2       0       5
    """
    num = len(counts["train"])
    names = class_names or [f"class_{c}" for c in range(1, num + 1)]
    width = max(8, *(len(n) for n in names))
    lines = [f"{'class':<{width}} {'train':>7} {'val':>7} {'test':>7}"]
    lines += [
        f"{names[c]:<{width}} {counts['train'][c]:>7} {counts['val'][c]:>7} {counts['test'][c]:>7}" for c in range(num)
    ]
    lines.append(f"{'total':<{width}} {sum(counts['train']):>7} {sum(counts['val']):>7} {sum(counts['test']):>7}")
    return "\n".join(lines)


def _check_amount(name: str, value: float | int, allow_zero: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"Expected argument `{name}` to be a fraction in (0, 1) or a count >= 1, but got {value!r}.")
    if isinstance(value, (int, np.integer)):
        if value < (0 if allow_zero else 1):
            raise ValueError(f"Expected argument `{name}` to be a count >= {0 if allow_zero else 1}, but got {value}.")
    elif not (0 <= value < 1 if allow_zero else 0 < value < 1):
        raise ValueError(
            f"Expected argument `{name}` to be a fraction in {'[0' if allow_zero else '(0'}, 1), but got {value}."
        )


def _amount(value: float | int, available: int) -> int:
    """Pixels to take from ``available``: a count as is, a fraction rounded (at least 1 when the fraction is > 0)."""
    if isinstance(value, (int, np.integer)):
        return int(value)
    return max(1, round(value * available)) if value > 0 else 0


def _class_pixels(labels: np.ndarray, num_classes: int, source: str) -> list[np.ndarray]:
    flat = labels.reshape(-1)
    if not np.any(flat > 0):
        raise NoLabelledPixelsError(source)
    order = np.argsort(flat, kind="stable")
    bounds = np.searchsorted(flat[order], np.arange(num_classes + 2))
    return [order[bounds[c] : bounds[c + 1]] for c in range(1, num_classes + 1)]


def _describe(train: float | int, val: float | int) -> str:
    def one(name: str, value: float | int) -> str:
        return f"{name}_per_class={value}" if isinstance(value, (int, np.integer)) else f"{name}_fraction={value}"

    return f"{one('train', train)}, {one('val', val)}, at least 1 test pixel"


def random_split(
    labels: np.ndarray,
    *,
    train: float | int,
    val: float | int = 0,
    seed: int = 0,
    num_classes: int | None = None,
    source: str | os.PathLike = "labels",
) -> Split:
    """Stratified random split of the labelled pixels (``0`` in ``labels``: unlabelled or excluded, e.g. nodata).

    ``train`` and ``val`` (``0``: none) are, per class, a fraction in ``(0, 1)`` of its pixels (rounded, at least 1)
    or a count ``>= 1``; every class present keeps a test pixel, else ``ClassTooSmallError``. ``num_classes``:
    ``labels.max()`` when ``None`` (classes without pixels are skipped with a warning); ``source`` names the labels.

    Example:
        >>> labels = np.array([[1, 1, 1, 2], [2, 2, 0, 1]])
        >>> split = random_split(labels, train=1, seed=0)
        >>> split.train.tolist(), split.test.tolist()
        ([2, 5], [0, 1, 3, 4, 7])
        >>> split.class_counts(labels, num_classes=2)
        {'train': [1, 1], 'val': [0, 0], 'test': [3, 2]}
    """
    _check_amount("train", train, allow_zero=False)
    _check_amount("val", val, allow_zero=True)
    classes = int(labels.max()) if num_classes is None else num_classes
    rng = np.random.default_rng(seed)
    parts: dict[str, list[np.ndarray]] = {name: [] for name in SPLITS}
    for c, pixels in enumerate(_class_pixels(labels, classes, str(source)), start=1):
        if pixels.size == 0:
            log.warning("Class %d has no labelled pixel in %s; it is skipped.", c, source)
            continue
        n_train, n_val = _amount(train, pixels.size), _amount(val, pixels.size)
        if n_train + n_val + 1 > pixels.size:
            raise ClassTooSmallError(source, c, pixels.size, n_train + n_val + 1, _describe(train, val))
        shuffled = rng.permutation(pixels)
        parts["train"].append(shuffled[:n_train])
        parts["val"].append(shuffled[n_train : n_train + n_val])
        parts["test"].append(shuffled[n_train + n_val :])
    return Split(
        **{name: np.sort(np.concatenate(parts[name])).astype(np.int64) for name in SPLITS},
        shape=(int(labels.shape[0]), int(labels.shape[1])),
    )


def dilate(mask: np.ndarray, radius: int) -> np.ndarray:
    """Binary dilation of a 2-D mask by a ``(2*radius+1)`` square (Chebyshev ball), separable, clipped at borders.

    Example:
        >>> dilate(np.eye(3, 4, dtype=bool), 1).astype(int)
        array([[1, 1, 1, 0],
               [1, 1, 1, 1],
               [1, 1, 1, 1]])
    """
    out = mask.astype(bool)
    if radius <= 0:
        return out.copy()
    for axis in (0, 1):
        n = out.shape[axis]
        padded = np.pad(out, [(radius, radius) if a == axis else (0, 0) for a in (0, 1)])
        acc = np.zeros_like(out)
        for k in range(2 * radius + 1):
            acc |= np.take(padded, np.arange(k, k + n), axis=axis)
        out = acc
    return out


def footprint_mask(indices: np.ndarray, shape: tuple[int, int], patch_size: int) -> np.ndarray:
    """Pixels read by the ``patch_size`` patches centred on ``indices``, as a ``(height, width)`` mask.

    Example:
        >>> footprint_mask(np.array([5]), (3, 4), patch_size=3).astype(int)  # pixel 5 is (row 1, col 1)
        array([[1, 1, 1, 0],
               [1, 1, 1, 0],
               [1, 1, 1, 0]])
    """
    return dilate(_centres(indices, shape), patch_size // 2)


def _centres(indices: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    mask = np.zeros(shape, dtype=bool)
    mask.reshape(-1)[np.asarray(indices, dtype=np.int64)] = True
    return mask


def _block_score(hist: np.ndarray, need: np.ndarray, total: np.ndarray) -> float:
    """How much a block with class histogram ``hist`` helps a subset that still ``need``s pixels (overshoot costs)."""
    present = hist > 0
    gain = np.minimum(hist, np.maximum(need, 0)) - 0.5 * np.maximum(hist - np.maximum(need, 0), 0)
    return float((gain[present] / np.maximum(total[present], 1)).sum())


def _greedy_blocks(
    hist: np.ndarray, targets: tuple[np.ndarray, np.ndarray], totals: np.ndarray, order: np.ndarray
) -> np.ndarray:
    """Subset of each block (0 train, 1 val, 2 test), visiting blocks in ``order``."""
    need = [targets[0].copy(), targets[1].copy()]
    assign = np.full(hist.shape[0], 2, dtype=np.int64)
    for b in order:
        scores = [_block_score(hist[b], need[k], totals) for k in (0, 1)]
        k = int(np.argmax(scores))
        if scores[k] > 0:
            assign[b] = k
            need[k] = need[k] - hist[b]
    return assign


def _buffered_subsets(
    subset: np.ndarray, labelled: np.ndarray, shape: tuple[int, int], patch_size: int
) -> list[np.ndarray]:
    """Train / val / test pixels, dropping evaluation pixels whose patch footprint meets a training footprint."""
    train_idx = labelled[subset == 0]
    # two footprints of half-width h overlap iff their centres are within Chebyshev distance 2h
    keep = ~dilate(_centres(train_idx, shape), 2 * (patch_size // 2)).reshape(-1)[labelled]
    return [train_idx, labelled[(subset == 1) & keep], labelled[(subset == 2) & keep]]


def block_split(
    labels: np.ndarray,
    *,
    train: float | int,
    val: float | int = 0,
    block_size: int = 16,
    patch_size: int = 1,
    seed: int = 0,
    num_classes: int | None = None,
    source: str | os.PathLike = "labels",
    trials: int = 32,
) -> Split:
    """Spatially disjoint split: whole ``block_size`` blocks per subset (``trials`` block orders tried), then the
    validation and test pixels within Chebyshev distance ``patch_size - 1`` of a training pixel dropped, so that no
    evaluation patch overlaps a training patch. Other arguments and errors as :func:`random_split`; a class without a
    pixel in a required subset raises ``ClassTooSmallError``.
    """
    _check_amount("train", train, allow_zero=False)
    _check_amount("val", val, allow_zero=True)
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) or block_size < 1:
        raise ValueError(f"Expected argument `block_size` to be a positive integer, but got {block_size!r}.")
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise ValueError(f"Expected argument `trials` to be a positive integer, but got {trials!r}.")
    height, width = labels.shape
    classes = int(labels.max()) if num_classes is None else num_classes
    totals = np.array([p.size for p in _class_pixels(labels, classes, str(source))], dtype=np.float64)
    flat = labels.reshape(-1)
    rows, cols = np.divmod(np.arange(flat.size), width)
    blocks_x = -(-width // block_size)
    block_of = (rows // block_size) * blocks_x + cols // block_size
    labelled = np.nonzero(flat > 0)[0]
    n_blocks = blocks_x * -(-height // block_size)
    hist = np.zeros((n_blocks, classes), dtype=np.float64)
    np.add.at(hist, (block_of[labelled], flat[labelled] - 1), 1.0)

    def target(value: float | int) -> np.ndarray:
        if isinstance(value, (int, np.integer)):
            return np.minimum(float(value), totals)
        return value * totals

    targets = (target(train), target(val))
    with_val = _amount(val, 1) > 0
    required = [True, with_val, True]
    present = totals > 0
    rng = np.random.default_rng(seed)
    candidates = np.nonzero(hist.sum(axis=1) > 0)[0]
    best: tuple[tuple[int, float], list[np.ndarray], list[np.ndarray]] | None = None
    for _ in range(trials):
        assign = _greedy_blocks(hist, targets, totals, rng.permutation(candidates))
        subsets = _buffered_subsets(assign[block_of[labelled]], labelled, (height, width), patch_size)
        counts = [np.bincount(flat[idx], minlength=classes + 1)[1:] for idx in subsets]
        missing = sum(int(np.sum((counts[k] == 0) & present)) for k in range(3) if required[k])
        error = float(sum(np.abs(counts[k] - targets[k])[present].sum() / totals[present].sum() for k in (0, 1)))
        if best is None or (missing, error) < best[0]:
            best = ((missing, error), subsets, counts)
    assert best is not None  # trials >= 1
    (train_idx, val_idx, test_idx), counts = best[1], best[2]
    dropped = labelled.size - train_idx.size - val_idx.size - test_idx.size
    if dropped:
        log.info("Block split dropped %d evaluation pixels whose patches would overlap training patches.", dropped)

    description = f"blocks of {block_size}x{block_size} px, {_describe(train, val)}, patch_size={patch_size}"
    hint = (
        f"every class must span several blocks (try a smaller `block_size`), yet blocks must outlast the"
        f" {2 * (patch_size // 2)}-pixel buffer dropped around training pixels (a larger `block_size` or a smaller"
        " `patch_size`); lowering the train/val targets also helps"
    )
    for k, name in enumerate(SPLITS):
        if not required[k]:
            continue
        for c in np.nonzero((counts[k] == 0) & present)[0]:
            blocks, reason = int((hist[:, c] > 0).sum()), f"{description}; it got no {name} pixel"
            raise ClassTooSmallError(source, int(c) + 1, blocks, 3 if with_val else 2, reason, hint, unit="block")
    for c in np.nonzero(totals == 0)[0]:
        log.warning("Class %d has no labelled pixel in %s; it is skipped.", int(c) + 1, source)
    return Split(train=np.sort(train_idx), val=np.sort(val_idx), test=np.sort(test_idx), shape=(height, width))
