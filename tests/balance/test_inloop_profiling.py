"""Profiling on the real training steps: the schedule (pure), the lazy sampler, and Lightning's contract kept.

The multi-process fits (the harness's ``inloop`` job) train a module whose ``training_step(self, batch)`` has no
``batch_idx``, that needs state made in ``on_train_start``, counts its hooks and records every step's split and
synchronised gradient; they are compared with one process training on the same global batches.
"""

from __future__ import annotations

import random
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from lightning_het import HeterogeneousStrategy, ProportionalDistributedSampler, allocate_batch_sizes
from lightning_het.balance.cost import AffineCost, allocate_affine, slope_through_origin
from lightning_het.balance.profiler import (
    InLoopProfiler,
    ProfilePlan,
    beyond,
    loader_prefetch_depth,
    trial_splits,
)
from lightning_het.data.sampler import ProportionalBatchSampler
from tests.helpers.harness import run_harness, split_output
from tests.helpers.harness_steps import ContractModule
from tests.helpers.jobs import JobResult
from tests.helpers.tiny import make_dataset, make_net

# ---------------------------------------------------------------------------------------------------------- schedule


def test_trial_splits_cover_two_sizes_per_replica_within_bounds() -> None:
    rng = random.Random(0)
    for _ in range(400):
        world = rng.randint(2, 6)
        floor = rng.choice([1, 1, 2])
        upper = [rng.randint(floor + 1, 40) for _ in range(world)] if rng.random() < 0.3 else None
        total = rng.randint(world * floor, sum(upper) if upper else 200)
        speeds = [rng.uniform(0.2, 5.0) for _ in range(world)]
        around = allocate_batch_sizes(total, speeds, min_batch_size=floor, max_batch_sizes=upper)
        a, b = trial_splits(around, min_batch_size=floor, max_batch_sizes=upper)
        for split in (a, b):
            assert sum(split) == total and min(split) >= floor
            assert upper is None or all(s <= u for s, u in zip(split, upper))
        if upper is None and min(around) >= 2 * floor:  # room to give and to take: every replica sees two sizes
            assert all(x != y for x, y in zip(a, b)), (around, floor, a, b)
        # no replica more than doubles its share (+ 1): a trial step costs about 1.5x a balanced one, at most 2x
        assert all(max(x, y) <= 2 * r + 1 for x, y, r in zip(a, b, around))


def test_profile_plan_warms_up_agrees_on_rough_speeds_then_times_the_rough_split() -> None:
    plan = ProfilePlan(32, 2, warmup=1, steps=2, lag=3)
    assert (plan.rough_step, plan.first_trial, plan.gather_step, plan.switch_step) == (0, 4, 7, 11)
    rough, further = [24, 8], [28, 4]  # each share moved towards twice / half itself, the way it left the equal one
    assert beyond([16, 16], rough) == further and beyond([16, 16], [16, 16]) == [16, 16]
    assert beyond([16, 16, 16], [7, 14, 27]) == [3, 7, 38] and beyond([16, 16], [20, 12], max_batch_sizes=[22, 32]) == [
        22,
        10,
    ]
    assert [plan.split(n, rough) for n in range(4)] == [[16, 16]] * 4  # drawn before the rough speeds are known
    # every replica timed at three sizes: its equal share (the lag steps), its rough one and one beyond it, twice
    assert [plan.split(n, rough) for n in range(4, 8)] == [rough, further] * 2
    assert [plan.split(n, rough) for n in range(8, 11)] == [rough] * 3  # drawn before the costs are agreed
    no_warmup = ProfilePlan(32, 2, warmup=0, steps=1, lag=1)
    assert (no_warmup.first_trial, no_warmup.gather_step, no_warmup.switch_step) == (0, 1, 3)
    assert [no_warmup.split(n, None) for n in range(3)] == [[8, 24], [24, 8], [16, 16]]
    with pytest.raises(ValueError, match="world_size >= 2"):
        ProfilePlan(32, 1, warmup=1, steps=2, lag=1)


