"""Drop-in for DDP: what Lightning promises a DDP user keeps working with ``strategy="heterogeneous"``.

A DataLoader subclass with ``__init__`` arguments of its own, ``Trainer(use_distributed_sampler=False)``,
``copy.deepcopy(trainer.callbacks)``, a multi-node Trainer built where no rendezvous variables are set, and a fit that
leaves neither threads nor environment variables behind.
"""

from __future__ import annotations

import contextlib
import copy
import os
import threading
from dataclasses import dataclass

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_het import HeterogeneousStrategy, ProportionalDistributedSampler
from lightning_het.cluster.rendezvous import TOKEN_ENV
from tests.helpers.harness import run_harness
from tests.helpers.harness_fit import WATCHED_ENV as JOB_ENVIRONMENT
from tests.helpers.harness_fit import FeatureLoader
from tests.helpers.tiny import TinyRegressor, make_dataset, quiet_trainer, reference_weights

#: two fits, one after the other in the same two replicas (the second is a later Trainer call of the same job)
FITS = {
    "own_sharding": {"own_sharding": True, "val_n": 10, "epochs": 2, "n": 40, "batch_size": 4},
    "custom_loader": {"custom_loader": True, "val_n": 10, "strategy": {"speeds": [1, 3]}, "n": 40, "batch_size": 4},
}


@dataclass
class ContractJob:
    dumps: dict[str, list[dict]]  # per fit of FITS that ended: its per-rank dumps
    output: str
    clean: bool  # exit status 0 and nothing left of the job

    def fit(self, name: str) -> list[dict]:
        assert name in self.dumps, f"the {name!r} fit did not end:\n{self.output[-6000:]}"
        return self.dumps[name]


@pytest.fixture(scope="module")
def contract_job(tmp_path_factory) -> ContractJob:
    """Run :data:`FITS` in one two-replica job, started without the job's environment variables."""
    out = tmp_path_factory.mktemp("contract")
    with pytest.MonkeyPatch.context() as env:
        for name in JOB_ENVIRONMENT:
            env.delenv(name, raising=False)
        job = run_harness("contract", out, list(FITS.values()))
    dumps = {}
    for index, name in enumerate(FITS):
        paths = [out / str(index) / f"rank{r}.pt" for r in range(2)]
        if all(p.exists() for p in paths):
            dumps[name] = [torch.load(p) for p in paths]
    return ContractJob(dumps, job.output, job.returncode == 0 and not job.survivors)


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in b)


# ---------------------------------------------------------------------------------------------------- data loaders
def test_dataloader_subclass_with_its_own_init_arguments_is_re_split(contract_job):
    """``FeatureLoader(num_features, dataset, ...)`` made in the hooks, for training and validation: re-split (2 + 6
    of each global batch of 8, evaluation by share) and exact against one process on the whole batch."""
    dumps = contract_job.fit("custom_loader")
    assert [d["seen_batch_sizes"] for d in dumps] == [[2] * 5, [6] * 5]
    assert sum(d["val_seen"] for d in dumps) == 10  # each validation sample once over the replicas
    ref = reference_weights(make_dataset(40), 8, epochs=1, seed=0)
    for dump in dumps:
        assert _max_diff(dump["state_dict"], ref) < 1e-6


def test_dataloader_subclass_in_a_single_process_fit():
    """The same loader in one process: Lightning's copy is re-created once more, with its ``num_features``."""

    class Model(TinyRegressor):
        def train_dataloader(self):
            return FeatureLoader(4, make_dataset(24), batch_size=6, shuffle=True)

    pl.seed_everything(0)
    model = Model()
    trainer = quiet_trainer(1, HeterogeneousStrategy(speeds=[1.0], process_group_backend="gloo"), max_epochs=1)
    trainer.fit(model)
    assert model.seen_batch_sizes == [6] * 4


def test_use_distributed_sampler_false_reads_every_loader_whole_as_plain_ddp(contract_job):
    """The user's own sharding (each rank's Dataset is ``dataset[rank::2]``): nothing re-split, loss scale 1, the
    gradient the plain DDP mean (equal batches: exactly the 8-sample global batch), validation read whole per rank."""
    dumps = contract_job.fit("own_sharding")
    for dump in dumps:
        assert dump["seen_batch_sizes"] == [4] * 10 and dump["batch_sizes"] is None
        assert dump["loss_scale"] == 1.0 and dump["global_step"] == 10
        assert dump["val_seen"] == 2 * 10  # the whole validation loader, each epoch, on every rank
    full = make_dataset(40)
    shards = [list(range(r, 40, 2)) for r in range(2)]
    order = [i for k in range(0, 20, 4) for shard in shards for i in shard[k : k + 4]]  # step k: rank 0's, rank 1's
    ref = reference_weights(TensorDataset(*full[order]), 8, epochs=2, seed=0, shuffle=False)
    for dump in dumps:
        assert _max_diff(dump["state_dict"], ref) < 1e-6
    assert (
        contract_job.output.count("use_distributed_sampler=False") == 1
    )  # one warning (rank 0, once for every loader)


