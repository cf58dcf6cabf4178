"""``comm="node_local"``: watching the model (checkpoints, validation) does not change its trajectory, and a resume from
any checkpoint continues it exactly.

Two emulated nodes of one replica each (``node_ids=[0, 1]``, speeds 1:3, so shares 2/8 and 6/8), DiLoCo's outer
Nesterov step every 3 optimizer steps over an int8 exchange with error feedback, SGD momentum inside the nodes, 2 epochs
of 5 global batches: syncs after steps 3, 5 (the epoch's end), 6, 9 and 10. The watched fit saves a checkpoint every 2
steps (2, 4 and 8 in the middle of a round, 6 right after a sync), validates after every 2 batches of an epoch (steps 2,
4, 7 and 9, all in the middle of a round) and saves again at the end of each validation (while it shows the
consensus); the plain fit does none of it. All fits run in one job.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.harness import run_harness, split_output

#: the node_local settings under test
STRATEGY = {
    "comm": "node_local",
    "node_ids": [0, 1],
    "speeds": [1, 3],
    "global_sync_every": 3,
    "outer_optimizer": "nesterov",
    "sync_dtype": "int8",
}
SHARES = (0.25, 0.75)
PLAIN = {"devices": 2, "strategy": STRATEGY, "epochs": 2}
WATCHED = {**PLAIN, "save_every": 2, "val_n": 10, "val_check_interval": 2, "val_ckpt": True}
#: the watched fit's checkpoints the resumes start from: every 2 steps (in the middle of a round in each epoch, and
#: right after a sync), and at the end of a validation in the middle of a round (taken while it shows the consensus)
RESUMED_FROM = ("ckpt/step=2.ckpt", "ckpt/step=6.ckpt", "ckpt/step=8.ckpt", "val_ckpt/step=4.ckpt")


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest difference between two state dicts (asserting they hold the same keys)."""
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def fits(tmp_path_factory) -> dict[str, Path]:
    """The folder of each fit: ``plain``, ``watched`` and one resume (plain: no checkpoints, no validation) from each
    of :data:`RESUMED_FROM`."""
    out = tmp_path_factory.mktemp("observed")
    resumes = {f"resumed from {name}": {**PLAIN, "resume": str(out / "1" / name)} for name in RESUMED_FROM}
    configs = {"plain": PLAIN, "watched": WATCHED, **resumes}
    job = run_harness("resume", out, list(configs.values()), limit=300)
    assert job.returncode == 0, job.output[-6000:]
    folders = {name: out / str(index) for index, name in enumerate(configs)}
    for folder, output in zip(folders.values(), split_output(job.output, len(configs))):
        (folder / "output.txt").write_text(output)
    return folders


def _final(folder: Path, rank: int) -> dict[str, torch.Tensor]:
    return torch.load(folder / f"rank{rank}.pt", weights_only=False)["state_dict"]


@pytest.mark.slow
def test_checkpoints_and_validation_do_not_change_the_trajectory(fits):
    watched = [torch.load(fits["watched"] / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert all(d["val_seen"] > 0 for d in watched)  # it did validate (after steps 2, 4, 7 and 9)
    assert sorted(p.name for p in (fits["watched"] / "ckpt").iterdir()) == [f"step={s}.ckpt" for s in (10, 2, 4, 6, 8)]
    validated = sorted(p.name for p in (fits["watched"] / "val_ckpt").iterdir())
    assert validated == [f"step={s}.ckpt" for s in (2, 4, 7, 9)]
    for rank in range(2):
        assert _close(_final(fits["watched"], rank), _final(fits["plain"], rank)) <= 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("name", RESUMED_FROM)
def test_a_resume_from_any_checkpoint_ends_where_the_uninterrupted_fit_does(fits, name):
    for rank in range(2):
        assert _close(_final(fits[f"resumed from {name}"], rank), _final(fits["plain"], rank)) <= 1e-6


@pytest.mark.slow
def test_a_checkpoint_holds_the_consensus_and_every_node_keeps_its_own_model(fits):
    """In the middle of a round (step 2) the nodes' models differ; the checkpoint's weights are their share-weighted
    average, and each replica still holds its own model after the save. Its record holds each node's parameters and
    inner optimizer state, the outer optimizer's state and anchor, and each leader's int8 residual."""
    folder = fits["watched"]
    checkpoint = torch.load(folder / "ckpt" / "step=2.ckpt", weights_only=True)
    saved = {k.removeprefix("net."): v for k, v in checkpoint["state_dict"].items() if k.startswith("net.")}
    before = [torch.load(folder / f"before_step2_rank{r}.pt") for r in range(2)]
    held = [torch.load(folder / f"saved_step2_rank{r}.pt") for r in range(2)]
    assert not all(torch.equal(before[0][k], before[1][k]) for k in saved)
    for k in saved:
        assert torch.allclose(saved[k], SHARES[0] * before[0][k] + SHARES[1] * before[1][k], atol=1e-6)
        assert all(torch.equal(held[r][k], before[r][k]) for r in range(2))  # the save changed no replica
    comm = checkpoint["lightning_het"]["comm"]
    assert comm["samples"] == [4, 12] and not comm["in_consensus"]  # two steps of [2, 6] since the start
    nodes = comm["nodes"]
    assert nodes["layout"] == [1, 1] and len(nodes["params"]) == 2
    names = list(saved)  # the module's parameters, in order
    for node in range(2):
        assert all(torch.equal(p, before[node][k]) for p, k in zip(nodes["params"][node], names))
    assert comm["merge"]["anchor"] and nodes["residuals"][0] is None  # no sync yet: no residual


@pytest.mark.slow
def test_validation_sees_the_consensus(fits):
    """Validating in the middle of a round (after step 2), both replicas see the checkpoint's consensus model."""
    folder = fits["watched"]
    saved = torch.load(folder / "ckpt" / "step=2.ckpt", weights_only=True)["state_dict"]
    seen = [torch.load(folder / f"validated_step2_rank{r}.pt") for r in range(2)]
    for k, v in seen[0].items():
        assert torch.allclose(v, saved[f"net.{k}"], atol=1e-6) and torch.equal(v, seen[1][k])


@pytest.mark.slow
def test_a_checkpoint_taken_during_validation_holds_each_nodes_own_model(fits):
    """Saved at the end of the validation after step 4 (while the module shows the consensus), the checkpoint holds the
    same consensus and the same per-node parameters as the one saved before that validation."""
    folder = fits["watched"]
    during, before = (torch.load(folder / d / "step=4.ckpt", weights_only=True) for d in ("val_ckpt", "ckpt"))
    assert _close(during["state_dict"], before["state_dict"]) <= 1e-6
    nodes = [c["lightning_het"]["comm"]["nodes"]["params"] for c in (during, before)]
    assert not all(torch.equal(a, b) for a, b in zip(*nodes[1]))  # the nodes' models differ
    for node in range(2):
        assert all(torch.equal(a, b) for a, b in zip(nodes[0][node], nodes[1][node]))
