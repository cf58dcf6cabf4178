"""Tests of lightning_het.comm: exactness of the hierarchical hook, node-local SGD, averaging, byte accounting, errors.

Multi-process tests run raw ``DistributedDataParallel`` over gloo on localhost (processes forked, so the slow
``lightning`` import is paid once). Each worker also trains a reference in-process and saves what it saw; the tests
compare in the parent.
"""

from __future__ import annotations

import copy
import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from lightning_het import AllReduce, Auto, HeterogeneousStrategy, Hierarchical, NodeLocal
from lightning_het.cluster.topology import NodeGroups, build_node_groups, node_members
from lightning_het.comm import ALGORITHMS
from lightning_het.comm import hierarchical as hierarchical_module
from lightning_het.comm import node_local as node_local_module
from lightning_het.comm.allreduce import (
    CommAlgorithm,
    flat_allreduce_traffic,
    hierarchical_traffic,
    node_local_traffic,
)
from lightning_het.comm.hierarchical import HierarchicalState
from lightning_het.comm.node_local import INT8_BLOCK, average_parameters, merge_weights
from lightning_het.config import typed_keywords
from tests.helpers.gloo import run_gloo

STEPS = 4
TOL = 1e-5


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)
    )


def _batch(step: int, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(total, 6, generator=g), torch.randint(0, 3, (total,), generator=g)


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def _optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.2, momentum=0.9)


def _slices(batch_sizes: list[int]) -> list[slice]:
    offsets = [sum(batch_sizes[:r]) for r in range(len(batch_sizes))]
    return [slice(o, o + b) for o, b in zip(offsets, batch_sizes)]


def _train_ddp(
    rank: int, algorithm: CommAlgorithm, node_ids: list[int], batch_sizes: list[int], **kwargs: Any
) -> tuple[list[torch.Tensor], CommAlgorithm, DistributedDataParallel]:
    """Train with the algorithm installed on DDP and the optimizer; this rank's flat parameters after every step."""
    # one bucket per parameter: several buckets in flight exercise the ordering of the pipelined stages
    ddp = DistributedDataParallel(_model(), bucket_cap_mb=1e-4)
    tuner_times = kwargs.pop("tuner_times", None)
    if tuner_times is not None:  # a fake clock: each step lasts what this rank "measures" for its reduction
        now = [0.0]

        def clock() -> float:
            now[0] += tuner_times[0] if algorithm.reduction == "flat" else tuner_times[1]
            return now[0]

        algorithm._clock = clock
    opt = _optimizer(ddp.parameters())
    algorithm.install(ddp, [opt], node_ids, rank, batch_sizes, **kwargs)
    return _run_steps(ddp, opt, rank, batch_sizes, range(1, STEPS + 1)), algorithm, ddp


def _run_steps(
    ddp: DistributedDataParallel,
    opt: torch.optim.Optimizer,
    rank: int,
    batch_sizes: list[int],
    steps: range,
    done: list[int] | None = None,
) -> list[torch.Tensor]:
    """Train ``steps`` (global step numbers; ``done``: the steps done, kept for a ``position``); this rank's flat
    parameters after each."""
    world, total = len(batch_sizes), sum(batch_sizes)
    mine = _slices(batch_sizes)[rank]
    history = []
    for step in steps:
        if done is not None:
            done[0] = step - 1
        x, y = _batch(step, total)
        loss = torch.nn.functional.cross_entropy(ddp(x[mine]), y[mine]) * (world * batch_sizes[rank] / total)
        opt.zero_grad()
        loss.backward()
        opt.step()  # the algorithm's step hook runs
        history.append(_flat(ddp.module))
    return history


def _train_exact(batch_sizes: list[int]) -> list[torch.Tensor]:
    """One process on the whole global batch."""
    model = _model()
    opt = _optimizer(model.parameters())
    history = []
    for step in range(1, STEPS + 1):
        x, y = _batch(step, sum(batch_sizes))
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        history.append(_flat(model))
    return history


def _train_node_local_reference(node_ids: list[int], batch_sizes: list[int], k: int, warmup: int) -> list[Any]:
    """Node-local SGD simulated in one process: one model + optimiser per node, share-weighted averaging."""
    members = node_members(node_ids)
    slices = _slices(batch_sizes)
    node_samples = [torch.cat([torch.arange(slices[r].start, slices[r].stop) for r in m]) for m in members]
    node_weight = [sum(batch_sizes[r] for r in m) / sum(batch_sizes) for m in members]
    models = [_model() for _ in members]
    opts = [_optimizer(m.parameters()) for m in models]
    history = []
    for step in range(1, STEPS + 1):
        x, y = _batch(step, sum(batch_sizes))
        for n, (model, opt) in enumerate(zip(models, opts)):
            idx = slice(None) if step <= warmup else node_samples[n]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
        if step > warmup and (step - warmup) % k == 0:
            with torch.no_grad():
                for params in zip(*(m.parameters() for m in models)):
                    avg = sum(w * p for w, p in zip(node_weight, params))
                    for p in params:
                        p.copy_(avg)
        history.append([_flat(m) for m in models])
    return history


