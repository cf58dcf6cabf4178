"""Land-cover classification metrics on torchmetrics: OA, AA, Cohen's kappa, per-class accuracy, confusion matrix."""

from __future__ import annotations

import torch
from torch import Tensor
from torchmetrics import MetricCollection
from torchmetrics.classification import MulticlassAccuracy, MulticlassCohenKappa, MulticlassStatScores

__all__ = ["AverageAccuracy", "classification_metrics", "per_class_accuracy", "summarize_confusion"]


class AverageAccuracy(MulticlassStatScores):
    """Average accuracy (AA): the mean per-class recall over the classes present in the reference.

    Example:
        >>> aa = AverageAccuracy(num_classes=4)
        >>> aa(torch.tensor([0, 0, 1, 2, 2, 3]), torch.tensor([0, 1, 1, 2, 2, 2]))
        tensor(0.7222)
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    def __init__(self, num_classes: int, **kwargs: object) -> None:
        kwargs.pop("average", None)
        super().__init__(num_classes=num_classes, average=None, **kwargs)  # type: ignore[arg-type]

    def compute(self) -> Tensor:
        tp, _, _, fn = self._final_state()
        support = tp + fn
        present = support > 0
        if not present.any():
            return torch.tensor(0.0, device=tp.device)
        return (tp[present].float() / support[present].float()).mean()


def classification_metrics(num_classes: int, prefix: str = "") -> MetricCollection:
    """The scalar metrics of a land-cover map: ``oa``, ``aa`` and ``kappa`` (keys prefixed with ``prefix``).

    Example:
        >>> metrics = classification_metrics(2, prefix="test/")
        >>> values = metrics(torch.tensor([0, 0, 0, 1, 1, 1, 1, 1]), torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]))
        >>> {k: round(float(v), 4) for k, v in sorted(values.items())}
        {'test/aa': 0.875, 'test/kappa': 0.75, 'test/oa': 0.875}
    """
    return MetricCollection(
        {
            "oa": MulticlassAccuracy(num_classes=num_classes, average="micro"),
            "aa": AverageAccuracy(num_classes=num_classes),
            "kappa": MulticlassCohenKappa(num_classes=num_classes),
        },
        prefix=prefix,
    )


def per_class_accuracy(confusion: Tensor) -> Tensor:
    """Per-class accuracy ``M[c, c] / sum(M[c, :])`` (rows = reference); NaN for absent classes.

    Example:
        >>> per_class_accuracy(torch.tensor([[3, 1], [0, 4]])).tolist()
        [0.75, 1.0]
    """
    confusion = confusion.double()
    support = confusion.sum(dim=1)
    diag = torch.diagonal(confusion)
    return torch.where(support > 0, diag / support.clamp(min=1), torch.full_like(diag, float("nan")))


def summarize_confusion(confusion: Tensor) -> dict[str, float | list[float]]:
    """OA, AA, kappa and per-class accuracy computed from a confusion matrix (pure; same definitions as the metrics).

    Example:
        >>> summarize_confusion(torch.tensor([[3, 1], [0, 4]]))
        {'oa': 0.875, 'aa': 0.875, 'kappa': 0.75, 'per_class': [0.75, 1.0]}
    """
    m = confusion.double()
    n = m.sum()
    if n == 0:
        return {"oa": 0.0, "aa": 0.0, "kappa": 0.0, "per_class": [float("nan")] * m.shape[0]}
    oa = torch.trace(m) / n
    per_class = per_class_accuracy(m)
    aa = per_class[~torch.isnan(per_class)].mean()
    pe = (m.sum(dim=0) * m.sum(dim=1)).sum() / n**2
    kappa = (oa - pe) / (1 - pe) if pe < 1 else torch.tensor(1.0 if oa == 1 else 0.0, dtype=torch.float64)
    return {"oa": float(oa), "aa": float(aa), "kappa": float(kappa), "per_class": per_class.tolist()}
