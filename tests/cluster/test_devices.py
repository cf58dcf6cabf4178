"""Device maps: parsing, backend choice, CPU threads, MixedAccelerator and the strategy wiring.

No GPU is available here: CUDA replicas are tested with *faked* maps (``torch.cuda.device_count`` /
``is_available`` monkeypatched) up to the point where a real GPU would be touched (``torch.cuda.set_device`` and
``init_process_group`` are intercepted). The multi-process test runs real CPU replicas under a device map.
"""

from __future__ import annotations

import pickle

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_het import HeterogeneousStrategy
from lightning_het._flavour import trainer_flavour
from lightning_het.cluster.accelerators import (
    MixedAccelerator,
    apply_local_settings,
    choose_backend,
    device_labels,
    node_device_maps,
    parse_device_map,
    plan_cpu_threads,
    plan_devices,
    unbound_process_group,
)
from tests.helpers.tiny import make_dataset, reference_weights

CPU = torch.device("cpu")


def cuda(i: int) -> torch.device:
    return torch.device("cuda", i)


@pytest.fixture(autouse=True)
def sixteen_cores(monkeypatch):
    """Thread plans of in-process Trainers as on a 16-core host (this one has 2)."""
    monkeypatch.setattr("lightning_het.cluster.accelerators.available_cpu_cores", lambda: 16)


@pytest.fixture
def fake_gpus(monkeypatch):
    """``fake_gpus(n)``: pretend this host has ``n`` visible CUDA devices (no CUDA call may go further)."""

    def _fake(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)

    return _fake


