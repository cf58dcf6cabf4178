"""``HSIClassifier``: the LightningModule that trains and evaluates a patch classifier on hyperspectral scenes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics.classification import MulticlassConfusionMatrix

from lightning_het.hsi.metrics import classification_metrics, per_class_accuracy, summarize_confusion
from lightning_het.hsi.networks import NETWORKS, build_network

__all__ = ["HSIClassifier"]

_SHAPE_ATTRS = (("in_bands", "num_bands"), ("num_classes", "num_classes"), ("patch_size", "patch_size"))


def _unpack(batch: Any) -> tuple[Tensor, Tensor]:
    """``(image, label)`` from a sample dict (:mod:`lightning_het.hsi.datasets`) or an ``(x, y, ...)`` tuple."""
    if isinstance(batch, Mapping):
        return batch["image"], batch["label"]
    return batch[0], batch[1]


class HSIClassifier(pl.LightningModule):
    """Pixel classification of hyperspectral patches with OA / AA / kappa measured by torchmetrics.

    ``network``: a name of :data:`~lightning_het.hsi.networks.NETWORKS`, built with ``network_kwargs`` (``width``,
    ``dropout``); ``weight_decay`` is decoupled for ``optimizer="adamw"``; ``momentum`` is SGD's. ``in_bands``,
    ``num_classes`` and ``patch_size`` come from the datamodule when ``None``.
    """

    def __init__(
        self,
        network: str = "cnn2d",
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        *,
        optimizer: Literal["adam", "adamw", "sgd"] = "adam",
        momentum: float = 0.9,
        in_bands: int | None = None,
        num_classes: int | None = None,
        patch_size: int | None = None,
        network_kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if network not in NETWORKS:
            raise ValueError(f"Expected argument `network` to be one of {sorted(NETWORKS)}, but got {network!r}.")
        if optimizer not in ("adam", "adamw", "sgd"):
            raise ValueError(f"Expected argument `optimizer` to be 'adam', 'adamw' or 'sgd', but got {optimizer!r}.")
        if not lr > 0:
            raise ValueError(f"Expected argument `lr` to be positive, but got {lr!r}.")
        # the sizes enter `hparams` only once known (see `_build`): a datamodule with `patch_size`/`num_classes`
        # hparams of its own would otherwise clash with our `None`s when Lightning merges them for the loggers
        self.save_hyperparameters(ignore=[arg for arg, _ in _SHAPE_ATTRS])
        self.net: nn.Module | None = None
        self.test_results: dict[str, Any] = {}
        self._in_bands, self._num_classes, self._patch_size = in_bands, num_classes, patch_size
        if in_bands is not None and num_classes is not None and patch_size is not None:
            self._build(in_bands, num_classes, patch_size)

    def _build(self, in_bands: int, num_classes: int, patch_size: int) -> None:
        self.net = build_network(
            self.hparams.network, in_bands, num_classes, patch_size, **(self.hparams.network_kwargs or {})
        )
        self.val_metrics = classification_metrics(num_classes, prefix="val/")
        self.test_metrics = classification_metrics(num_classes, prefix="test/")
        self.test_confusion = MulticlassConfusionMatrix(num_classes=num_classes)
        self.hparams.update(in_bands=in_bands, num_classes=num_classes, patch_size=patch_size)

    def configure_model(self) -> None:
        """Build the network from the datamodule's shapes when they were not given (once; later calls do nothing)."""
        if self.net is not None:
            return
        datamodule = getattr(self.trainer, "datamodule", None)
        missing = [attr for _, attr in _SHAPE_ATTRS if not hasattr(datamodule, attr)]
        if missing:
            raise RuntimeError(
                f"You created HSIClassifier without in_bands/num_classes/patch_size, but the trainer's datamodule"
                f" ({type(datamodule).__name__}) does not provide {missing}. HINT: pass a HyperspectralDataModule to"
                " trainer.fit(model, datamodule=...) or give the three sizes explicitly."
            )
        sizes = []
        for (arg, attr), given in zip(_SHAPE_ATTRS, (self._in_bands, self._num_classes, self._patch_size)):
            served = int(getattr(datamodule, attr))
            if given is not None and given != served:
                raise ValueError(
                    f"You set {arg}={given} on HSIClassifier, but the datamodule serves {attr}={served}. HINT: leave"
                    f" `{arg}` unset (None) to take it from the data."
                )
            sizes.append(served)
        self._build(*sizes)

    def _net(self) -> nn.Module:
        if self.net is None:
            raise RuntimeError(
                "HSIClassifier has no network yet. HINT: run it through a Trainer with a HyperspectralDataModule"
                " (configure_model builds it) or pass in_bands, num_classes and patch_size."
            )
        return self.net

    def forward(self, x: Tensor) -> Tensor:
        """Logits ``(N, C)`` of patches ``(N, bands, p, p)``."""
        return self._net()(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = _unpack(batch)
        loss = F.cross_entropy(self(x), y)
        self.log("train/loss", loss, on_step=False, on_epoch=True, prog_bar=True, batch_size=len(y), sync_dist=True)
        return loss

    def _evaluate(self, batch: Any, stage: str) -> None:
        x, y = _unpack(batch)
        logits = self(x)
        self.log(f"{stage}/loss", F.cross_entropy(logits, y), on_epoch=True, batch_size=len(y), sync_dist=True)
        preds = logits.argmax(dim=1)
        metrics = self.val_metrics if stage == "val" else self.test_metrics
        metrics.update(preds, y)
        self.log_dict(metrics, on_step=False, on_epoch=True, batch_size=len(y), prog_bar=stage == "val")
        if stage == "test":
            self.test_confusion.update(preds, y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def on_test_epoch_end(self) -> None:
        confusion = self.test_confusion.compute()  # summed over replicas
        self.test_confusion.reset()
        for c, acc in enumerate(per_class_accuracy(confusion).tolist(), start=1):
            if acc == acc:  # skip classes absent from the test set (NaN)
                self.log(f"test/acc_class_{c}", acc, sync_dist=True)
        self.test_results = {**summarize_confusion(confusion), "confusion": confusion.tolist()}

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> dict[str, Tensor]:
        """Class indices ``0..C-1`` per sample (``-1`` where the centre pixel is nodata), with its ``row``/``col``."""
        x = batch["image"] if isinstance(batch, Mapping) else batch[0]
        pred = self(x).argmax(dim=1)
        if isinstance(batch, Mapping) and "valid" in batch:
            pred = torch.where(batch["valid"], pred, torch.full_like(pred, -1))
        out = {"pred": pred.cpu()}
        if isinstance(batch, Mapping):
            out.update(row=batch["row"].cpu(), col=batch["col"].cpu())
        return out

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params: Sequence[nn.Parameter] = list(self.parameters())
        hp = self.hparams
        if hp.optimizer == "sgd":
            return torch.optim.SGD(params, lr=hp.lr, momentum=hp.momentum, weight_decay=hp.weight_decay)
        optim = torch.optim.AdamW if hp.optimizer == "adamw" else torch.optim.Adam
        return optim(params, lr=hp.lr, weight_decay=hp.weight_decay)
