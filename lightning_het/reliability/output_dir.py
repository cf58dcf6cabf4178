"""Checking a run's output directory before any replica starts (no torch or Lightning import: the app uses it early)."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import uuid
from pathlib import Path


class OutputDirError(ValueError):
    """The run's output directory cannot hold the run's files (missing and not creatable, unwritable, disk full)."""


def check_output_dir(path: str | os.PathLike[str], *, min_free_bytes: int = 16 * 2**20) -> Path:
    """Create ``path`` if needed and make sure a run can write there (``min_free_bytes`` free); return it absolute."""
    directory = Path(path).absolute()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise OutputDirError(f"The output directory '{directory}' exists but is not a directory.") from None
    except OSError as err:
        raise OutputDirError(
            f"The output directory '{directory}' does not exist and cannot be created"
            f" ({err.strerror or type(err).__name__}). HINT: choose a directory whose parent exists and is writable."
        ) from None
    probe = directory / f".lightning_het_probe_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    try:
        probe.write_bytes(b"\0" * 4096)  # a block: a full disk or quota fails here
    except OSError as err:
        hint = "free some space or choose another directory" if err.errno == errno.ENOSPC else "check its permissions"
        raise OutputDirError(
            f"The output directory '{directory}' is not writable ({err.strerror or type(err).__name__}). HINT: {hint}."
        ) from None
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()
    free = shutil.disk_usage(directory).free
    if free < min_free_bytes:
        raise OutputDirError(
            f"The output directory '{directory}' is on a disk with only {free / 2**20:.1f} MiB free (a run needs at"
            f" least {min_free_bytes / 2**20:.0f} MiB for its logs, checkpoints and metrics). HINT: free some space or"
            " choose another directory."
        )
    return directory
