"""HSIClassifier: lazy network from the datamodule, metrics logging, learning, checkpoints, predict_step."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from lightning_het.hsi import HyperspectralDataModule
from lightning_het.hsi.model import HSIClassifier
from lightning_het.hsi.networks import NETWORKS
from tests.conftest_hsi import TINY_SCENE, quiet_trainer, torch_single_thread

__all__ = ["torch_single_thread"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A cnn2d fitted for 3 epochs on the tiny synthetic scene, then tested (single process)."""
    torch.manual_seed(0)
    dm = HyperspectralDataModule(synthetic=TINY_SCENE, patch_size=5, global_batch_size=32, seed=0)
    model = HSIClassifier("cnn2d", lr=3e-3)
    trainer = quiet_trainer(max_epochs=3, num_sanity_val_steps=0)
    trainer.fit(model, dm)
    fit_metrics = dict(trainer.callback_metrics)
    test_metrics = trainer.test(model, dm, verbose=False)[0]
    path = tmp_path_factory.mktemp("ckpt") / "model.ckpt"
    trainer.save_checkpoint(path)
    return model, dm, fit_metrics, test_metrics, path


def test_learns_the_synthetic_scene(trained):
    _, _, fit_metrics, test_metrics, _ = trained
    assert {"train/loss", "val/loss", "val/oa", "val/aa", "val/kappa"} <= set(fit_metrics)
    assert test_metrics["test/oa"] >= 0.9 and test_metrics["test/kappa"] >= 0.85
    assert {f"test/acc_class_{c}" for c in range(1, 5)} <= set(test_metrics)


def test_network_built_from_the_datamodule(trained):
    model, *_ = trained
    assert (model.hparams.in_bands, model.hparams.num_classes, model.hparams.patch_size) == (16, 4, 5)
    assert model(torch.zeros(2, 16, 5, 5)).shape == (2, 4)


def test_test_results_agree_with_logged_metrics(trained):
    model, dm, _, test_metrics, _ = trained
    results = model.test_results
    assert results["oa"] == pytest.approx(test_metrics["test/oa"], abs=1e-6)
    assert results["aa"] == pytest.approx(test_metrics["test/aa"], abs=1e-6)
    assert results["kappa"] == pytest.approx(test_metrics["test/kappa"], abs=1e-5)
    confusion = torch.tensor(results["confusion"])
    assert confusion.shape == (4, 4) and int(confusion.sum()) == len(dm.test_dataset)
    assert confusion.sum(dim=1).tolist() == dm.class_counts["test"]
    assert results["per_class"][0] == pytest.approx(test_metrics["test/acc_class_1"], abs=1e-6)


def test_checkpoint_restores_without_the_datamodule(trained):
    model, dm, *_, path = trained
    restored = HSIClassifier.load_from_checkpoint(path)
    x = torch.stack([dm.test_dataset[i]["image"] for i in range(8)])
    model.eval()
    restored.eval()
    torch.testing.assert_close(restored(x), model(x))


def test_predict_step_returns_classes_and_pixels(trained):
    model, dm, *_ = trained
    batch = next(iter(DataLoader(dm.predict_dataset, batch_size=10)))
    batch["valid"][3] = False
    out = model.predict_step(batch, 0)
    assert set(out) == {"pred", "row", "col"} and out["pred"].dtype == torch.int64
    assert int(out["pred"][3]) == -1 and out["pred"][:3].min() >= 0 and out["pred"].max() < 4
    assert out["col"].tolist() == list(range(10)) and out["row"].tolist() == [0] * 10


@pytest.mark.parametrize("network", sorted(NETWORKS))
def test_every_network_runs_a_step(network):
    dm = HyperspectralDataModule(
        synthetic={"height": 16, "width": 16, "bands": 8, "classes": 3},
        patch_size=3,
        global_batch_size=8,
        pca_components=6,
    )
    model = HSIClassifier(network, optimizer="sgd")
    quiet_trainer(fast_dev_run=1).fit(model, dm)
    assert model.hparams.in_bands == 6


def test_errors():
    with pytest.raises(ValueError, match="`network` to be one of"):
        HSIClassifier("vit")
    with pytest.raises(ValueError, match="`optimizer`"):
        HSIClassifier(optimizer="lbfgs")  # type: ignore[arg-type]
    model = HSIClassifier()
    with pytest.raises(RuntimeError, match="has no network yet"):
        model(torch.zeros(1, 3, 5, 5))
    loader = DataLoader([{"image": torch.zeros(3, 5, 5), "label": torch.tensor(0)}] * 4, batch_size=2)
    with pytest.raises(RuntimeError, match=r"does not provide .*num_bands.*HINT"):
        quiet_trainer(fast_dev_run=1).fit(model, loader)


def test_sizes_follow_the_data_and_hparams_merge_with_a_logger(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    dm = HyperspectralDataModule(
        synthetic={"height": 16, "width": 16, "bands": 6, "classes": 3}, patch_size=3, global_batch_size=8
    )
    model = HSIClassifier("cnn3d", patch_size=3)
    quiet_trainer(logger=CSVLogger(tmp_path), max_steps=1, limit_val_batches=0).fit(model, dm)
    assert (model.hparams.in_bands, model.hparams.num_classes, model.hparams.patch_size) == (6, 3, 3)
    with pytest.raises(ValueError, match=r"You set patch_size=5 on HSIClassifier, but the datamodule serves"):
        quiet_trainer(fast_dev_run=1).fit(HSIClassifier(patch_size=5), dm)
