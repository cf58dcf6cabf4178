"""``HeterogeneousDataModule``: a LightningDataModule whose loaders follow the strategy's allocation."""

from __future__ import annotations

import lightning.pytorch as pl
from torch.utils.data import DataLoader, Dataset

from lightning_het.data.splitting import as_batch_size


class HeterogeneousDataModule(pl.LightningDataModule):
    """Base class for data modules trained with ``HeterogeneousStrategy``: ``global_batch_size`` over all replicas;
    subclasses set ``train_dataset``, ``val_dataset``, ... in ``setup()``."""

    def __init__(
        self,
        global_batch_size: int = 64,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
        pin_memory: bool = False,
    ) -> None:
        super().__init__()
        if as_batch_size(global_batch_size) is None:  # a Python or NumPy integer >= 1
            raise ValueError(f"Expected `global_batch_size` to be a positive integer, got {global_batch_size!r}.")
        if eval_batch_size is not None and (not isinstance(eval_batch_size, int) or eval_batch_size < 1):
            raise ValueError(f"Expected argument `eval_batch_size` to be a positive integer, got {eval_batch_size!r}.")
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"Expected argument `num_workers` to be a non-negative integer, got {num_workers!r}.")
        self.global_batch_size = int(global_batch_size)
        self.eval_batch_size = eval_batch_size or self.global_batch_size
        self.num_workers, self.pin_memory = num_workers, pin_memory
        self.train_dataset: Dataset | None = None
        self.val_dataset: Dataset | None = None
        self.test_dataset: Dataset | None = None
        self.predict_dataset: Dataset | None = None

    @property
    def world_size(self) -> int:
        """Number of replicas of the attached trainer (1 before one is attached)."""
        return self.trainer.world_size if self.trainer is not None else 1

    def _loader(self, name: str, batch_size: int, shuffle: bool = False) -> DataLoader:
        dataset = getattr(self, f"{name}_dataset", None)
        if dataset is None:
            raise RuntimeError(f"{type(self).__name__}.setup() did not set `{name}_dataset`.")
        return DataLoader(
            dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", max(1, self.global_batch_size // self.world_size), shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", self.eval_batch_size)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", self.eval_batch_size)

    def predict_dataloader(self) -> DataLoader:
        return self._loader("predict", self.eval_batch_size)