# --------------------------------------------------------------------------- workers (module level: picklable)
EXACT_CASES_3 = [([0, 0, 1], [2, 3, 5])]
EXACT_CASES_4 = [([0, 1, 0, 1], [1, 2, 3, 4]), ([0, 0, 0, 1], [4, 1, 2, 3]), ([1, 1, 0, 0], [3, 3, 1, 1])]
NODE_LOCAL_CASES = [([0, 0, 1, 1], [1, 2, 3, 4], 2, 0), ([0, 1, 0, 1], [4, 1, 2, 3], 3, 1)]


def _exact_worker(rank: int, world_size: int) -> dict[str, Any]:
    cases = EXACT_CASES_3 if world_size == 3 else EXACT_CASES_4
    result: dict[str, Any] = {}
    for node_ids, batch_sizes in cases:
        for mode, algorithm in (("hierarchical", Hierarchical(autotune_steps=0)), ("allreduce", AllReduce())):
            # 64-byte chunks: every bucket is split, so chunks of several buckets are in flight at once
            history, ctl, ddp = _train_ddp(rank, algorithm, node_ids, batch_sizes, chunk_bytes=64)
            result[(mode, str(node_ids))] = {
                "final": history[-1],
                "reference": _train_exact(batch_sizes)[-1],
                "stats": ctl.stats,
                "grad_bytes": sum(p.numel() * p.element_size() for p in ddp.parameters()),
                "comm_hook": ddp._get_ddp_logging_data().get("comm_hook"),
            }
    if world_size == 4:
        node_ids, batch_sizes = EXACT_CASES_4[0]
        for scenario, (flat_s, hier_s) in AUTOTUNE_TIMES.items():
            # each rank "measures" its own step times; the decision must follow the slowest rank of each reduction
            history, ctl, ddp = _train_ddp(
                rank, Hierarchical(autotune_steps=1), node_ids, batch_sizes, tuner_times=(flat_s[rank], hier_s[rank])
            )
            result[("autotune", scenario)] = {
                "final": history[-1],
                "reference": _train_exact(batch_sizes)[-1],
                "reduction": ctl.reduction,
                "stats": ctl.stats,
                "grad_bytes": sum(p.numel() * p.element_size() for p in ddp.parameters()),
            }
    return result


#: per-rank fake step times (flat, hierarchical) for the measured-choice tests; max over ranks decides
AUTOTUNE_TIMES = {
    "flat_faster": ([1.0, 1.0, 1.2, 1.0], [2.0, 2.0, 2.0, 2.0]),
    # rank 0 alone sees flat as faster; the slowest rank of each reduction (3.0 vs 2.5) says hierarchical
    "slowest_rank_decides": ([1.0, 3.0, 3.0, 3.0], [2.0, 2.5, 2.5, 2.5]),
}


def _node_local_worker(rank: int, world_size: int) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for node_ids, batch_sizes, k, warmup in NODE_LOCAL_CASES:
        algorithm = NodeLocal(sync_every=k, warmup_steps=warmup)
        history, ctl, ddp = _train_ddp(rank, algorithm, node_ids, batch_sizes)
        result[str(node_ids)] = {
            "history": history,
            "reference": _train_node_local_reference(node_ids, batch_sizes, k, warmup),
            "exact": _train_exact(batch_sizes),
            "stats": ctl.stats,
            "grad_bytes": sum(p.numel() * p.element_size() for p in ddp.parameters()),
        }
    result.update(_outer_cases(rank))
    # K=None: no periodic sync; sync() (epoch end, checkpoint) forces one consensus model
    history, ctl, ddp = _train_ddp(rank, NodeLocal(), [0, 0, 1, 1], [1, 1, 1, 1])
    before = _flat(ddp.module)
    ran = ctl.sync()
    result["synchronize"] = {
        "before": before,
        "after": _flat(ddp.module),
        "ran": ran,
        "ran_again": ctl.sync(),
        "syncs": ctl.stats["global_syncs"],
    }
    # averaging weights: replicas of a node need not agree; result is the exact share-weighted sum
    groups_state = HierarchicalState(build_node_groups([0, 0, 1, 1], rank), 4 * 1024 * 1024)
    batch_sizes = [1, 2, 3, 4]
    full = torch.full((5,), float(rank + 1))
    half = torch.full((3,), float(rank + 1), dtype=torch.float16)
    count = torch.full((2,), rank)
    payload = average_parameters(
        [full, half, count, full], merge_weights(batch_sizes, [0, 0, 1, 1])[rank], groups_state
    )
    result["average"] = {"full": full, "half": half, "count": count, "payload": payload}
    return result


#: unequal nodes for the outer step: node 0 trains on 2 samples per step, node 1 on 8; K = 2
OUTER_CASE = ([0, 0, 1, 1], [1, 1, 3, 5], 2)


