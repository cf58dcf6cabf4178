"""Several tiny fits in a row inside one job: ``python -m tests.helpers.run_fits OUT_DIR JSON_LIST``.

Each element of the JSON list is a ``tests.helpers.run_tiny`` config (all with the same ``devices``, ``num_nodes``
and ``accelerator``); fit ``i`` dumps ``OUT_DIR/<i>/rank<r>.pt`` and its output follows the line
``MARKER + str(i)`` (see :func:`split_output`). The fits share the job's processes and its default process group
(started once, by the first fit), so the job pays its start-up cost (the launch of the replicas, their imports, the
rendezvous) once for several strategy settings, whether Lightning launches the replicas or an external launcher
(``srun``, ``torchrun``) does. Each fit is freshly seeded, with a fresh model, strategy and Trainer.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import torch

from tests.helpers import run_tiny
from tests.helpers.jobs import run_helper

#: printed by every rank, on a line of its own, before fit ``i``, followed by ``i``
MARKER = "=== run_fits fit "


def split_output(output: str, fits: int) -> list[str]:
    """The output of each fit: from its first marker to the next fit's (the first part also holds the start-up).

    The ranks share one output, so a marker may land in the middle of another rank's line, and a line that a rank
    prints at the very end of fit ``i`` may land after another rank's marker for fit ``i + 1``; what rank 0 prints
    while a fit sets up (e.g. the balance table) stays with it. The fit index never goes back.
    """
    parts = [""] * fits
    current, start = 0, 0
    for found in re.finditer(re.escape(MARKER) + r"(\d+)\n?", output):
        parts[current] += output[start : found.start()]
        current, start = max(current, int(found.group(1))), found.end()
    parts[current] += output[start:]
    return parts


def run_fits_job(out: Path, cfgs: list[dict], *, limit: float = 300) -> list[tuple[list[dict], str]]:
    """Run the fits ``cfgs`` in one job launched by Lightning; for each fit, its per-rank dumps and its output.

    Raises ``AssertionError`` (with the tail of the output) when the job fails or runs past ``limit`` seconds.
    """
    job = run_helper("tests.helpers.run_fits", out, cfgs, limit=limit)  # type: ignore[arg-type]  # a JSON list
    assert job.returncode == 0, job.output[-6000:]
    outputs = split_output(job.output, len(cfgs))
    results = []
    for index, cfg in enumerate(cfgs):
        world = cfg.get("devices", 2) * cfg.get("num_nodes", 1)
        results.append(([torch.load(out / str(index) / f"rank{r}.pt") for r in range(world)], outputs[index]))
    return results


def main() -> None:
    out = Path(sys.argv[1])
    for index, cfg in enumerate(json.loads(sys.argv[2])):
        print(f"{MARKER}{index}", flush=True)
        (out / str(index)).mkdir(parents=True, exist_ok=True)
        run_tiny.fit_and_dump(out / str(index), cfg)


if __name__ == "__main__":
    main()
