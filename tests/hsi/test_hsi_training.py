"""Two CPU replicas with speeds 1:3 train the HSI pipeline: accuracy, and equality with one process on the same global
batches."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_het import HeterogeneousStrategy, ProportionalDistributedSampler
from lightning_het.hsi import HyperspectralDataModule
from lightning_het.hsi.metrics import classification_metrics
from lightning_het.hsi.model import HSIClassifier
from tests.conftest_hsi import TINY_SCENE, quiet_trainer, torch_single_thread

__all__ = ["torch_single_thread"]

SEED = 0
GLOBAL_BATCH = 24
EPOCHS = 3
LR = 3e-3


def _model(dm: HyperspectralDataModule) -> HSIClassifier:
    torch.manual_seed(SEED)  # identical initial weights for both runs
    return HSIClassifier(
        "cnn2d",
        lr=LR,
        in_bands=dm.num_bands,
        num_classes=dm.num_classes,
        patch_size=dm.patch_size,
        network_kwargs={"width": 16},
    )


def _single_process_reference(dm: HyperspectralDataModule) -> dict[str, torch.Tensor]:
    """Plain torch, one process, the whole global batch per step, in the order the strategy cuts global batches from:
    ``ProportionalDistributedSampler(dataset, [B], 0, seed=PL_GLOBAL_SEED)``, re-permuted every epoch."""
    model = _model(dm)
    optimizer = model.configure_optimizers()
    sampler = ProportionalDistributedSampler(dm.train_dataset, [GLOBAL_BATCH], 0, seed=SEED)
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for batch in DataLoader(dm.train_dataset, batch_size=GLOBAL_BATCH, sampler=sampler):
            loss = torch.nn.functional.cross_entropy(model(batch["image"]), batch["label"])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return {k: v.detach().clone() for k, v in model.net.state_dict().items()}


def _evaluate(model: HSIClassifier, dataset) -> dict[str, float]:
    metrics = classification_metrics(model.hparams.num_classes)
    model.eval()
    with torch.no_grad():
        for batch in DataLoader(dataset, batch_size=512):
            metrics.update(model(batch["image"]).argmax(dim=1), batch["label"])
    return {k: float(v) for k, v in metrics.compute().items()}


def test_uneven_replicas_learn_and_match_one_process():
    dm = HyperspectralDataModule(synthetic=TINY_SCENE, patch_size=5, global_batch_size=GLOBAL_BATCH, seed=SEED)
    dm.setup()
    model = _model(dm)
    initial = {k: v.clone() for k, v in model.net.state_dict().items()}
    pl.seed_everything(SEED)  # PL_GLOBAL_SEED: the seed of the global batch order
    # fork: the replicas start from this process as it is, without importing torch and Lightning again (spawn
    # spent most of the test doing that)
    strategy = HeterogeneousStrategy(speeds=[1, 3], process_group_backend="gloo", start_method="fork")
    trainer = quiet_trainer(devices=2, strategy=strategy, max_epochs=EPOCHS, num_sanity_val_steps=0)
    trainer.fit(model, dm)  # the parent gets rank 0's weights and logged metrics back
    assert trainer.strategy.batch_sizes == [6, 18]

    reference = _single_process_reference(dm)
    assert max((reference[k] - initial[k]).abs().max() for k in initial) > 0.05  # training did move the weights
    for name, value in model.net.state_dict().items():
        torch.testing.assert_close(value, reference[name], atol=1e-5, rtol=0, msg=name)

    # validation metrics were synchronised across replicas that held 1/4 and 3/4 of the samples: exact
    val = _evaluate(model, dm.val_dataset)
    for key in ("oa", "aa", "kappa"):
        assert float(trainer.callback_metrics[f"val/{key}"]) == pytest.approx(val[key], abs=1e-6), key
    test = _evaluate(model, dm.test_dataset)
    assert test["oa"] >= 0.9 and val["oa"] >= 0.9, (val, test)
