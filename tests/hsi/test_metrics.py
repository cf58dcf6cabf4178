"""OA / AA / kappa / per-class / confusion: definitions and exactness across uneven shards."""

from __future__ import annotations

import pytest
import torch
from torchmetrics.classification import MulticlassAccuracy, MulticlassConfusionMatrix

from lightning_het.hsi.metrics import AverageAccuracy, classification_metrics, per_class_accuracy, summarize_confusion


def _reference(preds: torch.Tensor, target: torch.Tensor, classes: int) -> dict[str, float]:
    """Textbook definitions, written out with Python loops."""
    n = len(target)
    m = [[0] * classes for _ in range(classes)]
    for p, t in zip(preds.tolist(), target.tolist()):
        m[t][p] += 1
    oa = sum(m[c][c] for c in range(classes)) / n
    recalls = [m[c][c] / sum(m[c]) for c in range(classes) if sum(m[c]) > 0]
    pe = sum(sum(m[c]) * sum(row[c] for row in m) for c in range(classes)) / n**2
    return {"oa": oa, "aa": sum(recalls) / len(recalls), "kappa": (oa - pe) / (1 - pe)}


@pytest.fixture
def data():
    g = torch.Generator().manual_seed(0)
    target = torch.randint(0, 5, (200,), generator=g)
    preds = torch.where(torch.rand(200, generator=g) < 0.7, target, torch.randint(0, 5, (200,), generator=g))
    return preds, target


def test_definitions(data):
    preds, target = data
    metrics = classification_metrics(5, prefix="test/")
    values = {k.removeprefix("test/"): float(v) for k, v in metrics(preds, target).items()}
    expected = _reference(preds, target, 5)
    assert values == pytest.approx(expected, abs=1e-6)
    confusion = MulticlassConfusionMatrix(num_classes=5)(preds, target)
    summary = summarize_confusion(confusion)
    assert {k: summary[k] for k in expected} == pytest.approx(expected, abs=1e-9)
    assert summary["per_class"] == pytest.approx(MulticlassAccuracy(5, average=None)(preds, target).tolist())


def test_average_accuracy_ignores_classes_absent_from_the_reference():
    preds, target = torch.tensor([0, 0, 1, 2, 2, 3]), torch.tensor([0, 1, 1, 2, 2, 2])
    assert float(AverageAccuracy(4)(preds, target)) == pytest.approx((1 + 0.5 + 2 / 3) / 3)
    # torchmetrics' macro average counts the predicted-but-absent class 3 as 0
    assert float(MulticlassAccuracy(4, average="macro")(preds, target)) == pytest.approx((1 + 0.5 + 2 / 3) / 4)
    acc = per_class_accuracy(MulticlassConfusionMatrix(num_classes=4)(preds, target))
    assert acc[:3].tolist() == pytest.approx([1, 0.5, 2 / 3]) and torch.isnan(acc[3])


@pytest.mark.parametrize("cuts", [[2], [30, 170], [1, 5, 194]])
def test_uneven_shards_merge_exactly(data, cuts):
    """Summing the counts of uneven shards (what a distributed sync does) equals the pooled metric."""
    preds, target = data
    bounds = [0, *cuts, len(target)]
    shards = [classification_metrics(5) for _ in range(len(bounds) - 1)]
    for metric, lo, hi in zip(shards, bounds[:-1], bounds[1:]):
        metric.update(preds[lo:hi], target[lo:hi])
    merged = shards[0]
    for other in shards[1:]:
        for name in merged:
            merged[name].merge_state(other[name])
    pooled = classification_metrics(5)(preds, target)
    for name, value in merged.compute().items():
        assert float(value) == pytest.approx(float(pooled[name]), abs=1e-7), name
    per_shard_mean = sum(float(s["oa"].compute()) for s in shards) / len(shards)
    assert per_shard_mean != pytest.approx(float(pooled["oa"]), abs=1e-4)  # the naive mean is biased


def test_summarize_empty_confusion():
    summary = summarize_confusion(torch.zeros(3, 3))
    assert summary["oa"] == 0.0 and len(summary["per_class"]) == 3