def _train_outer_reference(node_ids: list[int], batch_sizes: list[int], k: int, by: str) -> list[Any]:
    """Node-local SGD with DiLoCo's outer Nesterov step, one model per node, in one process."""
    members = node_members(node_ids)
    slices = _slices(batch_sizes)
    node_samples = [torch.cat([torch.arange(slices[r].start, slices[r].stop) for r in m]) for m in members]
    weights = [sum(batch_sizes[r] for r in m) / sum(batch_sizes) for m in members]
    if by == "nodes":
        weights = [1 / len(members)] * len(members)
    models = [_model() for _ in members]
    opts = [_optimizer(m.parameters()) for m in models]
    anchor = [p.detach().clone() for p in _model().parameters()]
    outer = torch.optim.SGD(anchor, lr=0.7, momentum=0.9, nesterov=True)
    history = []
    for step in range(1, STEPS + 1):
        x, y = _batch(step, sum(batch_sizes))
        for n, (model, opt) in enumerate(zip(models, opts)):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[node_samples[n]]), y[node_samples[n]]).backward()
            opt.step()
        if step % k == 0:
            with torch.no_grad():
                for i, a in enumerate(anchor):
                    a.grad = sum(w * (a - list(m.parameters())[i]) for w, m in zip(weights, models))
                outer.step()
                for m in models:
                    for p, a in zip(m.parameters(), anchor):
                        p.copy_(a)
        history.append([_flat(m) for m in models])
    return history


def _outer_cases(rank: int) -> dict[Any, Any]:
    """The outer step with both merge weights against the reference, an int8 sync, and a resume mid-round."""
    node_ids, batch_sizes, k = OUTER_CASE
    result: dict[Any, Any] = {}
    for by, dtype in (("samples", "float32"), ("nodes", "float32"), ("samples", "int8")):
        algorithm = NodeLocal(sync_every=k, outer="nesterov", merge=by, sync_dtype=dtype)  # type: ignore[arg-type]
        history, ctl, ddp = _train_ddp(rank, algorithm, node_ids, batch_sizes)
        result[("outer", by, dtype)] = {
            "history": history,
            "reference": _train_outer_reference(node_ids, batch_sizes, k, by),
            "stats": ctl.stats,
            "numel": sum(p.numel() for p in ddp.parameters()),
        }
    # a resume in the middle of a round (K = 4, saved after step 6, int8): the save forces a consensus (an outer step);
    # as a Trainer checkpoint, rank 0's file holds its optimizer state and every node's (gathered), which all ranks read
    runs, saved = [], {}
    for resume in (None, "saved"):
        model = _model()
        if resume is not None:
            model.load_state_dict(saved["model"])
        ddp = DistributedDataParallel(model, bucket_cap_mb=1e-4)
        ctl = NodeLocal(sync_every=4, outer="nesterov", sync_dtype="int8")
        opt = _optimizer(ddp.parameters())
        done = [0]  # the optimizer steps done: the schedule's position (a resumed fit reads it from its trainer)
        ctl.install(ddp, [opt], node_ids, rank, batch_sizes, position=lambda done=done: (done[0], False))
        if resume is None:
            _run_steps(ddp, opt, rank, batch_sizes, range(1, 7), done)
            ctl.sync()
            file = [{"model": model.state_dict(), "comm": ctl.state_dict()}]
            file[0]["comm"]["nodes"] = ctl.gather_node_states([opt.state_dict()])  # a collective; rank 0's record
            torch.distributed.broadcast_object_list(file, src=0)  # every rank loads rank 0's file
            saved = copy.deepcopy(file[0])  # rank 0's holds its live optimizer state
        else:
            ctl.load_state_dict(saved["comm"])
            opt.load_state_dict(ctl.node_optimizer_states(saved["comm"])[0])  # type: ignore[index]
        runs.append(_run_steps(ddp, opt, rank, batch_sizes, range(7, 13), done))
    result["resume"] = {"continued": runs[0], "resumed": runs[1], "momentum": saved["comm"]}
    return result


