"""Hydra callbacks of the app (``hydra.callbacks`` in ``conf/hydra/default.yaml``)."""

from __future__ import annotations

import os
import sys
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

__all__ = ["OutputDirCheck"]


class OutputDirCheck(Callback):
    """Checks the run (or sweep) directory before Hydra creates it and writes its ``.hydra`` files there."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._check(config, "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._check(config, "hydra.sweep.dir")

    @staticmethod
    def _check(config: DictConfig, key: str) -> None:
        from lightning_het.app.messages import USER_ERROR_EXIT, report
        from lightning_het.reliability.output_dir import OutputDirError, check_output_dir

        try:
            directory = OmegaConf.select(config, key, throw_on_resolution_failure=False)
        except Exception:  # an unresolvable value is for Hydra to report
            return
        if directory in (None, ""):
            return
        try:
            check_output_dir(str(directory))
        except OutputDirError as err:
            if os.environ.get("HYDRA_FULL_ERROR") == "1":
                raise
            report(OutputDirError(f"`{key}`: {err}"))
            sys.exit(USER_ERROR_EXIT)
