"""The bad-input catalogue of ``docs/reliability.md``: every row is backed by a test.

The cases here are the ones no other test file covers; the catalogue also points at tests elsewhere (strategy
arguments, data files, Hydra configs). :func:`test_catalogue_rows_are_backed_by_tests` keeps the table honest: at
least 20 rows, each naming a test that exists. Every error must be raised before any replica starts or trains, or
end the job on its own (the fault rows), and its message's first line must name the offending input.
"""

from __future__ import annotations

import math
import re
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import pytest
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, SequentialSampler

from lightning_het import HeterogeneousStrategy
from lightning_het.cluster.rendezvous import rendezvous_wait
from tests.helpers.tiny import TinyRegressor, make_dataset

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "reliability.md"


class _CustomBatchSampler(BatchSampler):
    pass


class _MyDistributedSampler(DistributedSampler):
    pass


def _fit(loader: DataLoader) -> None:
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=HeterogeneousStrategy(process_group_backend="gloo"),
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(TinyRegressor(), loader)


def _trainer(**kwargs) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, **kwargs)


DATASET = make_dataset(40)

#: id -> (what the user did, how to reproduce it, regex the first line of the message must match)
CASES = {
    "timeout-string": (lambda: HeterogeneousStrategy(timeout="20"), r"`timeout` to be seconds .* got '20' \(str\)"),
    "timeout-zero": (lambda: HeterogeneousStrategy(timeout=0), r"`timeout` to be a positive duration, but got 0"),
    "timeout-negative-timedelta": (
        lambda: HeterogeneousStrategy(timeout=timedelta(seconds=-1)),
        r"`timeout` to be a positive duration",
    ),
    "startup-timeout-nan": (
        lambda: HeterogeneousStrategy(startup_timeout=math.nan),
        r"`startup_timeout` to be a positive duration",
    ),
    "speeds-string": (lambda: HeterogeneousStrategy(speeds="1,3"), r"`speeds` to be a sequence of numbers.*'1,3'"),
    "speeds-word": (lambda: HeterogeneousStrategy(speeds=[1, "fast"]), r"`speeds\[1\]` is 'fast'"),
    "speeds-empty": (lambda: HeterogeneousStrategy(speeds=[]), r"`speeds` to be non-empty"),
    "speeds-mapping": (
        lambda: HeterogeneousStrategy(speeds={0: 1, 1: 2}),
        r"`speeds` to be a sequence of numbers \(one per replica\), but got the mapping \{0: 1, 1: 2\}",
    ),
    "speeds-bool": (
        lambda: HeterogeneousStrategy(speeds=[True, 2]),
        r"`speeds` to hold real numbers, but `speeds\[0\]` is True",
    ),
    "outer-optimizer-with-allreduce": (
        lambda: HeterogeneousStrategy(comm="allreduce", outer_optimizer="nesterov"),
        r"You set `outer_optimizer='nesterov'`, but it only applies to `comm='node_local'`.*`comm='allreduce'`",
    ),
    "sync-dtype-with-auto": (
        lambda: HeterogeneousStrategy(sync_dtype="int8"),
        r"You set `sync_dtype='int8'`, but .*`comm='auto'`.*never to 'node_local'",
    ),
    "outer-lr-without-outer-optimizer": (
        lambda: HeterogeneousStrategy(comm="node_local", node_ids=[0, 1], outer_lr=0.5),
        r"You set `outer_lr=0.5`, but `outer_optimizer=None`",
    ),
    "node-local-on-one-node": (
        lambda: HeterogeneousStrategy(comm="node_local", node_ids=[0, 0, 0]),
        r"You set `comm='node_local'`, but `node_ids=\[0, 0, 0\]` puts every replica on one node",
    ),
    "max-batch-size-zero": (lambda: HeterogeneousStrategy(max_batch_sizes=[4, 0]), r"`max_batch_sizes\[1\]`.*got 0"),
    "global-batch-size-float": (
        lambda: HeterogeneousStrategy(global_batch_size=8.5),
        r"`global_batch_size` to be an integer >= 1, but got 8.5",
    ),
    "profile-steps-zero": (lambda: HeterogeneousStrategy(profile_steps=0), r"`profile_steps`.*got 0"),
    "comm-autotune-steps-negative": (
        lambda: HeterogeneousStrategy(comm_autotune_steps=-1),
        r"`comm_autotune_steps`.*got -1",
    ),
    "ddp-keyword-typo": (
        lambda: HeterogeneousStrategy(find_unused_parameter=True),
        r"unexpected keyword argument `find_unused_parameter`=True.*HINT: did you mean `find_unused_parameters`\?",
    ),
    "ddp-device-ids": (
        lambda: HeterogeneousStrategy(device_ids=[0]),
        r"unexpected keyword argument `device_ids`.*HINT: the strategy sets it",
    ),
    "process-group-backend-unknown": (
        lambda: HeterogeneousStrategy(process_group_backend="bogus"),
        r"`process_group_backend` to be one of \[.*'gloo'.*'nccl'.*\].*but got 'bogus'",
    ),
    "preemption-checkpoint-int": (
        lambda: HeterogeneousStrategy(preemption_checkpoint=123),
        r"`preemption_checkpoint` to be a file or directory path.*but got 123",
    ),
    "strategy-name-typo": (
        lambda: _trainer(strategy="heterogenous"),
        r"invalid strategy name: `strategy='heterogenous'`",
    ),
    "emulate-slowdown-length": (
        lambda: _trainer(devices=2, strategy=HeterogeneousStrategy(emulate_slowdown=[1, 2, 3])),
        r"`emulate_slowdown` with 3 entries.*2 replicas",
    ),
    "loader-without-batch-size": (
        lambda: _fit(DataLoader(DATASET, batch_size=None)),
        r"has no `batch_size`.*HINT: pass `HeterogeneousStrategy\(global_batch_size=...\)`",
    ),
    "custom-batch-sampler": (
        lambda: _fit(DataLoader(DATASET, batch_sampler=_CustomBatchSampler(SequentialSampler(DATASET), 4, False))),
        r"from a batch sampler \(_CustomBatchSampler\).*HINT: give the DataLoader the index sampler",
    ),
    "distributed-sampler-subclass": (
        lambda: _fit(DataLoader(DATASET, batch_size=4, sampler=_MyDistributedSampler(DATASET, num_replicas=1, rank=0))),
        r"sampler is a _MyDistributedSampler, a DistributedSampler that yields one replica's share only",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input(case):
    make, pattern = CASES[case]
    with pytest.raises(ValueError) as info:
        make()
    first_line = str(info.value).splitlines()[0]
    assert re.search(pattern, first_line), first_line


def test_bad_inputs_name_the_argument_before_any_launch():
    """The constructor's errors carry the keyword (``ArgumentError.argument``), as the other strategy arguments."""
    for kwargs, name in [
        ({"find_unused_parameter": True}, "find_unused_parameter"),
        ({"process_group_backend": "bogus"}, "process_group_backend"),
        ({"preemption_checkpoint": 123}, "preemption_checkpoint"),
    ]:
        with pytest.raises(ValueError) as info:
            HeterogeneousStrategy(**kwargs)
        assert info.value.argument == name


def test_ddp_keywords_and_backends_that_exist_are_accepted():
    strategy = HeterogeneousStrategy(
        find_unused_parameters=True, gradient_as_bucket_view=True, process_group_backend="GLOO", timeout=30
    )
    assert strategy._ddp_kwargs == {"find_unused_parameters": True, "gradient_as_bucket_view": True}
    HeterogeneousStrategy(process_group_backend="nccl")  # known by name, whether or not this build has it


def test_global_sync_every_without_node_local_warns():
    with pytest.warns(UserWarning, match=r"`global_sync_every=5` only applies to `comm='node_local'`; it is ignored"):
        HeterogeneousStrategy(global_sync_every=5)


@pytest.mark.parametrize("missing", [("MASTER_ADDR",), ("MASTER_PORT",), ("NODE_RANK",), ("MASTER_ADDR", "NODE_RANK")])
def test_multi_node_without_rendezvous_variables(monkeypatch, missing):
    """Refused when the fit launches, before any process starts (instead of waiting for a rendezvous forever); the
    Trainer itself builds (a login node, a unit test, printing a config)."""
    for name, value in (("MASTER_ADDR", "10.0.0.1"), ("MASTER_PORT", "29500"), ("NODE_RANK", "0")):
        monkeypatch.setenv(name, value)
    for name in missing:
        monkeypatch.delenv(name)
    monkeypatch.delenv("LOCAL_RANK", raising=False)  # set by an earlier in-process fit's launcher
    expected = rf"You set num_nodes=2, but the environment variable\(s\) {', '.join(missing)} are not set"
    trainer = _trainer(devices=1, num_nodes=2, strategy=HeterogeneousStrategy())
    with pytest.raises(ValueError, match=expected):
        trainer.fit(TinyRegressor(), DataLoader(make_dataset(8), batch_size=4))
    assert not trainer.strategy.launcher.procs


def test_short_timeout_does_not_fail_a_slow_start():
    """A ``timeout`` of a few seconds no longer fails the rendezvous of replicas that take longer to start."""
    strategy = HeterogeneousStrategy(timeout=2, startup_timeout=120)
    assert strategy._timeout == timedelta(seconds=2)
    assert rendezvous_wait(strategy._timeout, strategy.config.reliability.startup_timeout) == timedelta(seconds=120)


# ---------------------------------------------------------------------------------------------------- the catalogue
def _catalogue_rows() -> list[list[str]]:
    text = DOC.read_text()
    section = text.split("## Bad-input catalogue", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|") and not line.startswith("|---")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[1:]]  # without the header


def _test_exists(reference: str) -> bool:
    """``tests/file.py::Class::test_name[param]`` names a test that exists (and, for ours, a CASES id)."""
    path, _, rest = reference.partition("::")
    parts = rest.split("::")
    name, _, param = parts[-1].partition("[")
    source = (REPO / path).read_text() if (REPO / path).is_file() else ""
    if not re.search(rf"def {re.escape(name)}\(", source):
        return False
    if len(parts) == 2 and not re.search(rf"class {re.escape(parts[0])}\b", source):
        return False
    return not (path == "tests/test_bad_inputs.py" and name == "test_bad_input" and param.rstrip("]") not in CASES)


def test_catalogue_rows_are_backed_by_tests():
    rows = _catalogue_rows()
    assert len(rows) >= 20, len(rows)
    for row in rows:
        assert len(row) == 4, row  # input | where it is caught | first line of the message | test
        references = re.findall(r"`(tests/[^`]+)`", row[3])
        assert references, row
        for reference in references:
            assert _test_exists(reference), f"catalogue row {row[0]!r}: no test {reference}"
    # every case of this file is in the catalogue
    listed = " ".join(row[3] for row in rows)
    for case in CASES:
        assert f"test_bad_input[{case}]" in listed, case
