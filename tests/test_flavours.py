"""The standalone ``pytorch_lightning`` / ``lightning_fabric`` flavours, built by plain class statements: each run
meets the classes of its own Lightning package only, and ``"heterogeneous"`` is ours in either import order."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lightning_het._flavour import NAMES

REPO = Path(__file__).resolve().parents[1]


def _packages(obj: object) -> set[str]:
    """The top-level packages of ``obj``'s classes (its MRO) or, for a function, of its module."""
    if isinstance(obj, type):
        return {cls.__module__.split(".", 1)[0] for cls in obj.__mro__}
    return {obj.__module__.split(".", 1)[0]}


def _flavour_packages(flavour: object) -> set[str]:
    return set().union(*(_packages(getattr(flavour, name)) for name in NAMES))


def test_each_flavour_holds_the_classes_of_its_own_package_only():
    pytorch_lightning = pytest.importorskip("pytorch_lightning")
    import lightning.pytorch

    from lightning_het import _fabric_compat, _pl_compat
    from lightning_het._flavour import trainer_flavour
    from lightning_het.fabric import HeterogeneousFabricStrategy
    from lightning_het.strategy import HeterogeneousStrategy

    standalone = pytorch_lightning.Trainer(accelerator="cpu", devices=1, logger=False)
    unified = lightning.pytorch.Trainer(accelerator="cpu", devices=1, logger=False)
    assert trainer_flavour(standalone) is _pl_compat is trainer_flavour(_pl_compat.HeterogeneousStrategy)
    assert trainer_flavour(unified) is trainer_flavour(HeterogeneousStrategy)
    standalone_packages = {"pytorch_lightning", "lightning_fabric"}
    assert "lightning" not in _flavour_packages(trainer_flavour(standalone))
    assert _flavour_packages(trainer_flavour(standalone)) & standalone_packages
    assert "lightning" in _flavour_packages(trainer_flavour(unified))
    assert not _flavour_packages(trainer_flavour(unified)) & standalone_packages
    # the Fabric strategies carry their package's one class: its sampler wrapper
    assert _fabric_compat.HeterogeneousFabricStrategy.sampler_wrapper.__module__.split(".")[0] == "lightning_fabric"
    assert HeterogeneousFabricStrategy.sampler_wrapper.__module__.split(".")[0] == "lightning"
    for cls in (_pl_compat.HeterogeneousStrategy, _fabric_compat.HeterogeneousFabricStrategy):
        assert "lightning" not in _packages(cls)
    for cls in (HeterogeneousStrategy, HeterogeneousFabricStrategy):
        assert not _packages(cls) & standalone_packages
    # the same behaviour (one class body), on each package's DDPStrategy
    assert _pl_compat.HeterogeneousStrategy.setup is HeterogeneousStrategy.setup
    assert issubclass(_pl_compat.HeterogeneousStrategy, pytorch_lightning.strategies.DDPStrategy)
    assert not issubclass(_pl_compat.HeterogeneousStrategy, lightning.pytorch.strategies.DDPStrategy)


def _run(code: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
        cwd=REPO,
    )


@pytest.mark.parametrize(
    "imports",
    ["import pytorch_lightning as P\nimport lightning_het", "import lightning_het\nimport pytorch_lightning as P"],
    ids=["pytorch_lightning-first", "lightning_het-first"],
)
def test_standalone_trainer_gets_our_strategy_in_either_import_order(imports):
    pytest.importorskip("pytorch_lightning")
    result = _run(
        imports
        + """
        import lightning.pytorch
        from lightning_het import _pl_compat
        strategy = P.Trainer(accelerator="cpu", devices=2, strategy="heterogeneous", logger=False).strategy
        assert type(strategy) is _pl_compat.HeterogeneousStrategy, type(strategy)
        assert isinstance(strategy, P.strategies.DDPStrategy)
        assert not isinstance(strategy, lightning.pytorch.strategies.DDPStrategy)
        unified = lightning.pytorch.Trainer(accelerator="cpu", devices=2, strategy="heterogeneous", logger=False)
        assert type(unified.strategy) is lightning_het.HeterogeneousStrategy
        print("ok")
        """.replace("\n        ", "\n")
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")


_STANDALONE_FIT = """
import sys
import warnings
from pathlib import Path

import pytorch_lightning as P
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_het.pl import HeterogeneousStrategy

FOREIGN = []  # classes of lightning.* met in the run


class Check(P.Callback):
    def on_train_batch_end(self, trainer, *args):
        for obj in (*trainer.callbacks, trainer.strategy, trainer.strategy.launcher, trainer.accelerator):
            FOREIGN.extend(c for c in type(obj).__mro__ if c.__module__.split(".")[0] == "lightning")


class Tiny(P.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(root, ckpt=None, save_every=0):
    P.seed_everything(0)
    callbacks = [Check()]
    if save_every:
        callbacks.append(P.callbacks.ModelCheckpoint(root, "{step}", save_top_k=-1, every_n_train_steps=save_every))
    trainer = P.Trainer(
        accelerator="cpu", devices=1, max_epochs=2, logger=False, callbacks=callbacks, enable_progress_bar=False,
        enable_checkpointing=bool(save_every), enable_model_summary=False, default_root_dir=root,
        strategy=HeterogeneousStrategy(speeds=[1.0], global_batch_size=8, process_group_backend="gloo"),
    )
    data = TensorDataset(torch.randn(40, 4))
    trainer.fit(Tiny(), DataLoader(data, batch_size=4, shuffle=True), ckpt_path=ckpt)
    return trainer


root = Path(sys.argv[1])
fit(root / "first", save_every=7)  # 5 steps per epoch: step 7 is in the middle of epoch 1
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    trainer = fit(root / "resumed", ckpt=str(root / "first" / "step=7.ckpt"))
assert trainer.global_step == 10, trainer.global_step
assert not FOREIGN, FOREIGN
not_resumable = [str(w.message) for w in caught if "dataloader is not resumable" in str(w.message)]
assert not not_resumable, not_resumable  # the sampler resumes mid-epoch: pytorch_lightning's own warning silenced
print("ok")
"""


def test_a_standalone_fit_meets_only_its_packages_objects_and_resumes_mid_epoch_quietly(tmp_path):
    """A ``pytorch_lightning`` fit: the callbacks, launcher and accelerator the strategy gives its trainer are that
    package's; a mid-epoch resume silences that package's "not resumable" warning (a class of its own)."""
    pytest.importorskip("pytorch_lightning")
    result = _run(_STANDALONE_FIT, str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")