def _trainer(strategy, **kwargs) -> pl.Trainer:
    return pl.Trainer(
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


# --------------------------------------------------------------------------- pure parsing
class TestParseDeviceMap:
    @pytest.mark.parametrize(
        ("device_map", "count", "expected"),
        [
            (["cpu", "cpu"], 0, [CPU, CPU]),
            ("cuda:0, cpu ,cpu", 1, [cuda(0), CPU, CPU]),
            (["cuda:1", "CPU", "gpu:0"], 2, [cuda(1), CPU, cuda(0)]),
            (["cuda", "cpu", "cuda:0", "gpu"], 3, [cuda(1), CPU, cuda(0), cuda(2)]),  # bare: lowest unused index
            ([torch.device("cuda", 0), 1, "cpu:0"], 2, [cuda(0), cuda(1), CPU]),
            (["cuda:7", "cpu"], None, [cuda(7), CPU]),  # another node's map: no range check
        ],
    )
    def test_valid(self, device_map, count, expected):
        assert parse_device_map(device_map, cuda_device_count=count) == expected

    @pytest.mark.parametrize(
        ("device_map", "kwargs", "match"),
        [
            (["cpu", "tpu"], {}, r"`device_map\[1\]` to be one of 'cpu', 'cuda'.*but got 'tpu'"),
            (["cuda:x"], {}, r"`device_map\[0\]`.*'cuda:x'"),
            (["mps"], {}, r"'mps'"),
            (["cpu:1"], {}, r"'cpu:1'"),
            ([True], {}, r"`device_map\[0\]`"),
            ([-1], {}, r"GPU index >= 0"),
            ([], {}, r"at least one device"),
            ({"a": 1}, {}, r"list of devices"),
            (["cuda:0", "cpu", "cuda:0"], {}, r"cuda:0 twice.*`device_map\[0\]`='cuda:0' and `device_map\[2\]`"),
            (["cuda:0", "cuda:2"], {"cuda_device_count": 2}, r"`device_map\[1\]`='cuda:2'.*only 2 CUDA device"),
            (["cuda", "cuda", "cuda"], {"cuda_device_count": 2}, r"`device_map\[2\]`='cuda' \(-> cuda:2\)"),
            (["cuda:0", "cpu"], {"cuda_device_count": 0}, r"no CUDA device is visible.*device_count\(\)=0"),
            (["cpu", "cpu", "cpu"], {"local_world_size": 2}, r"3 entries.*runs 2 replicas"),
        ],
    )
    def test_errors(self, device_map, kwargs, match):
        with pytest.raises(ValueError, match=match):
            parse_device_map(device_map, **kwargs)

    def test_per_node_maps(self):
        assert node_device_maps(["cuda:0", "cpu"], 2) == [["cuda:0", "cpu"], ["cuda:0", "cpu"]]
        assert node_device_maps({"1": "cpu,cpu", 0: ["cuda:0", "cpu"]}, 2) == [["cuda:0", "cpu"], ["cpu", "cpu"]]
        with pytest.raises(ValueError, match=r"node ranks \[0, 2\], but the job has 2 node"):
            node_device_maps({0: ["cpu"], 2: ["cpu"]}, 2)
        with pytest.raises(ValueError, match=r"different numbers of replicas per node \(\{0: 2, 1: 1\}\)"):
            node_device_maps({0: ["cuda:0", "cpu"], 1: ["cpu"]}, 2)
        with pytest.raises(ValueError, match=r"keys of `device_map` to be node ranks.*'gpu-node'"):
            node_device_maps({"gpu-node": ["cpu"]})


class TestChooseBackend:
    @pytest.mark.parametrize(
        ("devices", "requested", "expected"),
        [
            ([cuda(0), cuda(1)], None, "nccl"),
            ([cuda(0), cuda(1)], "gloo", "gloo"),
            ([cuda(0), cuda(1)], "cpu:gloo,cuda:nccl", "cpu:gloo,cuda:nccl"),
            ([CPU, CPU], None, "gloo"),
            ([CPU, CPU], "mpi", "mpi"),
            ([cuda(0), CPU], None, "gloo"),
            ([cuda(0), CPU], "", "gloo"),
            ([cuda(0), CPU], "GLOO", "gloo"),
        ],
    )
    def test_matrix(self, devices, requested, expected):
        assert choose_backend(devices, requested) == expected

    @pytest.mark.parametrize(
        ("devices", "requested", "match"),
        [
            ([cuda(0), CPU], "nccl", r"'nccl'.*mixes CPU and CUDA replicas \(1 CPU, 1 CUDA\).*only Gloo"),
            ([cuda(0), CPU], "cpu:gloo,cuda:nccl", r"mixes CPU and CUDA"),
            ([cuda(0), CPU], "mpi", r"mixes CPU and CUDA"),
            ([CPU, CPU], "nccl", r"'nccl'.*CPU replicas \(2 CPU\); NCCL only communicates CUDA tensors"),
        ],
    )
    def test_errors(self, devices, requested, match):
        with pytest.raises(ValueError, match=match):
            choose_backend(devices, requested)


class TestCpuThreads:
    def test_default_split_leaves_one_core_per_gpu(self):
        assert plan_cpu_threads([cuda(0), CPU, CPU], 16) == [1, 8, 7]
        assert plan_cpu_threads([cuda(0), cuda(1), CPU], 16) == [1, 1, 14]
        assert plan_cpu_threads([CPU, CPU], 2) == [1, 1]
        assert plan_cpu_threads([cuda(0)], 8) == [1]

    def test_oversubscribed_node_warns(self):
        with pytest.warns(UserWarning, match="2 available cores for 1 CUDA replica"):
            assert plan_cpu_threads([cuda(0), CPU, CPU], 2) == [1, 1, 1]

    def test_explicit(self):
        assert plan_cpu_threads([cuda(0), CPU, CPU], 16, 4) == [1, 4, 4]
        assert plan_cpu_threads([cuda(0), CPU], 16, [2, 6]) == [2, 6]
        with pytest.warns(UserWarning, match="asks for 5 threads on a node with 4 available cores"):
            plan_cpu_threads([CPU, CPU], 4, [2, 3])

    @pytest.mark.parametrize(
        ("cpu_threads", "match"),
        [
            (0, r"`cpu_threads` to be an integer >= 1, but got 0"),
            ([2, 0], r"`cpu_threads\[1\]`"),
            ([2], r"`cpu_threads`=\[2\] with 1 entries, but the node runs 2"),
            ("4", r"an integer or one integer per local replica"),
        ],
    )
    def test_errors(self, cpu_threads, match):
        with pytest.raises(ValueError, match=match):
            plan_cpu_threads([CPU, CPU], 4, cpu_threads)


def test_plan_checks_only_this_nodes_gpus():
    per_node = {0: ["cuda:0", "cpu"], 1: ["cpu", "cpu"]}
    common = {"num_nodes": 2, "local_world_size": 2, "cuda_device_count": 0, "cpu_cores": 4}
    plan = plan_devices(per_node, node_rank=1, **common)  # the CPU-only node may have no GPU at all
    assert plan.local_devices == (CPU, CPU)
    assert plan.global_devices == (cuda(0), CPU, CPU, CPU)
    assert (plan.backend, plan.threads, plan.mixed) == ("gloo", (2, 2), True)
    with pytest.raises(ValueError, match=r"`device_map\[0\]`.*no CUDA device is visible"):
        plan_devices(per_node, node_rank=0, **common)


# --------------------------------------------------------------------------- Trainer construction (faked GPUs)
class TestStrategyWiring:
    def test_mixed_map_devices_backend_and_ddp_ids(self, fake_gpus, monkeypatch):
        fake_gpus(2)
        strategy = HeterogeneousStrategy(device_map=["cuda:1", "cpu", "cuda:0"])
        trainer = _trainer(strategy)  # accelerator and devices left at "auto": the map decides
        assert isinstance(trainer.accelerator, MixedAccelerator)
        assert trainer.num_devices == 3
        assert strategy.parallel_devices == [cuda(1), CPU, cuda(0)]
        assert strategy.process_group_backend == "gloo"
        expected = {0: (cuda(1), [1]), 1: (CPU, None), 2: (cuda(0), [0])}
        for local_rank, (root, ddp_ids) in expected.items():
            monkeypatch.setenv("LOCAL_RANK", str(local_rank))
            assert strategy.root_device == root
            assert strategy.determine_ddp_device_ids() == ddp_ids
            with unbound_process_group(strategy):
                assert strategy.root_device == CPU  # so Lightning passes no device_id to init_process_group
            assert strategy.root_device == root
        assert device_labels(strategy) == ["cuda:1", "cpu", "cuda:0"]

    @pytest.mark.parametrize(
        ("device_map", "backend", "bound"), [(["cuda:1", "cpu"], "gloo", None), (["cuda:1"], "nccl", 1)]
    )
    def test_setup_distributed_binds_a_device_only_when_no_rank_is_cpu(
        self, fake_gpus, monkeypatch, device_map, backend, bound
    ):
        fake_gpus(2)
        calls = []
        fake_init = lambda env, be, store=None, **kw: calls.append((be, kw))  # noqa: E731  (store: our rendezvous)
        monkeypatch.setattr("lightning_het.cluster.rendezvous.start_default_group", fake_init)
        monkeypatch.setattr(
            "lightning_het.cluster.rendezvous.store_barrier", lambda *args, **kwargs: None
        )  # rank 1: none
        monkeypatch.setenv("LOCAL_RANK", "0")
        strategy = HeterogeneousStrategy(device_map=device_map)
        _trainer(strategy)
        strategy.setup_distributed()
        assert calls == [(backend, {"timeout": strategy._timeout, "device_id": None if bound is None else cuda(bound)})]
        assert strategy.root_device == cuda(1)

    def test_setup_device_touches_cuda_only_for_cuda_replicas(self, monkeypatch):
        selected = []
        monkeypatch.setattr(torch.cuda, "set_device", selected.append)
        accelerator = MixedAccelerator(["cuda:0", "cpu"])
        accelerator.setup_device(CPU)
        assert selected == []
        accelerator.setup_device(cuda(0))
        assert selected == [cuda(0)]

    def test_per_node_map_and_balance_table(self, fake_gpus, monkeypatch):
        fake_gpus(1)
        monkeypatch.setenv("NODE_RANK", "1")
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # a 2-node Trainer wants a rendezvous address
        monkeypatch.setenv("MASTER_PORT", "29500")
        strategy = HeterogeneousStrategy(device_map={0: ["cuda:0", "cpu"], 1: ["cpu", "cpu"]}, speeds=[8, 1, 1, 1])
        _trainer(strategy, num_nodes=2)
        assert strategy.parallel_devices == [CPU, CPU]
        assert strategy.process_group_backend == "gloo"
        strategy.adopt_allocation([8, 2, 2, 2], [8.0, 1.0, 1.0, 1.0])
        strategy._node_ids = [0, 0, 1, 1]
        rows = strategy.balance_table().splitlines()[2:]
        assert [row.split()[2] for row in rows] == ["cuda:0", "cpu", "cpu", "cpu"]
        assert strategy.balance_report()["devices"] == ["cuda:0", "cpu", "cpu", "cpu"]

    def test_accelerator_instance_path_and_auto_devices(self):
        trainer = _trainer(HeterogeneousStrategy(), accelerator=MixedAccelerator(["cpu"] * 3, cpu_threads=1))
        assert trainer.strategy.parallel_devices == [CPU] * 3
        assert trainer.strategy.device_plan.threads == (1, 1, 1)

    def test_bf16_mixed_autocasts_on_each_replicas_device(self, monkeypatch):
        threads = []
        monkeypatch.setattr(torch, "set_num_threads", threads.append)
        monkeypatch.setenv("OMP_NUM_THREADS", "9")  # restored by monkeypatch
        monkeypatch.setenv("LOCAL_RANK", "1")
        strategy = HeterogeneousStrategy(device_map=["cpu", "cpu"], cpu_threads=[1, 2])
        trainer = _trainer(strategy, precision="bf16-mixed")
        assert trainer.precision_plugin.device == "cuda"  # what Lightning picks for a non-CPU accelerator
        apply_local_settings(strategy)
        assert trainer.precision_plugin.device == "cpu"
        assert threads == [2]

    def test_pickles_for_spawn(self):
        strategy = HeterogeneousStrategy(device_map=["cpu", "cpu"], start_method="spawn")
        _trainer(strategy)
        clone = pickle.loads(pickle.dumps(strategy))
        assert clone.device_plan == strategy.device_plan
        assert clone.accelerator.device_map == ["cpu", "cpu"]

    def test_pytorch_lightning_flavour(self):
        pytorch_lightning = pytest.importorskip("pytorch_lightning")
        from lightning_het._pl_compat import HeterogeneousStrategy as PLHeterogeneousStrategy

        strategy = PLHeterogeneousStrategy(device_map=["cpu", "cpu"])
        assert isinstance(strategy.accelerator, pytorch_lightning.accelerators.Accelerator)
        assert trainer_flavour(PLHeterogeneousStrategy).MixedAccelerator is type(strategy.accelerator)
        assert type(pickle.loads(pickle.dumps(strategy.accelerator))) is type(strategy.accelerator)
        trainer = pytorch_lightning.Trainer(strategy=strategy, logger=False, enable_progress_bar=False)
        assert trainer.strategy.parallel_devices == [CPU, CPU]


class TestEarlyErrors:
    """Every impossible combination fails at Trainer construction, before any worker starts."""

    @pytest.mark.parametrize(
        ("gpus", "kwargs", "trainer_kwargs", "match"),
        [
            (2, {"device_map": ["cuda:0", "cpu"], "process_group_backend": "nccl"}, {}, r"mixes CPU and CUDA"),
            (0, {"device_map": ["cpu", "cpu"], "process_group_backend": "nccl"}, {}, r"NCCL only communicates CUDA"),
            (2, {"device_map": ["cuda:0", "cuda:1", "cuda:2"]}, {}, r"`device_map\[2\]`='cuda:2'.*only 2 CUDA"),
            (1, {"device_map": ["cuda", "cuda"]}, {}, r"`device_map\[1\]`='cuda' \(-> cuda:1\).*only 1 CUDA"),
            (0, {"device_map": ["cuda:0", "cpu"]}, {}, r"no CUDA device is visible"),
            (0, {"device_map": ["cpu"] * 3}, {"devices": 2}, r"3 entries.*runs 2 replicas.*`devices` at 'auto'"),
            (0, {"device_map": ["cpu"], "speeds": [1, 2]}, {}, r"`speeds` with 2 entries.*1 replicas"),
            pytest.param(
                *(0, {"device_map": ["cpu", "cpu"]}, {"precision": "16-mixed"}, r"'16-mixed'.*CPU replicas"),
                marks=pytest.mark.filterwarnings("ignore:.*GradScaler is enabled, but CUDA is not available"),
            ),
            (2, {"device_map": {0: ["cuda:0"], 1: ["cuda:1"]}}, {}, r"node ranks \[0, 1\], but the job has 1 node"),
        ],
    )
    def test_at_trainer_construction(self, fake_gpus, gpus, kwargs, trainer_kwargs, match):
        fake_gpus(gpus)
        strategy = HeterogeneousStrategy(**kwargs)
        with pytest.raises(ValueError, match=match):
            _trainer(strategy, **trainer_kwargs)

    @pytest.mark.parametrize(
        ("kwargs", "match"),
        [
            ({"device_map": ["cpu", "tpu"]}, r"`device_map\[1\]`.*'tpu'"),
            ({"device_map": ["cuda:0", "cuda:0"]}, r"cuda:0 twice"),
            ({"device_map": ["cpu"], "accelerator": "cpu"}, r"both `device_map` and `accelerator`"),
            ({"cpu_threads": 2}, r"`cpu_threads`=2 without a `device_map`"),
            ({"device_map": {0: ["cpu"], 1: ["cpu", "cpu"]}}, r"different numbers of replicas per node"),
        ],
    )
    def test_at_strategy_construction(self, kwargs, match):
        with pytest.raises(ValueError, match=match):
            HeterogeneousStrategy(**kwargs)

    def test_explicit_accelerator_flag_conflicts_with_the_map(self):
        # Lightning's own check: the strategy carries the accelerator, so `accelerator=` must stay "auto"
        with pytest.raises(MisconfigurationException, match="accelerator set through both strategy class"):
            _trainer(HeterogeneousStrategy(device_map=["cpu"]), accelerator="cpu")

    def test_mixed_accelerator_needs_the_heterogeneous_strategy(self):
        trainer = _trainer("ddp", accelerator=MixedAccelerator(["cpu", "cpu"]))
        with pytest.raises(TypeError, match="MixedAccelerator places replicas through HeterogeneousStrategy"):
            trainer.accelerator.setup(trainer)


# --------------------------------------------------------------------------- real CPU replicas under a map
def test_cpu_replicas_under_a_map_exact_with_their_own_threads(tiny_job):
    """Two CPU replicas placed by a device map, 2 and 1 intra-op threads, profiled split: weights match one process."""
    cfg = {
        "devices": 2,
        "accelerator": "auto",
        "strategy": {"device_map": ["cpu", "cpu"], "cpu_threads": [2, 1], "profile_steps": 2, "profile_warmup": 1},
        "epochs": 2,
        "n": 64,
        "batch_size": 8,
    }
    dumps, out = tiny_job(cfg, timeout=300)  # ~25 s on an idle 2-core host
    sizes = dumps[0]["batch_sizes"]
    assert sum(sizes) == 16 and all(b >= 1 for b in sizes)
    assert [d["num_threads"] for d in dumps] == [2, 1]
    assert [d["root_device"] for d in dumps] == ["cpu", "cpu"]
    assert [d["backend"] for d in dumps] == ["gloo", "gloo"]
    # 64 // 16 = 4 steps x 2 epochs: the first 7 profile (trial splits), the last runs the fitted split
    assert [len(d["seen_batch_sizes"]) for d in dumps] == [8, 8]
    assert [d["seen_batch_sizes"][7:] for d in dumps] == [[sizes[0]], [sizes[1]]]
    reference = reference_weights(make_dataset(64), 16, epochs=2, seed=0)
    for dump in dumps:
        assert max((dump["state_dict"][k] - reference[k]).abs().max().item() for k in reference) < 1e-5
    assert "samples/s" in out and "cpu" in out
