"""One entry point for the multi-process test jobs: ``python -m tests.helpers.harness JOB OUT_DIR JSON``.

``JOB`` names a job of :data:`JOBS`; ``JSON`` is its config (a dict, run into ``OUT_DIR``) or a list of configs run
one after another in the same processes, config ``i`` into ``OUT_DIR/<i>``, each rank printing the line
``MARKER + str(i)`` before it (see :func:`split_output`); a config of a list may name another job under ``"job"``.
The configs of a list share the job's processes and its default process group (started once, by the first), so the
job pays its start-up cost (the launch of the replicas, their imports, the rendezvous) once for several settings,
whether Lightning launches the replicas or an external launcher (``srun``, ``torchrun``) does. Each config is freshly
seeded, with a fresh model, strategy and Trainer.

The test side: :func:`command` (the command line), :func:`run_harness` (run it in its own session and wait),
:func:`load_dumps`, :func:`run_fits_job` (fits of the ``tiny`` job with their outputs), :func:`run_balance_job`.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tests.helpers import harness_fabric, harness_faults, harness_fit, harness_hooks, harness_sharded, harness_steps
from tests.helpers.jobs import JobResult, run_command

#: job name -> (what one config runs, the defaults under its config)
JOBS: dict[str, tuple[Callable[[Path, dict], None], dict[str, Any]]] = {
    **{name: (harness_fit.fit, defaults) for name, defaults in harness_fit.FIT_JOBS.items()},
    "inloop": (harness_steps.inloop, {}),
    "exact": (harness_steps.exact, {}),
    "eval_sync": (harness_steps.eval_sync, {}),
    "hooks": (harness_hooks.hooks, {}),
    "collectives": (harness_hooks.collectives, {}),
    "faulty": (harness_faults.faulty, {}),
    "emergency": (harness_faults.emergency, {}),
    "lifecycle": (harness_faults.lifecycle, {}),
    "fabric": (harness_fabric.fabric, {}),
    "sharded": (harness_sharded.sharded, {}),
}

#: printed by every rank, on a line of its own, before config ``i`` of a list, followed by ``i``
MARKER = "=== harness config "


def command(job: str, out: Path, cfg: dict | list[dict]) -> list[str]:
    """The arguments after ``python`` that run ``job`` with ``cfg`` into ``out``."""
    if job not in JOBS:
        raise ValueError(f"unknown harness job {job!r}; known: {sorted(JOBS)}")
    return ["-m", "tests.helpers.harness", job, str(out), json.dumps(cfg)]


def run_harness(
    job: str, out: Path, cfg: dict | list[dict], *, limit: float = 240, env: dict | None = None
) -> JobResult:
    """Run ``job`` in a new session (see :func:`tests.helpers.jobs.run_command`); returns once every process of the
    job has closed its output, or raises ``AssertionError`` past ``limit`` seconds."""
    return run_command(command(job, out, cfg), limit=limit, env=env)


def load_dumps(out: Path, world: int) -> list[dict]:
    """The per-rank dumps ``out/rank{r}.pt`` of a job of ``world`` replicas."""
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


def split_output(output: str, fits: int) -> list[str]:
    """The output of each config of a list: from its first marker to the next config's (the first part also holds the
    start-up).

    The ranks share one output, so a marker may land in the middle of another rank's line, and a line that a rank
    prints at the very end of config ``i`` may land after another rank's marker for ``i + 1``; what rank 0 prints
    while a fit sets up (e.g. the balance table) stays with it. The config index never goes back.
    """
    parts = [""] * fits
    current, start = 0, 0
    for found in re.finditer(re.escape(MARKER) + r"(\d+)\n?", output):
        parts[current] += output[start : found.start()]
        current, start = max(current, int(found.group(1))), found.end()
    parts[current] += output[start:]
    return parts


def run_fits_job(out: Path, cfgs: list[dict], *, limit: float = 300) -> list[tuple[list[dict], str]]:
    """Run the ``tiny`` fits ``cfgs`` in one job launched by Lightning; for each fit, its per-rank dumps and its
    output. Raises ``AssertionError`` (with the tail of the output) when the job fails or runs past ``limit`` s."""
    job = run_harness("tiny", out, cfgs, limit=limit)
    assert job.returncode == 0, job.output[-6000:]
    outputs = split_output(job.output, len(cfgs))
    results = []
    for index, cfg in enumerate(cfgs):
        world = cfg.get("devices", 2) * cfg.get("num_nodes", 1)
        results.append((load_dumps(out / str(index), world), outputs[index]))
    return results


def run_balance_job(out: Path, cfg: dict, *, limit: float = 180) -> list[dict]:
    """Run the ``balance`` job into ``out``; return the per-rank dumps."""
    job = run_harness("balance", out, cfg, limit=limit)
    assert job.returncode == 0, job.output[-6000:]
    return load_dumps(out, cfg.get("devices", 2))


def main(argv: list[str]) -> None:
    job, out, cfg = argv[0], Path(argv[1]), json.loads(argv[2])
    run, defaults = JOBS[job]
    if isinstance(cfg, dict):
        run(out, {**defaults, **cfg})
        return
    for index, one in enumerate(cfg):
        print(f"{MARKER}{index}", flush=True)
        (out / str(index)).mkdir(parents=True, exist_ok=True)
        run, defaults = JOBS[one.get("job", job)]
        run(out / str(index), {**defaults, **one})


if __name__ == "__main__":
    main(sys.argv[1:])
