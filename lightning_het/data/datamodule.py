"""``HeterogeneousDataModule``: a LightningDataModule whose loaders follow the strategy's allocation."""

from __future__ import annotations

import lightning.pytorch as pl
from torch.utils.data import DataLoader, Dataset

from lightning_het.arguments import positive_int


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
        self.global_batch_size = positive_int("global_batch_size", global_batch_size, allow_none=False)
        self.eval_batch_size = positive_int("eval_batch_size", eval_batch_size) or self.global_batch_size
        self.num_workers = positive_int("num_workers", num_workers, allow_none=False, minimum=0)
        self.pin_memory = pin_memory
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
