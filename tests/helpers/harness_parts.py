"""What every job of :mod:`tests.helpers.harness` builds the same way: its strategy, a quiet CPU Trainer, the tiny
training loader, and the per-rank dump ``OUT_DIR/rank{r}.pt``.

The Lightning package is the flavour's (:data:`tests.helpers.tiny.pl`, ``lightning.pytorch`` unless the job runs on
the standalone ``pytorch_lightning``).
"""

from __future__ import annotations

import json
import os
import time
import weakref
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_het.config import typed_keywords
from tests.helpers.tiny import HeterogeneousStrategy, make_dataset, pl

#: strategy -> the EmulatedPlatform keywords its spec gave (``make_trainer`` adds the callback)
_PLATFORMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def make_strategy(spec: Any = None, *, gloo: bool = True, **defaults: Any) -> Any:
    """The Trainer ``strategy`` a config names: a string (``"ddp"``, ``"heterogeneous"``) as it is, else a
    :class:`HeterogeneousStrategy` with the keywords ``spec`` (a dict) over ``defaults`` (on gloo unless ``gloo`` is
    false: then the strategy's own default backend)."""
    if isinstance(spec, str):
        return spec
    kwargs = {"process_group_backend": "gloo"} if gloo else {}
    keywords = {**kwargs, **defaults, **(spec or {})}
    if pl.__name__ != "lightning.pytorch":  # the standalone flavour: the flat keywords (deprecated aliases)
        return HeterogeneousStrategy(**keywords)
    keywords, emulation = typed_keywords(keywords)  # the specs' flat keywords in the typed form
    strategy = HeterogeneousStrategy(**keywords)
    if emulation:
        _PLATFORMS[strategy] = emulation
    return strategy


def make_trainer(devices: int, strategy: Any, **kwargs: Any) -> pl.Trainer:
    """A CPU Trainer with no logger, checkpoints, progress bar, model summary or sanity check; ``kwargs`` go to the
    Trainer (and win)."""
    quiet = {
        "accelerator": "cpu",
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
    }
    emulation = _PLATFORMS.get(strategy) if not isinstance(strategy, str) else None
    if emulation:  # the spec's emulate_slowdown / emulate_memory_cap, as the EmulatedPlatform callback
        from lightning_het import EmulatedPlatform

        kwargs["callbacks"] = [*(kwargs.get("callbacks") or []), EmulatedPlatform(**emulation)]
    return pl.Trainer(**{**quiet, "devices": devices, "strategy": strategy, **kwargs})


def train_loader(cfg: dict, n: int, batch_size: int = 4, **kwargs: Any) -> DataLoader:
    """The shuffled tiny regression loader: ``cfg`` may set ``n`` and ``batch_size``, and extra DataLoader keywords
    under ``loader``."""
    dataset = make_dataset(cfg.get("n", n))
    return DataLoader(
        dataset, batch_size=cfg.get("batch_size", batch_size), shuffle=True, **kwargs, **cfg.get("loader", {})
    )


def weights(net: nn.Module) -> dict[str, torch.Tensor]:
    """A detached CPU copy of ``net``'s state dict."""
    return {k: v.detach().cpu().clone() for k, v in net.state_dict().items()}


def save_rank(out: Path, rank: int, record: Any) -> None:
    """This rank's dump: ``OUT_DIR/rank{rank}.pt``."""
    torch.save(record, out / f"rank{rank}.pt")


def fire(out: Path, fault: dict, rank: int, detail: str = "") -> None:
    """An injected fault: write ``OUT_DIR/fault.json`` (rank, pid, wall-clock time, the fault), print a ``FAULT`` line,
    then hang for good (``kind="hang"``), exit with status 3 (``"exit"``) or raise ``RuntimeError`` (``"raise"``)."""
    (out / "fault.json").write_text(json.dumps({"rank": rank, "pid": os.getpid(), "time": time.time(), **fault}))
    print(f"FAULT {fault['kind']}{detail} on rank {rank} (pid {os.getpid()})", flush=True)
    if fault["kind"] == "hang":
        while True:
            time.sleep(3600)
    if fault["kind"] == "exit":
        os._exit(3)
    raise RuntimeError(f"injected failure on rank {rank}")