def test_prefetch_depth_of_a_loader() -> None:
    data = make_dataset(8)
    assert loader_prefetch_depth(DataLoader(data)) == 1
    assert loader_prefetch_depth(DataLoader(data, num_workers=2)) == 5
    assert loader_prefetch_depth(DataLoader(data, num_workers=2, prefetch_factor=3)) == 7


def _profiler(plan, gather=None) -> InLoopProfiler:
    return InLoopProfiler(plan, 0, gather, lambda: (8, 0.01), lambda costs, sizes: None)


def _rank_one_a_third(values):  # rank 1: the same fit, its warm-up step 3x faster
    return [list(values), [values[0] / 3] if len(values) == 1 else values]


def test_profiler_counts_trained_steps_across_epochs_and_refuses_a_step_drawn_too_early() -> None:
    gathered = []
    plan = ProfilePlan(32, 2, warmup=1, steps=2, lag=1)  # the rough split from step 2, switch at step 7
    profiler = _profiler(plan, lambda v: gathered.append(v) or [list(v), list(v)])
    resumed = ProportionalDistributedSampler(list(range(128)), [12, 20], 0)  # epochs of 4 global batches of 32
    resumed.resume(0, 2)  # a resumed epoch: the plan starts at its global batch 2
    profiler.bind(resumed)
    half = ProportionalDistributedSampler(list(range(64)), [8, 8], 0)  # another loader, global batch 16
    profiler.bind(half)
    half.set_epoch(1)
    assert resumed.step_batch_sizes(2) == [16, 16] and resumed.step_batch_sizes(3) == [16, 16]  # plan steps 0, 1
    profiler.on_train_batch_end(0, 2)  # the warm-up ends: the rough split is agreed (equal speeds here)
    assert gathered == [[16 / 0.01]] and profiler.rough == [16, 16]
    profiler.on_train_batch_end(0, 3)
    # the next epoch is drawn after the steps trained so far: its batch 0 is plan step 2, the first at the rough split
    assert [profiler.split_for(1, k) for k in range(4)] == [[16, 16]] * 4  # plan steps 2 .. 5
    # the other loader's splits are the plan's, scaled to its global batch
    assert [half.step_batch_sizes(k) for k in range(4)] == [allocate_batch_sizes(16, [16, 16])] * 4
    for k in range(4):
        profiler.on_train_batch_end(1, k)
    assert profiler.done and len(gathered) == 2
    other = ProportionalDistributedSampler(list(range(360)), [12, 20], 0)  # a second loader follows the same plan
    profiler.bind(other)
    other.set_epoch(2)
    assert other.step_batch_sizes(0) == [16, 16]  # plan step 6: drawn before the costs were agreed, the rough split
    assert other.step_batch_sizes(1) == [12, 20] and profiler.split_for(2, 1) is None  # the allocation from step 7


def _fit_one_replica(plan, seconds, rough_ratio: float = 3.0) -> InLoopProfiler:
    """Run ``plan`` on rank 0 of two identical replicas whose step ``n`` takes ``seconds(n, size)``; rank 1's warm-up
    step looks ``rough_ratio`` times faster (cold), its fitted cost is rank 0's."""

    def gather(values):
        return [list(values), [values[0] * rough_ratio]] if len(values) == 1 else [list(values), list(values)]

    steps, adopted, made = iter(range(plan.gather_step + 1)), [], []

    def clock() -> tuple[int, float]:
        n = next(steps)
        size = plan.split(n, made[0].rough)[0]
        return size, seconds(n, size)

    profiler = InLoopProfiler(plan, 0, gather, clock, lambda costs, sizes: adopted.append(sizes))
    made.append(profiler)
    sampler = ProportionalDistributedSampler(list(range(320)), [16, 16], 0)
    profiler.bind(sampler)
    for k in range(plan.gather_step + 1):
        sampler.step_batch_sizes(k)  # drawn, then trained
        profiler.on_train_batch_end(0, k)
    assert profiler.done and len(adopted) == 1
    profiler.adopted = adopted[0]
    return profiler


