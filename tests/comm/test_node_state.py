"""Each node's own state in a ``comm="node_local"`` checkpoint, in one process: the record a save builds from the
gathered entries, and what every rank of a resumed fit picks from it (its node's, or nothing for another layout)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from lightning_het import AllReduce, NodeLocal
from lightning_het.cluster.topology import NodeGroups, node_members
from lightning_het.comm import node_local as node_local_module
from lightning_het.comm.node_local import layout_change
from lightning_het.reliability.checkpointing import CHECKPOINT_KEY, node_optimizer_checkpoint, with_node_states


def _fake_groups(node_ids: list[int], rank: int) -> NodeGroups:
    members = tuple(tuple(m) for m in node_members(node_ids))
    return NodeGroups(tuple(node_ids), rank, members, None, None, None)  # type: ignore[arg-type]


class _FakeDDP:
    """What :meth:`NodeLocal.install` uses of a ``DistributedDataParallel``: its parameters."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params

    def parameters(self) -> list[torch.Tensor]:
        return self.params

    def register_comm_hook(self, state: Any, hook: Any) -> None:
        pass


def _controller(node_ids: list[int], rank: int, params: list[torch.Tensor] | None = None) -> NodeLocal:
    """``node_local`` with DiLoCo's outer step over int8, installed on ``params`` (no process group: fake groups)."""
    algorithm = NodeLocal(sync_every=2, outer="nesterov", sync_dtype="int8")
    ddp = _FakeDDP([torch.zeros(3)] if params is None else params)
    algorithm.install(ddp, [], node_ids, rank, None, groups=_fake_groups(node_ids, rank))
    return algorithm


def _states(node: int) -> list[dict[str, Any]]:
    """One optimizer's state dict, told apart by ``node``."""
    return [{"state": {0: {"momentum_buffer": torch.full((3,), float(node))}}, "param_groups": [{"params": [0]}]}]


#: saved by nodes [0, 0, 1, 1]: each node's leader's optimizer states and residual (no parameters: an older record)
RECORD = {
    "layout": [2, 2],
    "optimizer_states": [_states(0), _states(1)],
    "residuals": [torch.full((4,), 0.5), torch.full((4,), -0.25)],
    "params": [None, None],
}