@pytest.fixture(scope="module")
def exact3(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_gloo(_exact_worker, 3, tmp_path_factory.mktemp("exact3"))


@pytest.fixture(scope="module")
def exact4(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_gloo(_exact_worker, 4, tmp_path_factory.mktemp("exact4"))


@pytest.fixture(scope="module")
def node_local(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_gloo(_node_local_worker, 4, tmp_path_factory.mktemp("node_local"))


# --------------------------------------------------------------------------- exact modes
@pytest.mark.parametrize("mode", ["hierarchical", "allreduce"])
@pytest.mark.parametrize("case", [*EXACT_CASES_3, *EXACT_CASES_4], ids=str)
def test_exact_modes_match_one_process_on_global_batch(
    request: pytest.FixtureRequest, mode: str, case: tuple[list[int], list[int]]
) -> None:
    node_ids, _ = case
    results = request.getfixturevalue("exact3" if len(node_ids) == 3 else "exact4")
    finals = [r[(mode, str(node_ids))]["final"] for r in results]
    reference = results[0][(mode, str(node_ids))]["reference"]
    assert (finals[0] - reference).abs().max().item() < TOL
    for other in finals[1:]:
        assert torch.equal(other, finals[0]), "replicas differ"


def test_hierarchical_hook_is_registered_on_cpu(exact4: list[dict[str, Any]]) -> None:
    entry = exact4[0][("hierarchical", "[0, 1, 0, 1]")]
    assert "hierarchical_hook" in entry["comm_hook"]
    assert exact4[0][("allreduce", "[0, 1, 0, 1]")]["comm_hook"] in (None, "", "builtin_allreduce")


@pytest.mark.parametrize("case", EXACT_CASES_4, ids=str)
def test_exact_mode_stats_follow_the_byte_model(
    exact4: list[dict[str, Any]], case: tuple[list[int], list[int]]
) -> None:
    node_ids, _ = case
    for mode, model in (("hierarchical", hierarchical_traffic), ("allreduce", flat_allreduce_traffic)):
        for rank, result in enumerate(exact4):
            entry = result[(mode, str(node_ids))]
            traffic = model(entry["grad_bytes"], node_ids)
            stats = entry["stats"]
            assert stats["steps"] == STEPS
            assert stats["bytes_inter_per_step"] == pytest.approx(traffic[1][rank])
            assert stats["bytes_intra_per_step"] == pytest.approx(traffic[0][rank])
            assert stats["job_bytes_inter_per_step"] == pytest.approx(traffic[1].sum())


@pytest.mark.parametrize(("scenario", "expected"), [("flat_faster", "flat"), ("slowest_rank_decides", "hierarchical")])
def test_measured_choice_is_exact_and_agreed(exact4: list[dict[str, Any]], scenario: str, expected: str) -> None:
    """autotune_steps=1 over 4 steps: hierarchical, flat (timed), hierarchical (timed, decision), the choice."""
    node_ids, _ = EXACT_CASES_4[0]
    entries = [r[("autotune", scenario)] for r in exact4]
    assert [e["reduction"] for e in entries] == [expected] * 4
    assert (entries[0]["final"] - entries[0]["reference"]).abs().max().item() < TOL
    for e in entries[1:]:
        assert torch.equal(e["final"], entries[0]["final"]), "replicas differ"
    # bytes: 3 hierarchical steps + 1 flat one, or 2 + 2 when the flat reduction was kept
    nbytes = entries[0]["grad_bytes"]
    flat_steps = 2 if expected == "flat" else 1
    inter = (
        flat_allreduce_traffic(nbytes, node_ids)[1].sum() * flat_steps
        + hierarchical_traffic(nbytes, node_ids)[1].sum() * (STEPS - flat_steps)
    ) / STEPS
    assert entries[0]["stats"]["job_bytes_inter_per_step"] == pytest.approx(inter)


def _decided(flat_s: float, hier_s: float) -> str | None:
    """The reduction a one-step measurement keeps after a flat step of ``flat_s`` s and a hierarchical one."""
    times = iter([0.0, flat_s, flat_s + hier_s])
    algorithm = Hierarchical(autotune_steps=1)
    algorithm._clock = lambda: next(times)
    _, opt = _installed(algorithm, [0, 0, 1, 1], 0, [1, 1, 1, 1])
    for _ in range(3):
        opt.step()
    return algorithm.reduction


def test_measured_choice_margin_and_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hierarchical_module.dist, "get_backend", lambda *args: "gloo")
    monkeypatch.setattr(hierarchical_module.dist, "all_reduce", lambda tensor, op=None: None)  # every rank agrees
    assert _decided(0.40, 0.50) == "flat"
    assert _decided(0.495, 0.50) == "hierarchical"  # within the margin: fewer inter-node bytes wins
    assert _decided(float("nan"), 0.5) == "hierarchical"
    times = iter([0.0, 1.0, 3.0, 4.0, 6.0])  # untimed first step, then flat 1 s, hier 2 s, flat 1 s, hier 2 s
    algorithm = Hierarchical(autotune_steps=2)
    algorithm._clock = lambda: next(times)
    ddp, opt = _installed(algorithm, [0, 0, 1, 1], 0, [1, 1, 1, 1])
    assert ddp.hook is hierarchical_module.hierarchical_hook and "(still measuring)" in algorithm.summary()
    used = []
    for _ in range(5):
        used.append(algorithm.reduction)
        opt.step()
    assert used == ["hierarchical", "flat", "hierarchical", "flat", "hierarchical"]
    assert algorithm.reduction == "flat" and "(flat reduction, measured)" in algorithm.summary()
    opt.step()  # decided: no more timing
    assert algorithm.reduction == "flat"


def test_rejects_bad_autotune_steps() -> None:
    with pytest.raises(ValueError, match="autotune_steps"):
        Hierarchical(autotune_steps=-1)


# --------------------------------------------------------------------------- node_local
@pytest.mark.parametrize("case", NODE_LOCAL_CASES, ids=str)
def test_node_local_follows_node_local_sgd(node_local: list[dict[str, Any]], case: tuple[Any, ...]) -> None:
    node_ids, _, k, warmup = case
    members = node_members(node_ids)
    for step in range(STEPS):
        params = [r[str(node_ids)]["history"][step] for r in node_local]
        reference = node_local[0][str(node_ids)]["reference"][step]
        for n, ranks in enumerate(members):
            for r in ranks:  # replicas of a node are identical after every step
                assert torch.equal(params[r], params[ranks[0]]), f"step {step + 1}: node {n} replicas differ"
            assert (params[ranks[0]] - reference[n]).abs().max().item() < TOL
        synced = step + 1 <= warmup or (step + 1 - warmup) % k == 0
        identical = all(torch.equal(p, params[0]) for p in params)
        assert identical == synced, f"step {step + 1}: synced={synced} but identical={identical}"
    final, exact = node_local[0][str(node_ids)]["history"][-1], node_local[0][str(node_ids)]["exact"][-1]
    assert (final - exact).abs().max().item() > 1e-3, "node_local silently trained exactly"


@pytest.mark.parametrize("case", NODE_LOCAL_CASES, ids=str)
def test_node_local_stats(node_local: list[dict[str, Any]], case: tuple[Any, ...]) -> None:
    node_ids, _, k, warmup = case
    nbytes = node_local[0][str(node_ids)]["grad_bytes"]
    local_steps = STEPS - warmup
    syncs = local_steps // k
    expected = (
        hierarchical_traffic(nbytes, node_ids)[1].sum() * (warmup + syncs)
        + node_local_traffic(nbytes, node_ids)[1].sum() * local_steps
    ) / STEPS
    for result in node_local:
        stats = result[str(node_ids)]["stats"]
        assert stats["global_syncs"] == syncs
        assert stats["job_bytes_inter_per_step"] == pytest.approx(expected)


def test_synchronize_forces_consensus_once(node_local: list[dict[str, Any]]) -> None:
    befores = [r["synchronize"]["before"] for r in node_local]
    afters = [r["synchronize"]["after"] for r in node_local]
    assert not torch.equal(befores[0], befores[2])
    assert all(torch.equal(a, afters[0]) for a in afters)
    expected = 0.5 * befores[0] + 0.5 * befores[2]  # equal shares, two nodes
    assert (afters[0] - expected).abs().max().item() < 1e-6
    for r in node_local:
        assert r["synchronize"]["ran"] is True
        assert r["synchronize"]["ran_again"] is False
        assert r["synchronize"]["syncs"] == 1


def test_average_parameters_is_share_weighted(node_local: list[dict[str, Any]]) -> None:
    expected = sum((r + 1) * b for r, b in enumerate([1, 2, 3, 4])) / 10  # = 3.0
    for rank, r in enumerate(node_local):
        avg = r["average"]
        assert torch.allclose(avg["full"], torch.full((5,), expected))
        assert avg["half"].dtype == torch.float16 and torch.allclose(avg["half"].float(), torch.full((3,), expected))
        assert torch.equal(avg["count"], torch.full((2,), rank)), "integer tensors must be left alone"
        assert avg["payload"] == 5 * 4 + 3 * 4  # fp32 + fp16 upcast to fp32, duplicate counted once


def test_outer_step_follows_the_reference(node_local: list[dict[str, Any]]) -> None:
    """DiLoCo's outer Nesterov step on the share-weighted pseudo-gradient, replicas agreeing after each sync; the
    equal-weight merge is a different trajectory (node 1 trains on 4x the samples of node 0), equal to its own."""
    node_ids, _, k = OUTER_CASE
    members = node_members(node_ids)
    for by in ("samples", "nodes"):
        for step in range(STEPS):
            params = [r[("outer", by, "float32")]["history"][step] for r in node_local]
            reference = node_local[0][("outer", by, "float32")]["reference"][step]
            for n, ranks in enumerate(members):
                assert (params[ranks[0]] - reference[n]).abs().max().item() < TOL, (by, step)
            if (step + 1) % k == 0:
                assert all(torch.equal(p, params[0]) for p in params)
    samples = node_local[0][("outer", "samples", "float32")]["history"][-1]
    nodes = node_local[0][("outer", "nodes", "float32")]["history"][-1]
    assert (samples - nodes).abs().max().item() > 1e-3


def test_int8_sync_is_close_and_sends_a_quarter(node_local: list[dict[str, Any]]) -> None:
    node_ids, _, k = OUTER_CASE
    full = node_local[0][("outer", "samples", "float32")]
    int8 = node_local[0][("outer", "samples", "int8")]
    assert all(torch.equal(r[("outer", "samples", "int8")]["history"][-1], int8["history"][-1]) for r in node_local)
    assert (int8["history"][-1] - full["history"][-1]).abs().max().item() < 0.02
    n = int8["numel"]
    syncs = STEPS // k
    wire = n + 4 * math.ceil(n / INT8_BLOCK)  # int8 values and a float32 scale per block, all-gathered by 2 leaders
    inter = hierarchical_traffic(4 * n, node_ids, per_rank=(len(set(node_ids)) - 1) * wire)[1].sum()
    assert int8["stats"]["job_bytes_inter_total"] == pytest.approx(syncs * inter)
    inter = hierarchical_traffic(4 * n, node_ids)[1].sum()
    assert full["stats"]["job_bytes_inter_total"] == pytest.approx(syncs * inter)
    assert full["stats"]["job_bytes_inter_total"] / int8["stats"]["job_bytes_inter_total"] > 3.9


def test_resume_in_the_middle_of_a_round_continues_exactly(node_local: list[dict[str, Any]]) -> None:
    """Two nodes of two replicas, SGD momentum inside them, int8 syncs: every rank resumes its node's own inner
    optimizer state and each leader its own residual, so the resumed run continues the saving run."""
    for r in node_local:
        assert r["resume"]["momentum"]["merge"]["optimizer"]["state"], "the outer momentum is saved"
        nodes = r["resume"]["momentum"]["nodes"]
        assert nodes["layout"] == [2, 2] and all(residual.abs().max() > 0 for residual in nodes["residuals"])
        for continued, resumed in zip(r["resume"]["continued"], r["resume"]["resumed"]):
            assert (continued - resumed).abs().max().item() <= 1e-6


# --------------------------------------------------------------------------- pure pieces
def _fake_groups(node_ids: list[int], rank: int) -> NodeGroups:
    members = tuple(tuple(m) for m in node_members(node_ids))
    return NodeGroups(tuple(node_ids), rank, members, None, None, None)  # type: ignore[arg-type]


class _FakeDDP:
    """What :meth:`CommAlgorithm.install` uses of a ``DistributedDataParallel``: its parameters, the hook it gets."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params, self.state, self.hook = params, None, None

    def parameters(self) -> list[torch.Tensor]:
        return self.params

    def register_comm_hook(self, state: Any, hook: Any) -> None:
        self.state, self.hook = state, hook


class _Bucket:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def buffer(self) -> torch.Tensor:
        return self.tensor


def _installed(algorithm: CommAlgorithm, node_ids: list[int], rank: int, sizes: list[int] | None, **kwargs: Any):
    """``algorithm`` installed on a fake DDP model of one parameter and an SGD optimizer, with fake node groups."""
    ddp = _FakeDDP([torch.zeros(5, requires_grad=True)])
    opt = torch.optim.SGD(ddp.params, lr=0.1)
    algorithm.install(ddp, [opt], node_ids, rank, sizes, groups=_fake_groups(node_ids, rank), **kwargs)
    return ddp, opt


def test_node_local_scale_warmup_and_removal(monkeypatch: pytest.MonkeyPatch) -> None:
    done, algorithm = [0], NodeLocal(warmup_steps=2)
    ddp, _ = _installed(algorithm, [0, 0, 1], 2, [2, 3, 5], position=lambda: (done[0], False))
    assert ddp.hook is node_local_module.node_local_hook and ddp.state.exact()
    done[0] = 2  # past the warm-up: this node's (one replica's) gradient, times B / (W * B_n)
    assert not ddp.state.exact()
    assert torch.allclose(ddp.hook(ddp.state, _Bucket(torch.ones(3))).wait(), torch.full((3,), 10 / (3 * 5)))
    monkeypatch.setattr(hierarchical_module, "allreduce_hook", lambda group, bucket: "DDP's all-reduce")
    algorithm.remove()  # DDP cannot unregister a comm hook: once removed, ours runs DDP's all-reduce
    assert ddp.hook(ddp.state, _Bucket(torch.ones(3))) == "DDP's all-reduce"


def _stepping(opt: torch.optim.Optimizer, algorithm: CommAlgorithm, done: list[int]) -> bool:
    """One optimizer step (the algorithm's hook runs); whether it ended with a global sync."""
    before = algorithm.stats["global_syncs"]
    opt.step()
    done[0] += 1
    return algorithm.stats["global_syncs"] > before


def test_schedule_takes_phase_from_the_position(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[float] = []

    def fake_average(params: Any, weight: float, state: Any) -> int:
        calls.append(weight)
        return 100

    monkeypatch.setattr(node_local_module, "average_parameters", fake_average)
    done, last = [0], [False]
    algorithm = NodeLocal(sync_every=3, warmup_steps=2)
    _, opt = _installed(algorithm, [0, 0, 1], 1, [2, 3, 5], position=lambda: (done[0], last[0]))
    synced = [_stepping(opt, algorithm, done) for _ in range(1, 10)]
    assert synced == [False, False, False, False, True, False, False, True, False]
    assert calls == [0.3, 0.3]
    last[0] = True  # the epoch's last step
    assert _stepping(opt, algorithm, done)
    # resumed run: the phase comes from the position (the trainer's global step), not from a counter of its own
    resumed, done = NodeLocal(sync_every=3, warmup_steps=2), [10]
    _, opt = _installed(resumed, [0, 0, 1], 1, [2, 3, 5], position=lambda: (done[0], False))
    assert [_stepping(opt, resumed, done) for _ in (11, 12, 13, 14, 15, 16)] == [True, False, False, True, False, False]
    done[0] += 1  # a gradient scaler skipped step 17's optimizer step (no hook ran), a sync step: step 18 catches up
    assert _stepping(opt, resumed, done) and resumed.stats["steps"] == 8 and resumed.stats["global_syncs"] == 3
    stats = algorithm.stats
    assert stats["steps"] == 10 and stats["global_syncs"] == 3


def test_allreduce_needs_no_groups_counts_bytes_and_removes_its_hook() -> None:
    ddp = _FakeDDP([torch.zeros(25, requires_grad=True), torch.zeros(3)])  # 100 bytes need gradients
    opt = torch.optim.SGD(ddp.params[:1], lr=0.1)
    algorithm = AllReduce()
    algorithm.install(ddp, [opt], [0, 0, 1, 1], 1, [1, 1, 1, 1])  # no process group: none is built
    assert ddp.hook is None  # DDP's own all-reduce
    for _ in range(2):
        opt.step()
    assert not algorithm.sync()
    stats = algorithm.stats
    assert stats["bytes_inter_per_step"] == 150.0  # rank 1 -> rank 2 crosses nodes: 2 * 3/4 * 100
    assert stats["job_bytes_inter_per_step"] == 300.0
    assert stats["bytes_inter_total"] == 300.0
    algorithm.remove()
    opt.step()  # the step hook is gone; the counters stay readable
    assert algorithm.stats["steps"] == 2


def test_without_allocation_replicas_count_as_equal() -> None:
    algorithm = NodeLocal(sync_every=2)
    ddp, _ = _installed(algorithm, [0, 0, 1], 0, None)
    assert ddp.state.node_scale == pytest.approx(0.5)  # mean over the node's 2 replicas
    algorithm.set_batch_sizes([1, 1, 2])
    assert ddp.state.node_scale == pytest.approx(4 / (3 * 2))
    with pytest.raises(ValueError, match="`batch_sizes`"):
        algorithm.set_batch_sizes([1, 1])


def test_summary_line() -> None:
    ddp = _FakeDDP([torch.zeros(250, requires_grad=True)])
    opt = torch.optim.SGD(ddp.params, lr=0.1)
    algorithm = AllReduce()
    algorithm.install(ddp, [opt], [0, 1], 0, None)
    opt.step()
    assert algorithm.summary() == (
        "comm=allreduce: 1 steps, 0 global syncs; per step this rank sent 0.000 MB inside its node and 0.001 MB to"
        " other nodes (whole job: 0.002 MB between nodes)"
    )


class TestByteModel:
    def test_flat_allreduce_crosses_where_the_ring_crosses(self) -> None:
        contiguous = flat_allreduce_traffic(100, [0, 0, 1, 1])
        assert contiguous[1].tolist() == [0.0, 150.0, 0.0, 150.0]  # row 1: to other nodes
        assert contiguous[0].sum() == 300.0  # row 0: inside the node
        assert flat_allreduce_traffic(100, [0, 1, 0, 1])[1].sum() == 600.0

    def test_hierarchical_and_node_local(self) -> None:
        hier = hierarchical_traffic(100, [0, 0, 1, 1])
        assert hier[1].tolist() == [100.0, 0.0, 100.0, 0.0]
        assert hier[0].tolist() == [100.0, 100.0, 100.0, 100.0]  # leaders broadcast, others reduce
        assert hierarchical_traffic(100, [0, 0, 0, 1])[0].tolist() == [200.0, 100.0, 100.0, 0.0]
        local = node_local_traffic(100, [0, 0, 1, 1])
        assert local[1].sum() == 0.0 and local[0].sum() == 400.0

    def test_node_local_k16_cuts_inter_node_bytes_more_than_tenfold(self) -> None:
        flat = flat_allreduce_traffic(1e6, [0, 0, 1, 1])[1].sum()
        amortised = hierarchical_traffic(1e6, [0, 0, 1, 1])[1].sum() / 16
        assert flat / amortised >= 10

    def test_comm_stats_dict(self) -> None:
        algorithm = AllReduce()
        algorithm.install(_FakeDDP([torch.zeros(25, requires_grad=True)]), [], [0, 0, 1, 1], 0)
        algorithm._record(flat_allreduce_traffic(100, [0, 0, 1, 1]))
        algorithm._record(flat_allreduce_traffic(100, [0, 0, 1, 1]))
        algorithm._record(hierarchical_traffic(100, [0, 0, 1, 1]), sync=True)
        d = algorithm.stats
        assert d["steps"] == 2 and d["global_syncs"] == 1
        assert d["bytes_intra_total"] == 400.0 and d["bytes_inter_total"] == 100.0
        assert d["job_bytes_inter_per_step"] == (300 * 2 + 200) / 2


def test_share_weights() -> None:
    assert merge_weights([1, 3], [0, 1]) == [0.25, 0.75]
    with pytest.raises(ValueError, match="samples"):
        merge_weights([0, 0], [0, 1])


# --------------------------------------------------------------------------- bad input
class TestArguments:
    def test_unknown_comm_lists_choices(self) -> None:
        with pytest.raises(
            ValueError, match=r"`comm` to be one of \['auto', 'allreduce', 'hierarchical', 'node_local'\]"
        ):
            HeterogeneousStrategy(comm="ring")

    @pytest.mark.parametrize("k", [0, -3, 1.5, True, "4"])
    def test_bad_global_sync_every(self, k: Any) -> None:
        with pytest.raises(ValueError, match="`global_sync_every` to be an integer >= 1"):
            typed_keywords({"comm": "node_local", "global_sync_every": k})

    @pytest.mark.parametrize("comm", ["auto", "allreduce", "hierarchical"])
    def test_k_without_node_local_warns(self, comm: str) -> None:
        with pytest.warns(UserWarning, match="only applies to `comm='node_local'`"):
            typed_keywords({"comm": comm, "global_sync_every": 4})

    def test_bad_warmup(self) -> None:
        with pytest.raises(ValueError, match="`comm_warmup_steps`"):
            typed_keywords({"comm": "node_local", "global_sync_every": 4, "comm_warmup_steps": -1})
        with pytest.raises(ValueError, match="`warmup_steps`"):
            NodeLocal(sync_every=4, warmup_steps=-1)

    @pytest.mark.parametrize(
        ("comm", "node_ids", "expected"),
        [
            ("auto", [0, 0, 1, 1], "hierarchical"),
            ("auto", [0, 1, 0, 1], "hierarchical"),
            ("auto", [0, 0, 0], "allreduce"),
            ("auto", [0, 1, 2], "allreduce"),
            ("allreduce", [0, 0, 1, 1], "allreduce"),
            ("hierarchical", [0, 0, 1], "hierarchical"),
            ("node_local", [0, 0, 1], "node_local"),
            ("node_local", [0, 1], "node_local"),
        ],
    )
    def test_resolve(self, comm: str, node_ids: list[int], expected: str) -> None:
        assert ALGORITHMS[comm]().resolve(node_ids).mode == expected

    @pytest.mark.parametrize(("node_ids", "reason"), [([0, 0], "a single node"), ([0, 1], "one replica per node")])
    def test_hierarchical_without_benefit_falls_back_with_log(
        self, caplog: pytest.LogCaptureFixture, node_ids: list[int], reason: str
    ) -> None:
        with caplog.at_level(logging.INFO, logger="lightning_het.comm.hierarchical"):
            assert isinstance(Hierarchical().resolve(node_ids), AllReduce)
        assert isinstance(Auto().resolve(node_ids), AllReduce)
        assert f"comm='hierarchical' with {reason}" in caplog.text

    def test_node_local_on_one_node_is_an_error(self) -> None:
        with pytest.raises(ValueError, match=r"`comm='node_local'`, but all 3 replicas are on one node.*HINT"):
            NodeLocal().resolve([0, 0, 0])
        with pytest.raises(ValueError, match="one node"):
            NodeLocal(sync_every=2).resolve([0, 0])

    def test_install_rejects_bad_input(self) -> None:
        with pytest.raises(ValueError, match=r"`batch_sizes` to hold one positive integer per replica \(2\)"):
            AllReduce().install(_FakeDDP([]), [], [0, 1], 0, [1, 2, 3])
        with pytest.raises(ValueError, match="`node_ids`"):
            AllReduce().install(_FakeDDP([]), [], [0, "a"], 0, [1, 1])  # type: ignore[list-item]
        with pytest.raises(ValueError, match="`sync_every`"):
            NodeLocal(sync_every=0)
        with pytest.raises(ValueError, match="`rank`"):
            AllReduce().install(_FakeDDP([]), [], [0, 1], 2, [1, 1])


# --------------------------------------------------------------------------- benchmark plumbing
def test_bench_comm_tiny_runs_end_to_end(tmp_path: Path) -> None:
    """`scripts/bench_comm.py --tiny` through Lightning on localhost: the plumbing, not the figures (noise here)."""
    from tests.conftest import REPO, run_job

    plot = tmp_path / "bench.png"
    result = run_job(
        [str(REPO / "scripts" / "bench_comm.py"), "--tiny", "--out", str(tmp_path), "--plot", str(plot)], timeout=300
    )
    assert result.returncode == 0, result.stdout[-6000:]
    payload = json.loads((tmp_path / "results.json").read_text())
    rows = {r["name"]: r for r in payload["results"]}
    names = ["ddp", "allreduce", "hierarchical", "hierarchy only", "node_local K=4", "node_local K=16"]
    assert list(rows) == [*names, "outer int8 K=32"]
    assert all(r["consensus"] for r in rows.values())
    exact = [rows[n]["eval_loss"] for n in ("ddp", "allreduce", "hierarchical", "hierarchy only")]
    assert max(exact) - min(exact) < 1e-5
    grad_bytes = payload["grad_bytes"]
    assert rows["ddp"]["inter_bytes_model"] == 3 * grad_bytes  # ring over [0, 0, 1, 1]: 2 of 4 hops cross, 1.5 n each
    assert rows["hierarchy only"]["inter_bytes_model"] == 2 * grad_bytes
    assert rows["hierarchy only"]["reduction"] == "hierarchical"
    # the measured choice is made inside the 3 untimed steps; the timed ones use it throughout
    chosen = rows["hierarchical"]["reduction"]
    assert rows["hierarchical"]["inter_bytes_model"] == {"flat": 3, "hierarchical": 2}[chosen] * grad_bytes
    assert rows["node_local K=16"]["inter_bytes_model"] == 0  # no global sync inside the 6 timed steps
    assert rows["outer int8 K=32"]["inter_bytes_model"] == 0
    assert plot.read_bytes()[:4] == b"\x89PNG"
    assert "| hierarchical |" in result.stdout