def test_a_cold_step_does_not_pull_the_fit_and_equal_replicas_keep_the_equal_split() -> None:
    true_cost = AffineCost(0.001, 0.0001)
    # the lag step after the warm-up (equal split) is a cold outlier; the warm-up step at the same size is not
    plan = ProfilePlan(32, 2, warmup=1, steps=2, lag=1)
    profiler = _fit_one_replica(plan, lambda n, b: 0.05 if n == 1 else true_cost(b))
    assert profiler.rough == [8, 24]
    assert profiler.adopted == [16, 16] and profiler.threshold == pytest.approx(1.1)
    fitted = profiler.costs[0]  # the line through the fastest step of each size: the true one
    assert fitted.fixed_s == pytest.approx(0.001) and fitted.per_sample_s == pytest.approx(1e-4)
    # no lag (a sized loader, your own loop): the cold warm-up step is the equal size's only timing, left out of the fit
    plan = ProfilePlan(32, 2, warmup=1, steps=2, lag=0)
    profiler = _fit_one_replica(plan, lambda n, b: 0.05 if n == 0 else true_cost(b), rough_ratio=1 / 3)
    fitted = profiler.costs[0]  # the rough and the further size (within 1.25x: the line through the origin)
    assert profiler.rough == [24, 8] and profiler.adopted == [16, 16]
    expected = slope_through_origin([24, 28], [true_cost(24), true_cost(28)])
    assert fitted.fixed_s == 0.0 and fitted.per_sample_s == pytest.approx(expected)
    # the smaller replica's sizes (8 and 4 after a cold 16) are far enough apart: the true line, without the warm-up
    profiler = _fit_one_replica(plan, lambda n, b: 0.05 if n == 0 else true_cost(b), rough_ratio=3)
    fitted = profiler.costs[0]
    assert (
        profiler.rough == [8, 24]
        and fitted.fixed_s == pytest.approx(0.001)
        and fitted.per_sample_s == pytest.approx(1e-4)
    )


def test_a_mild_warm_up_imbalance_keeps_the_trials_at_the_equal_split() -> None:
    plan = ProfilePlan(32, 2, warmup=1, steps=2, lag=1)
    cost = AffineCost(0.0, 0.001)
    assert _fit_one_replica(plan, lambda n, b: cost(b), rough_ratio=1.4).rough == [16, 16]
    assert _fit_one_replica(plan, lambda n, b: cost(b), rough_ratio=1.6).rough != [16, 16]


def test_the_fit_is_the_line_through_the_equal_and_the_rough_size() -> None:
    plan = ProfilePlan(32, 2, warmup=1, steps=2, lag=1)
    true_cost = AffineCost(0.001, 0.0001)
    steps = iter(range(plan.gather_step + 1))
    profiler = InLoopProfiler(
        plan, 0, _rank_one_a_third, lambda: (0, true_cost(plan.split(next(steps), [24, 8])[0])), lambda c, s: None
    )
    for k in range(plan.gather_step + 1):
        profiler.split_for(0, k)
        profiler.on_train_batch_end(0, k)
    assert profiler.costs[0].fixed_s == pytest.approx(0.001) and profiler.costs[0].per_sample_s == pytest.approx(1e-4)


def test_an_epoch_shorter_than_its_loader_leaves_no_plan_step_out() -> None:
    """``limit_train_batches``: epoch 0 trains 1 of its batches; epoch 1 starts at the next plan step."""
    profiler = _profiler(ProfilePlan(32, 2, warmup=0, steps=1, lag=1))  # trials at steps 0 and 1, switch at 3
    a, b = trial_splits([16, 16])
    assert profiler.split_for(0, 0) == a and profiler.split_for(0, 1) == b  # step 1 drawn, never trained
    profiler._clock = lambda: None
    profiler.on_train_batch_end(0, 0)
    assert profiler.split_for(1, 0) == b  # plan step 1
    with pytest.raises(RuntimeError, match="drew global batch 2 of epoch 1 before the profiling step"):
        profiler.split_for(1, 2)  # plan step 3, the switch: the costs are not agreed yet