def test_the_record_holds_each_nodes_leader_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nodes [0, 1, 0, 1, 1]: the leaders are ranks 0 and 1; the others send nothing; rank 0 alone gets the record."""
    sent: list[Any] = []
    others = [None, (_states(1), torch.full((4,), -0.25), [torch.ones(3)]), None, None, None]

    def gather_object(obj: Any, gathered: list[Any] | None, dst: int) -> None:
        sent.append(obj)
        if gathered is not None:
            gathered[:] = others

    monkeypatch.setattr(node_local_module.dist, "gather_object", gather_object)
    ctl = _controller([0, 1, 0, 1, 1], 0)
    ctl._residual = torch.full((4,), 0.5)
    states = _states(0)
    record = ctl.gather_node_states(states)
    assert record is not None and record["layout"] == [2, 3] and sent == [None]
    assert record["optimizer_states"][0] is states and record["optimizer_states"][1] is others[1][0]  # type: ignore[index]
    assert [r.tolist() for r in record["residuals"]] == [[0.5] * 4, [-0.25] * 4]
    assert record["params"][0][0].tolist() == [0.0] * 3 and record["params"][1] is others[1][2]  # type: ignore[index]
    leader = _controller([0, 1, 0, 1, 1], 1)  # a leader: its entry on the CPU, no record
    assert leader.gather_node_states(states) is None and sent[-1][0] is not states and len(sent[-1][2]) == 1
    assert _controller([0, 1, 0, 1, 1], 3).gather_node_states(states) is None and sent[-1] is None


def test_each_rank_picks_its_node_for_the_same_layout() -> None:
    comm = _checkpoint()[CHECKPOINT_KEY]["comm"]
    for node_ids in ([0, 0, 1, 1], [0, 1, 0, 1]):  # ranks placed otherwise: the same layout
        for rank in range(4):
            states = _controller(node_ids, rank).node_optimizer_states(comm)
            assert states is RECORD["optimizer_states"][node_ids[rank]]
    assert layout_change(RECORD, [0, 1, 0, 1]) is None


@pytest.mark.parametrize(
    ("node_ids", "now"), [([0, 0, 1], [2, 1]), ([0, 1, 2, 3], [1, 1, 1, 1]), ([0, 0, 0, 1], [3, 1])]
)
def test_another_layout_picks_nothing(node_ids: list[int], now: list[int]) -> None:
    comm = _checkpoint()[CHECKPOINT_KEY]["comm"]
    assert all(_controller(node_ids, r).node_optimizer_states(comm) is None for r in range(len(node_ids)))
    assert layout_change(RECORD, node_ids) == f"the checkpoint's nodes held [2, 2] replicas, this run's hold {now}"
    assert _controller(node_ids, 0).node_optimizer_states(None) is None and layout_change(None, node_ids) is None


def _checkpoint() -> dict[str, Any]:
    comm = {"samples": [0, 0, 0, 0], "merge": {"optimizer": None}, "nodes": RECORD}
    return {"optimizer_states": _states(0), CHECKPOINT_KEY: {"comm": comm}}


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_a_resumed_rank_loads_its_nodes_optimizer_state_and_a_leader_its_residual(rank: int) -> None:
    checkpoint, node = _checkpoint(), [0, 0, 1, 1][rank]
    ctl = _controller([0, 0, 1, 1], rank)
    ctl.load_state_dict(checkpoint[CHECKPOINT_KEY]["comm"])
    residual = ctl._residual
    if rank in (0, 2):
        assert torch.equal(residual, RECORD["residuals"][node])
    else:
        assert residual is None  # a leader's alone
    resumed = node_optimizer_checkpoint(checkpoint, ctl)
    assert resumed["optimizer_states"] is RECORD["optimizer_states"][node]
    assert resumed[CHECKPOINT_KEY] is checkpoint[CHECKPOINT_KEY]


def test_another_layout_resumes_rank_0s_state_and_no_residual(caplog: pytest.LogCaptureFixture) -> None:
    checkpoint = _checkpoint()
    for rank in (0, 2):
        ctl = _controller([0, 0, 1], rank)
        ctl.load_state_dict(checkpoint[CHECKPOINT_KEY]["comm"])
        assert ctl._residual is None
        with caplog.at_level(logging.INFO, logger="lightning_het.comm.node_local"):
            assert node_optimizer_checkpoint(checkpoint, ctl) is checkpoint
    assert [r.getMessage() for r in caplog.records] == [  # rank 0 alone says so
        "lightning-het comm='node_local': the checkpoint's nodes held [2, 2] replicas, this run's hold [2, 1], so every"
        " node resumes rank 0's inner optimizer state and the compression residual restarts from zero"
    ]


def test_other_modes_and_older_checkpoints_keep_rank_0s_state() -> None:
    checkpoint = _checkpoint()
    assert node_optimizer_checkpoint(checkpoint, AllReduce()) is checkpoint
    assert node_optimizer_checkpoint(checkpoint, None) is checkpoint
    older = {"optimizer_states": _states(0), CHECKPOINT_KEY: {"comm": {"samples": [0, 0, 0, 0]}}}
    assert node_optimizer_checkpoint(older, _controller([0, 0, 1, 1], 2)) is older
    assert node_optimizer_checkpoint({"optimizer_states": []}, _controller([0, 0, 1, 1], 2))["optimizer_states"] == []


class _Gathering:
    """Stands for a controller on rank 0: what it was asked to gather, and the record it returns."""

    def __init__(self, nodes: dict[str, Any] | None) -> None:
        self.nodes, self.asked = nodes, []

    def gather_node_states(self, optimizer_states: list[Any]) -> dict[str, Any] | None:
        self.asked.append(optimizer_states)
        return self.nodes


def test_a_save_puts_the_gathered_record_into_the_comm_state() -> None:
    checkpoint = {"optimizer_states": _states(0)}
    ctl = _Gathering(RECORD)
    record = with_node_states({"comm": {"samples": [1, 1]}}, checkpoint, ctl)
    assert record["comm"] == {"samples": [1, 1], "nodes": RECORD} and ctl.asked == [checkpoint["optimizer_states"]]
    assert with_node_states({"comm": {"samples": [1, 1]}}, checkpoint, _Gathering(None)) == {
        "comm": {"samples": [1, 1]}
    }
    weights_only = _Gathering(RECORD)  # no optimizer states: no gather (the same on every rank)
    assert with_node_states({"comm": None}, {"state_dict": {}}, weights_only) == {"comm": None}
    assert weights_only.asked == [] and with_node_states({"comm": None}, checkpoint, None) == {"comm": None}


# ---------------------------------------------------------------------------------------------------- the consensus
def _averaging_to(monkeypatch: pytest.MonkeyPatch, value: float) -> list[float]:
    """The sum over replicas, faked: every tensor becomes ``value``; returns the weights it was called with."""
    weights: list[float] = []

    def fake_average(tensors: Any, weight: float, state: Any) -> int:
        weights.append(weight)
        for t in tensors:
            t.fill_(value)
        return 0

    monkeypatch.setattr(node_local_module, "average_parameters", fake_average)
    return weights


def test_the_consensus_changes_no_training_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """Computing, showing and hiding the consensus leaves the replica's model, the samples since the sync, the anchor,
    the outer optimizer and the residual as they were; no outer step is taken."""
    weights = _averaging_to(monkeypatch, 7.0)
    params = [torch.ones(3, requires_grad=True), torch.full((2,), 2.0, requires_grad=True)]
    ctl = NodeLocal(sync_every=4, outer="nesterov")
    opt = torch.optim.SGD(params, lr=1.0)
    ctl.install(_FakeDDP(params), [opt], [0, 1], 1, [1, 3], groups=_fake_groups([0, 1], 1))
    assert ctl.consensus() is None and weights == []  # the replicas agree: nothing to exchange
    params[0].grad = torch.full((3,), -1.0)
    opt.step()  # a local step
    before = ctl.state_dict()
    consensus = ctl.consensus()
    assert weights == [0.75] and [c.tolist() for c in consensus] == [[7.0] * 3, [7.0] * 2]  # type: ignore[union-attr]
    assert params[0].tolist() == [2.0] * 3
    ctl.show_consensus()
    assert params[0].tolist() == [7.0] * 3 and ctl.consensus() is None  # shown already
    ctl.hide_consensus()
    assert params[0].tolist() == [2.0] * 3 and params[1].tolist() == [2.0] * 2
    after = ctl.state_dict()
    assert after["samples"] == before["samples"] == [1, 3] and not after["in_consensus"]
    assert all(torch.equal(a, b) for a, b in zip(after["merge"]["anchor"], before["merge"]["anchor"]))
    assert not after["merge"]["optimizer"]["state"]  # no outer step taken


def test_a_resumed_rank_loads_its_nodes_parameters_and_the_anchor() -> None:
    saved_params = [[torch.full((3,), 1.0)], [torch.full((3,), 2.0)]]
    record = {"layout": [1, 1], "optimizer_states": [_states(0), _states(1)], "residuals": [None, None]}
    record["params"] = saved_params
    anchor = [torch.full((3,), 5.0)]
    comm = {"samples": [2, 6], "in_consensus": False, "merge": {"optimizer": None, "anchor": anchor}, "nodes": record}
    for rank in range(2):
        params = [torch.zeros(3)]  # as loaded: the checkpoint's consensus
        ctl = _controller([0, 1], rank, params)
        ctl.load_state_dict(comm)
        assert torch.equal(params[0], saved_params[rank][0])
        state = ctl.state_dict()
        assert state["samples"] == [2, 6] and not state["in_consensus"]
        assert torch.equal(state["merge"]["anchor"][0], anchor[0])
    # another layout: every node goes on from the consensus
    params = [torch.zeros(3)]
    ctl = _controller([0, 0, 1], 2, params)
    ctl.load_state_dict(comm)
    assert not params[0].any()
