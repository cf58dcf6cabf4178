"""Splits: stratified random (fraction or count per class) and spatially disjoint blocks with zero patch overlap."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from lightning_het.hsi.errors import ClassTooSmallError, NoLabelledPixelsError
from lightning_het.hsi.splits import block_split, dilate, footprint_mask, format_class_counts, random_split
from lightning_het.hsi.synthetic import make_synthetic_scene


@pytest.fixture(scope="module")
def labels() -> np.ndarray:
    return make_synthetic_scene(60, 50, 4, 5, seed=2, region_scale=8.0).labels.astype(np.int64)


def _check_partition(split, labels):
    parts = [split.train, split.val, split.test]
    everything = np.concatenate(parts)
    assert len(np.unique(everything)) == everything.size  # disjoint
    assert np.all(labels.reshape(-1)[everything] > 0)  # only labelled pixels
    return everything


class TestRandom:
    def test_fractions_per_class(self, labels):
        split = random_split(labels, train=0.3, val=0.1, seed=0)
        everything = _check_partition(split, labels)
        assert everything.size == np.count_nonzero(labels)  # every labelled pixel is used
        counts = split.class_counts(labels, 5)
        totals = np.bincount(labels.reshape(-1), minlength=6)[1:]
        assert counts["train"] == [max(1, round(0.3 * n)) for n in totals]
        assert counts["val"] == [max(1, round(0.1 * n)) for n in totals]

    def test_counts_per_class_and_seeding(self, labels):
        a = random_split(labels, train=7, val=3, seed=1)
        assert a.class_counts(labels, 5)["train"] == [7] * 5 and a.class_counts(labels, 5)["val"] == [3] * 5
        b = random_split(labels, train=7, val=3, seed=1)
        c = random_split(labels, train=7, val=3, seed=2)
        np.testing.assert_array_equal(a.train, b.train)
        assert not np.array_equal(a.train, c.train)

    def test_class_too_small_names_file_and_class(self):
        lab = np.zeros((5, 5), dtype=np.int64)
        lab[0, :10] = 1
        lab[2, 0:2] = 2
        with pytest.raises(
            ClassTooSmallError,
            match=r"Class 2 of the labels 'gt.tif' has 2 usable pixel\(s\).*"
            r"train_per_class=2.*needs at least 4",
        ):
            random_split(lab, train=2, val=1, source="gt.tif")

    def test_no_labels_and_missing_class(self, caplog):
        with pytest.raises(NoLabelledPixelsError, match=r"'empty.tif' contain no labelled pixel"):
            random_split(np.zeros((4, 4), dtype=np.int64), train=0.5, source="empty.tif")
        lab = np.ones((4, 4), dtype=np.int64)
        with caplog.at_level(logging.WARNING):
            split = random_split(lab, train=0.5, num_classes=2)
        assert "Class 2 has no labelled pixel" in caplog.text and split.train.size == 8

    def test_bad_amounts(self, labels):
        with pytest.raises(ValueError, match="`train` to be a fraction in"):
            random_split(labels, train=1.5)
        with pytest.raises(ValueError, match="`val` to be a count >= 0"):
            random_split(labels, train=0.3, val=-1)

    def test_format_class_counts(self, labels):
        text = format_class_counts(random_split(labels, train=5, seed=0).class_counts(labels, 5))
        assert text.splitlines()[0].split() == ["class", "train", "val", "test"]
        assert text.splitlines()[-1].split()[:3] == ["total", "25", "0"]


class TestBlocks:
    @pytest.mark.parametrize(("patch_size", "block_size"), [(1, 8), (5, 10), (7, 16)])
    def test_train_and_eval_footprints_never_overlap(self, labels, patch_size, block_size):
        split = block_split(labels, train=0.4, val=0.1, block_size=block_size, patch_size=patch_size, seed=0)
        _check_partition(split, labels)
        train_fp = footprint_mask(split.train, labels.shape, patch_size)
        for name in ("val", "test"):
            other_fp = footprint_mask(getattr(split, name), labels.shape, patch_size)
            assert not np.any(train_fp & other_fp), name
        counts = split.class_counts(labels, 5)
        assert all(n > 0 for n in counts["train"]) and all(n > 0 for n in counts["test"])
        share = sum(counts["train"]) / np.count_nonzero(labels)
        assert 0.25 < share < 0.55  # close to the 0.4 target despite whole blocks

    def test_blocks_are_whole(self, labels):
        split = block_split(labels, train=0.4, block_size=10, patch_size=1, seed=3)
        block = lambda idx: set(((idx // 50) // 10 * 5 + (idx % 50) // 10).tolist())  # noqa: E731
        assert not block(split.train) & block(split.test)

    def test_seeded(self, labels):
        a = block_split(labels, train=0.3, block_size=8, seed=4)
        b = block_split(labels, train=0.3, block_size=8, seed=4)
        np.testing.assert_array_equal(a.test, b.test)

    def test_block_too_large_for_a_class(self):
        lab = np.ones((20, 20), dtype=np.int64)
        lab[:3, :3] = 2
        with pytest.raises(ClassTooSmallError, match=r"Class 2 .* has 1 usable block\(s\).*blocks of 10x10 px"):
            block_split(lab, train=0.5, block_size=10, source="gt.tif")


def test_dilate_matches_brute_force():
    rng = np.random.default_rng(0)
    mask = rng.random((13, 11)) < 0.05
    for radius in (0, 1, 3):
        expected = np.zeros_like(mask)
        for r, c in zip(*np.nonzero(mask)):
            expected[max(r - radius, 0) : r + radius + 1, max(c - radius, 0) : c + radius + 1] = True
        np.testing.assert_array_equal(dilate(mask, radius), expected)