# ---------------------------------------------------------------------------------------------------------- sampler


def test_lazy_batches_follow_the_schedule_and_stay_the_single_process_batches() -> None:
    data = list(range(45))  # 5 global batches of 8 and a tail of 5
    single = ProportionalDistributedSampler(data, [8], 0, seed=3)
    single.set_epoch(1)
    reference = list(single.iter_batches())
    schedule = {0: [2, 6], 1: [6, 2], 5: [4, 4]}  # step 5 is the tail: split like [4, 4]
    samplers = [ProportionalDistributedSampler(data, [1, 7], r, seed=3) for r in range(2)]
    iters = []
    for s in samplers:
        s.set_epoch(1)
        s.split_schedule = lambda epoch, step: schedule.get(step) if epoch == 1 else None
        iters.append(iter(ProportionalBatchSampler(s)))
    drawn = []
    for k in range(6):
        if k == 3:  # a new allocation for the batches not drawn yet
            for s in samplers:
                s.set_batch_sizes([3, 5])
        drawn.append([next(it) for it in iters])
    sizes = [[len(b) for b in step] for step in drawn]
    assert sizes == [[2, 6], [6, 2], [1, 7], [3, 5], [3, 5], [3, 2]]
    assert [s.step_batch_sizes(k) for k in (0, 3, 5) for s in samplers[:1]] == [[2, 6], [3, 5], [3, 2]]
    assert [step[0] + step[1] for step in drawn] == reference
    assert len(ProportionalBatchSampler(samplers[0])) == 6


# ---------------------------------------------------------------------------------------------------------- one replica


def test_one_replica_neither_profiles_nor_gathers(monkeypatch) -> None:
    calls = []
    real = dist.all_gather
    monkeypatch.setattr(dist, "all_gather", lambda *a, **k: calls.append(1) or real(*a, **k))
    pl.seed_everything(0)
    model = ContractModule()
    strategy = HeterogeneousStrategy(process_group_backend="gloo")
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(make_dataset(40), batch_size=8, shuffle=True))
    assert model.batch_sizes == [8] * 10 and model.problems == []
    assert model.counts["training_step"] == model.counts["on_before_backward"] == trainer.global_step == 10
    assert not strategy.profiling and strategy.cost_model is None and strategy.profile_seconds == 0.0
    assert calls == []  # no timing collective


# ---------------------------------------------------------------------------------------------------------- jobs


def reference_gradients(
    n: int, global_batch: int, epochs: int, seed: int = 0, limit: int | None = None
) -> list[torch.Tensor]:
    """Every step's gradient when one process trains on the whole global batches (same order, same optimizer;
    ``limit``: the first global batches of each epoch only)."""
    data = make_dataset(n)
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    sampler = ProportionalDistributedSampler(data, [global_batch], 0, shuffle=True, seed=seed)
    grads = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for k, (x, y) in enumerate(DataLoader(data, batch_size=global_batch, sampler=sampler)):
            if limit is not None and k >= limit:
                break
            opt.zero_grad()
            nn.functional.mse_loss(net(x), y).backward()
            grads.append(torch.cat([p.grad.flatten().clone() for p in net.parameters()]))
            opt.step()
    return grads


