"""The drop-in promise, hook by hook: a LightningModule and a callback see the same hook calls, in the same order and
as often, under ``strategy="heterogeneous"`` as under stock DDP, in fit, validate, test and predict, with 1 and 2
devices, automatic and manual optimization.

The calls are recorded by the ``hooks`` job of ``tests/helpers/harness.py`` (every LightningModule and Callback hook
wrapped). Each configuration group runs as one job, several Trainers one after another in the same processes: 1 device
(DDP and ours in one process), 2 devices under DDP, 2 devices under ours (launched by each strategy's own ``popen``
launcher). The strategy runs both with given speeds (no profiling) and with profiled speeds; the profiled 2-device
case is held to an even split (``max_batch_sizes=[2, 2]``) so that its validation shards are DDP's whatever the
timings say.
"""

from __future__ import annotations

import concurrent.futures
import difflib
import json
from pathlib import Path

import pytest

from tests.helpers.harness import run_harness

STAGES = ("fit", "validate", "test", "predict")
OPTIMIZATION = ("automatic", "manual")
#: our strategy's variants: given speeds (no profiling), profiled speeds
VARIANTS = {
    1: {"speeds": {"speeds": [1]}, "profiled": "heterogeneous"},
    2: {"speeds": {"speeds": [1, 1]}, "profiled": {"max_batch_sizes": [2, 2]}},
}
#: one job per group: (devices, the configs it runs); a config is (key, ``hooks`` config)
GROUPS: dict[str, tuple[int, list[tuple[tuple, dict]]]] = {
    "1 device": (
        1,
        [(("ddp", 1, opt), {"strategy": "ddp", "devices": 1, "manual": opt == "manual"}) for opt in OPTIMIZATION]
        + [
            ((variant, 1, opt), {"strategy": strategy, "devices": 1, "manual": opt == "manual"})
            for variant, strategy in VARIANTS[1].items()
            for opt in OPTIMIZATION
        ],
    ),
    "2 devices, ddp": (
        2,
        [(("ddp", 2, opt), {"strategy": "ddp", "devices": 2, "manual": opt == "manual"}) for opt in OPTIMIZATION],
    ),
    "2 devices, heterogeneous": (
        2,
        [
            ((variant, 2, opt), {"strategy": strategy, "devices": 2, "manual": opt == "manual"})
            for variant, strategy in VARIANTS[2].items()
            for opt in OPTIMIZATION
        ],
    ),
}


class _Jobs:
    """Runs each group's job once, when a test first needs it; ``calls(key)`` is the per-rank recording."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.recorded: dict[tuple, list[dict]] = {}
        self.failed: dict[str, str] = {}

    def calls(self, key: tuple) -> list[dict]:
        if key not in self.recorded:
            name, (devices, configs) = next((n, g) for n, g in GROUPS.items() if key in dict(g[1]))
            assert name not in self.failed, self.failed[name]  # a failed job is not run again for every case
            out = self.root / name.replace(" ", "_").replace(",", "")
            out.mkdir()
            job = run_harness("hooks", out, [cfg for _, cfg in configs], limit=300)
            if job.returncode != 0 or job.survivors:
                self.failed[name] = (
                    f"job {name!r}: exit {job.returncode}, survivors {job.survivors}\n{job.output[-6000:]}"
                )
                raise AssertionError(self.failed[name])
            for index, (config_key, _) in enumerate(configs):
                self.recorded[config_key] = [
                    json.loads((out / str(index) / f"rank{rank}.json").read_text()) for rank in range(devices)
                ]
        return self.recorded[key]

    def prefetch(self, keys: set[tuple]) -> None:
        """Run the jobs of the groups holding ``keys`` side by side (they are independent and time nothing); a job
        that fails raises in the tests that read it."""
        firsts = [configs[0][0] for _, configs in GROUPS.values() if keys & set(dict(configs))]
        with concurrent.futures.ThreadPoolExecutor(len(GROUPS)) as pool:
            for future in [pool.submit(self.calls, key) for key in firsts]:
                future.exception()


def _needed(item: pytest.Item) -> set[tuple]:
    """The recordings a test of this module reads."""
    if item.originalname == "test_recording_sees_the_hooks":
        return {("ddp", 1, "automatic")}
    if item.originalname == "test_same_hooks_as_ddp":
        p = item.callspec.params
        return {("ddp", p["devices"], p["optimization"]), (p["variant"], p["devices"], p["optimization"])}
    return set()


@pytest.fixture(scope="module")
def jobs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> _Jobs:
    jobs = _Jobs(tmp_path_factory.mktemp("hooks"))
    mine = [item for item in request.session.items if getattr(item, "module", None) is request.module]
    jobs.prefetch(set().union(*(_needed(item) for item in mine)))
    return jobs


def _cases():
    for devices in (1, 2):
        for variant in VARIANTS[devices]:
            for opt in OPTIMIZATION:
                for stage in STAGES:
                    yield pytest.param(devices, variant, opt, stage, id=f"{devices}dev-{variant}-{opt}-{stage}")


@pytest.mark.slow
@pytest.mark.parametrize(("devices", "variant", "optimization", "stage"), list(_cases()))
def test_same_hooks_as_ddp(jobs: _Jobs, devices: int, variant: str, optimization: str, stage: str) -> None:
    ddp = jobs.calls(("ddp", devices, optimization))
    ours = jobs.calls((variant, devices, optimization))
    for rank in range(devices):
        expected, got = ddp[rank][stage], ours[rank][stage]
        assert expected, f"nothing recorded for {stage} on rank {rank}"
        assert got == expected, (
            f"rank {rank}, {stage}: hooks differ from DDP's (- DDP, + heterogeneous):\n"
            + "\n".join(difflib.unified_diff(expected, got, lineterm="", n=2))
        )


@pytest.mark.slow
def test_recording_sees_the_hooks(jobs: _Jobs) -> None:
    """The recorder works: DDP's fit calls the hooks in Lightning's documented order (a few landmarks)."""
    fit = jobs.calls(("ddp", 1, "automatic"))[0]["fit"]
    landmarks = [
        "module.setup(fit)",
        "module.configure_optimizers",
        "callback.on_fit_start",
        "callback.on_sanity_check_start",
        "module.validation_step",
        "callback.on_sanity_check_end",
        "module.train_dataloader",
        "module.on_train_start",
        "module.optimizer_step",  # runs the closure: training_step, then backward
        "module.training_step",
        "module.backward",
        "module.on_train_end",
        "module.teardown(fit)",
    ]
    positions = [fit.index(name) for name in landmarks]
    assert positions == sorted(positions), fit
    assert fit.count("module.training_step") == 8  # 16 samples, batch 2, one device


def test_validation_loader_built_once_follows_the_allocation_when_iterated() -> None:
    """The sanity check's validation loaders (split by the speeds) are kept, so ``val_dataloader()`` runs once, as
    under DDP; their batches follow the allocation current when each validation iterates them."""
    from torch.utils.data import DataLoader

    from lightning_het.data.sampler import EvalBatchSampler

    weights = [1.0, 1.0]
    loader = DataLoader(range(8), batch_sampler=EvalBatchSampler(range(8), lambda: weights, 0, batch_size=2))
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3]]
    weights = [1.0, 3.0]  # the training allocation: rank 0's share is 2 samples now, in as many batches
    assert [b.tolist() for b in loader] == [[0], [1]] and len(loader) == 2
