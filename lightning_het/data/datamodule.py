"""``HeterogeneousDataModule``: a LightningDataModule whose loaders follow the strategy's allocation."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from torch.utils.data import DataLoader, Dataset

from lightning_het.data.loaders import as_batch_size


class HeterogeneousDataModule(pl.LightningDataModule):
    """Base class for data modules trained with ``HeterogeneousStrategy`` (under another strategy each process gets
    ``global_batch_size // world_size``).

    ``global_batch_size``: samples per optimizer step over all replicas, read by the strategy when its own is not set;
    ``eval_batch_size`` (default ``global_batch_size``): per replica for predict, the mean over replicas for validation
    and test (fast replicas get larger batches); ``num_workers`` and ``pin_memory`` go to every loader.
    """

    def __init__(
        self,
        global_batch_size: int = 64,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
        pin_memory: bool = False,
    ) -> None:
        super().__init__()
        if as_batch_size(global_batch_size) is None:  # a Python or NumPy integer >= 1
            raise ValueError(
                f"Expected argument `global_batch_size` to be a positive integer, got {global_batch_size!r}."
            )
        global_batch_size = int(global_batch_size)
        if eval_batch_size is not None and (not isinstance(eval_batch_size, int) or eval_batch_size < 1):
            raise ValueError(f"Expected argument `eval_batch_size` to be a positive integer, got {eval_batch_size!r}.")
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"Expected argument `num_workers` to be a non-negative integer, got {num_workers!r}.")
        self.global_batch_size = global_batch_size
        self.eval_batch_size = eval_batch_size or global_batch_size
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.train_dataset: Dataset | None = None
        self.val_dataset: Dataset | None = None
        self.test_dataset: Dataset | None = None
        self.predict_dataset: Dataset | None = None

    @property
    def world_size(self) -> int:
        """Number of replicas of the attached trainer (1 before one is attached)."""
        trainer = self.trainer
        return trainer.world_size if trainer is not None else 1

    def _dataset(self, name: str) -> Dataset:
        dataset = getattr(self, f"{name}_dataset", None)
        if dataset is None:
            raise RuntimeError(
                f"{type(self).__name__}.setup() did not set `{name}_dataset`; set it before asking for the"
                f" {name} loader."
            )
        return dataset

    def _loader(self, dataset: Dataset, batch_size: int, shuffle: bool, **kwargs: Any) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=self.num_workers > 0,
            **kwargs,
        )

    def train_dataloader(self) -> DataLoader:
        per_replica = max(1, self.global_batch_size // self.world_size)
        return self._loader(self._dataset("train"), per_replica, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self._dataset("val"), self.eval_batch_size, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self._dataset("test"), self.eval_batch_size, shuffle=False)

    def predict_dataloader(self) -> DataLoader:
        return self._loader(self._dataset("predict"), self.eval_batch_size, shuffle=False)