#: rank 1 emulates a 3x slower device; 10 global batches of 32 per epoch, 2 epochs
SLOW = {"strategy": {"emulate_slowdown": [1, 3]}, "cost_per_sample_s": 0.001}
INLOOP_FITS = {
    "automatic": SLOW,
    "manual": {**SLOW, "manual": True},
    # two networks, two optimizers, each backward reaching one network only
    "gan": {**SLOW, "manual": True, "gan": True, "strategy": {**SLOW["strategy"], "find_unused_parameters": True}},
    # 2 workers x prefetch 2: 4 batches drawn ahead, the fitted split from step 7
    "workers": {**SLOW, "loader": {"num_workers": 2}},
    # epochs of 4 of the loader's 10 batches: the plan continues across them, the fitted split from step 7
    "limited": {**SLOW, "limit_train_batches": 4, "epochs": 5},
}


#: after the in-loop fits, in the same job: a profiled fit saving a checkpoint at step 3 (inside the profiling steps),
#: and the fit resumed from it (``RESUME_FROM``: the checkpoint's path under the job's directory)
RESUME_FITS = [
    {"job": "resume", "devices": 2, "strategy": {}, "epochs": 2, "n": 80, "batch_size": 4, "save_every": 3},
    {"job": "resume", "devices": 2, "strategy": {}, "epochs": 2, "n": 80, "batch_size": 4, "save_every": 0},
]
FIRST = len(INLOOP_FITS)  # the index of the first resume fit in the job
RESUME_FROM = f"{FIRST}/ckpt/step=3.ckpt"


@pytest.fixture(scope="module")
def inloop_job(tmp_path_factory) -> tuple[Path, JobResult]:
    """:data:`INLOOP_FITS`, then :data:`RESUME_FITS`, in one job: its directory and its end."""
    out = tmp_path_factory.mktemp("inloop")
    first, resumed = RESUME_FITS
    cfgs = [*INLOOP_FITS.values(), first, {**resumed, "resume": str(out / RESUME_FROM)}]
    job = run_harness("inloop", out, cfgs, limit=300)
    assert job.returncode == 0, job.output[-6000:]
    assert not job.survivors
    return out, job


@pytest.fixture(scope="module")
def inloop_fits(inloop_job) -> dict[str, list[dict]]:
    out, _ = inloop_job
    return {name: [torch.load(out / str(i) / f"rank{r}.pt") for r in range(2)] for i, name in enumerate(INLOOP_FITS)}


@pytest.mark.parametrize("name", list(INLOOP_FITS))
def test_training_step_without_batch_idx_runs_once_per_step_with_its_state(inloop_fits, name: str) -> None:
    for dump in inloop_fits[name]:
        assert dump["problems"] == []
        twice = 40 if name == "gan" else 20  # the GAN's two backwards and two optimizer steps per batch
        assert dump["global_step"] == twice
        counts = dump["counts"]
        assert counts["training_step"] == counts["on_train_batch_end"] == 20
        assert counts["on_before_backward"] == counts["on_after_backward"] == twice


@pytest.mark.parametrize("name", list(INLOOP_FITS))
def test_rough_split_then_the_fitted_split_with_every_gradient_exact(inloop_fits, name: str) -> None:
    dumps = inloop_fits[name]
    sizes = dumps[0]["batch_sizes"]
    assert dumps[1]["batch_sizes"] == sizes and sum(sizes) == 32
    # rank 1 is 3x slower (its sleep stretched 3x): about a quarter of the batch, as the fitted costs say
    assert 5 <= sizes[1] <= 11, (sizes, dumps[0]["cost_model"], dumps[1]["cost_model"])
    assert sizes == allocate_affine(32, [AffineCost.from_dict(c) for c in dumps[0]["cost_model"]])  # the fitted optimum
    seen = [list(s) for s in zip(dumps[0]["batch_sizes_seen"], dumps[1]["batch_sizes_seen"])]
    lag = 4 if name == "workers" else 0  # a sized loader: Lightning draws nothing ahead (2 workers x 2 do)
    plan = ProfilePlan(32, 2, warmup=1, steps=2, lag=lag)
    trials = seen[plan.first_trial : plan.gather_step + 1]
    rough = seen[plan.first_trial]
    assert rough != [16, 16]
    assert seen[: plan.first_trial] == [[16, 16]] * plan.first_trial  # warm-up (and the batches drawn meanwhile)
    # the rough split (from the first step's timings) and one beyond it, each timed twice
    assert trials == [rough, beyond([16, 16], rough)] * 2
    assert seen[plan.gather_step + 1 : plan.switch_step] == [rough] * lag
    assert seen[plan.switch_step :] == [sizes] * (20 - plan.switch_step)  # step 7 without workers: in epoch 0
    cfg = INLOOP_FITS[name]
    reference = reference_gradients(320, 32, epochs=cfg.get("epochs", 2), limit=cfg.get("limit_train_batches"))
    for dump in dumps:
        assert len(dump["grads"]) == 20
        for step, (got, want) in enumerate(zip(dump["grads"], reference)):
            # float rounding only (relative 1e-7 on the first steps, drifting to ~1e-6 over 20 steps)
            assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (name, step)