def test_use_distributed_sampler_false_still_adopts_a_proportional_sampler_of_the_users_own():
    """Only a plain loader falls back to DDP behaviour; a ``ProportionalDistributedSampler`` built by the user is the
    allocation (its loss scale with it), and a plain ``DistributedSampler`` is re-split as Lightning's own."""
    results = {}
    samplers = {
        "plain": None,
        "proportional": ProportionalDistributedSampler(make_dataset(24), [6], 0),
        "distributed": DistributedSampler(make_dataset(24), num_replicas=1, rank=0, shuffle=False),
    }
    for name, sampler in samplers.items():
        strategy = HeterogeneousStrategy(speeds=[1.0], process_group_backend="gloo")
        trainer = quiet_trainer(1, strategy, max_epochs=1, use_distributed_sampler=False)
        model = TinyRegressor()
        trainer.fit(model, DataLoader(make_dataset(24), batch_size=6, sampler=sampler))
        results[name] = (strategy.batch_sizes, strategy.loss_scale, model.seen_batch_sizes)
    assert results == {
        "plain": (None, 1.0, [6] * 4),
        "proportional": ([6], 1.0, [6] * 4),
        "distributed": ([6], 1.0, [6] * 4),
    }


# ---------------------------------------------------------------------------------------------------- callbacks
def test_trainer_callbacks_can_be_deep_copied_during_fit(contract_job):
    for name in FITS:
        assert [d["deepcopy_error"] for d in contract_job.fit(name)] == [None, None], name


def test_trainer_callbacks_can_be_deep_copied_in_a_single_process_fit():
    copies: list = []

    class Copy(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            copies.append(copy.deepcopy(trainer.callbacks))

    strategy = HeterogeneousStrategy(speeds=[1.0], process_group_backend="gloo")
    trainer = quiet_trainer(1, strategy, max_steps=2, callbacks=[Copy()])
    trainer.fit(TinyRegressor(), DataLoader(make_dataset(16), batch_size=4))
    assert "PreemptionCallback" in [type(c).__name__ for c in copies[0]]


# ---------------------------------------------------------------------------------------------------- what a fit leaves
def test_no_thread_of_ours_is_left_after_fit(contract_job):
    """On rank 0 (the launching process, which watched replica 1 during each fit) and on rank 1, after each of two
    fits: no thread the strategy or its launcher started still runs."""
    for name in FITS:
        for dump in contract_job.fit(name):
            assert not [t for t in dump["threads_after_fit"] if t.startswith("lightning-het")], (name, dump)
    assert contract_job.clean, contract_job.output[-6000:]


def test_job_variables_are_restored_after_fit(contract_job):
    """The job token and the loopback socket variables are gone again after each fit in the launching process (unset
    when the job started); a launched replica keeps what it was launched with, the token included."""
    unset = dict.fromkeys(JOB_ENVIRONMENT)
    for name in FITS:
        fit = contract_job.fit(name)
        assert fit[0]["env_before"] == unset and fit[0]["env_after"] == unset, name
        assert fit[1]["env_before"] == fit[1]["env_after"], name
        assert fit[1]["env_before"][TOKEN_ENV] and fit[1]["env_before"]["GLOO_SOCKET_IFNAME"] == "lo", name


class _FailingRegressor(TinyRegressor):
    def training_step(self, batch, batch_idx):
        raise RuntimeError("a bug in the user's step")


@pytest.mark.parametrize("fails", [False, True], ids=["ends", "raises"])
def test_single_process_fit_leaves_no_thread_and_no_variable(monkeypatch, fails):
    """Also when the fit raises (Lightning then tears the strategy down after the launcher has returned)."""
    for name in JOB_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    strategy = HeterogeneousStrategy(speeds=[1.0], process_group_backend="gloo")
    trainer = quiet_trainer(1, strategy, max_steps=2)
    model = _FailingRegressor() if fails else TinyRegressor()
    with pytest.raises(RuntimeError, match="a bug in the user's step") if fails else contextlib.nullcontext():
        trainer.fit(model, DataLoader(make_dataset(16), batch_size=4))
    assert not [t.name for t in threading.enumerate() if t.name.startswith("lightning-het")]
    assert {name: os.environ.get(name) for name in JOB_ENVIRONMENT} == dict.fromkeys(JOB_ENVIRONMENT)


# ---------------------------------------------------------------------------------------------------- multi-node set-up
@pytest.mark.parametrize("start_method", ["popen", "spawn"])
def test_multi_node_trainer_builds_without_rendezvous_variables_and_launch_refuses(monkeypatch, start_method):
    """Building (a login node, a unit test, printing a config) works; launching names the missing variables before
    any process starts."""
    for name in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK"):
        monkeypatch.delenv(name, raising=False)
    strategy = HeterogeneousStrategy(process_group_backend="gloo", start_method=start_method)
    trainer = quiet_trainer(1, strategy, num_nodes=2)
    assert trainer.num_nodes == 2
    started: list[int] = []
    with pytest.raises(ValueError, match=r"num_nodes=2.*MASTER_ADDR, MASTER_PORT, NODE_RANK.*HINT"):
        trainer.strategy.launcher.launch(lambda: started.append(1), trainer=trainer)
    assert started == [] and not getattr(trainer.strategy.launcher, "procs", [])
