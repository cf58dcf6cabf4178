"""How the app reports a user error: one ``error: ...`` line on stderr (tagged with the replica) and exit status 2."""

from __future__ import annotations

import os
import sys

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

__all__ = ["USER_ERROR_EXIT", "UserError", "process_label", "report", "user_error_types"]

#: Exit status of a run stopped by a user error (bad key, value or file); Hydra's own composition errors exit with 1.
USER_ERROR_EXIT = 2


class UserError(Exception):
    """An error in the user's config or input, reported as one ``error:`` line (exit status 2)."""


def user_error_types() -> tuple[type[BaseException], ...]:
    """Exceptions that are the user's to fix (config, values, files): one ``error:`` line, no traceback."""
    types: tuple[type[BaseException], ...] = (
        UserError,
        ValueError,
        FileNotFoundError,
        OmegaConfBaseException,
        HydraException,
    )
    if "lightning.fabric" in sys.modules:  # Lightning's own config errors can only come once Lightning is imported
        from lightning.fabric.utilities.exceptions import MisconfigurationException

        types += (MisconfigurationException,)
    return types


def _error_text(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    if isinstance(err, OmegaConfBaseException):
        first = text.splitlines()[0]
        key = getattr(err, "full_key", None)
        if "Missing mandatory value" in first and key:
            return f"You did not set `{key}`, which this config requires. HINT: add `{key}=...` to the command line."
        return f"{first} (key: {key})" if key else first
    return text


def process_label() -> str | None:
    """``None`` in the job's first process (global rank 0 or not distributed), else a label such as ``rank 2``."""
    env = os.environ
    if env.get("RANK", "").isdigit():
        return None if env["RANK"] == "0" else f"rank {env['RANK']}"
    if env.get("SLURM_PROCID", "").isdigit() and env.get("SLURM_NTASKS", "1") != "1":
        return None if env["SLURM_PROCID"] == "0" else f"rank {env['SLURM_PROCID']}"
    node, local = env.get("NODE_RANK", "0"), env.get("LOCAL_RANK", "0")
    if node in ("", "0") and local in ("", "0"):
        return None
    return f"node {node} local rank {local}"


def report(err: BaseException) -> None:
    label = process_label()
    prefix = "error: " if label is None else f"error: [{label}] "
    lines = _error_text(err).splitlines() or [type(err).__name__]
    sys.stderr.write(prefix + "\n       ".join(lines) + "\n")
    sys.stderr.flush()