def test_checkpoint_taken_while_profiling_resumes_and_profiles_again(inloop_job) -> None:
    """A checkpoint saved at step 3, inside the profiling steps, has no speeds yet: the resumed fit profiles again from
    its first step (global batch 3) and ends where the uninterrupted fit ends (the same global batches)."""
    out, job = inloop_job
    output = "".join(split_output(job.output, FIRST + 2)[FIRST:])  # what the two resume fits printed
    record = torch.load(out / RESUME_FROM, weights_only=True)["lightning_het"]
    assert record["speeds"] == [] and record["batch_sizes"] == [4, 4] and record["sampler"]["steps_done"] == 3
    assert "skips the 3 global batch(es) already trained on" in output
    assert output.count("profiling on the first 5 training steps") == 2
    full = [torch.load(out / str(FIRST) / f"rank{r}.pt") for r in range(2)]
    again = [torch.load(out / str(FIRST + 1) / f"rank{r}.pt") for r in range(2)]
    for rank in range(2):
        assert again[rank]["global_step"] == 20
        # global batch 3 of epoch 0: the warm-up again, from the resumed step, then pairs of the rough split and one
        # beyond it (both the equal split while the warm-up's speeds are within 1.5x)
        seen = again[rank]["seen_batch_sizes"]
        assert seen[0] == 4 and seen[1:5] == seen[1:3] * 2 and (seen[1] == seen[2]) == (seen[1] == 4)
        state = full[rank]["state_dict"]
        assert all(torch.allclose(again[rank]["state_dict"][k], state[k], atol=1e-5) for k in state)


def test_a_device_timers_steps_are_read_at_the_agreements_only() -> None:
    """On a GPU the clock hands each step's compute seconds as a function (reading them waits for the step's events):
    the profiler calls them at its two agreements, not at every step's end."""
    plan = ProfilePlan(32, 2, warmup=1, steps=2, lag=1)
    true_cost = AffineCost(0.001, 0.0001)
    reads: list[int] = []
    steps = iter(range(plan.gather_step + 1))

    def clock():
        n = next(steps)
        size = plan.split(n, [24, 8])[0]
        return size, lambda: reads.append(n) or true_cost(size)

    profiler = InLoopProfiler(plan, 0, _rank_one_a_third, clock, lambda costs, sizes: None)
    sampler = ProportionalDistributedSampler(list(range(320)), [16, 16], 0)
    profiler.bind(sampler)
    for k in range(plan.gather_step + 1):
        sampler.step_batch_sizes(k)
        profiler.on_train_batch_end(0, k)
        agreed = k in (plan.rough_step, plan.gather_step)
        assert len(reads) == (k + 1 if agreed else (plan.rough_step + 1 if k > plan.rough_step else 0)), (k, reads)
    assert sorted(reads) == list(range(plan.gather_step + 1))  # each step read once
    assert profiler.costs[0].per_sample_s == pytest.approx(1e-4)
