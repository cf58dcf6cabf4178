"""The usage examples of the balance modules (doctests), moved out of their docstrings."""

# ruff: noqa: F403
import torch  # noqa: F401

from lightning_het.allocation import *
from lightning_het.balance.cost import *
from lightning_het.balance.memory import *
from lightning_het.balance.policy import *
from lightning_het.balance.profiler import *
from lightning_het.balance.rebalance import *
from lightning_het.emulation import *


def test_cost_costs_from_speeds() -> None:
    """
    >>> costs_from_speeds([2.0, 4.0])  # doctest: +NORMALIZE_WHITESPACE
    [AffineCost(fixed_s=0.0, per_sample_s=0.5, micro_batch=None),
     AffineCost(fixed_s=0.0, per_sample_s=0.25, micro_batch=None)]
    """


def test_cost_slope_through_origin() -> None:
    """
    >>> slope_through_origin([4, 8], [0.04, 0.08])
    0.01
    """


def test_cost_fit_affine() -> None:
    """
    >>> fit_affine([4, 8], [0.05, 0.07])
    AffineCost(fixed_s=0.03, per_sample_s=0.005, micro_batch=None)
    """


def test_rebalance_refreshed_costs() -> None:
    """
    >>> plan_rebalance([10, 5], [0.06, 0.05], fixed_costs=[0.04, 0.0]).costs  # doctest: +NORMALIZE_WHITESPACE
    [{'fixed_s': 0.04, 'per_sample_s': 0.002}, {'fixed_s': 0.0, 'per_sample_s': 0.01}]
    """


def test_cost_step_time() -> None:
    """
    >>> step_time([2, 4], [AffineCost(0.5, 0.25), AffineCost(0.0, 0.25)])
    1.0
    """


def test_cost_allocate_affine() -> None:
    """
    >>> allocate_affine(48, [AffineCost(0.040, 0.0005), AffineCost(0.002, 0.006)])
    [39, 9]
    >>> allocate_affine(14, costs_from_speeds([1, 2, 4]))
    [2, 4, 8]
    >>> allocate_affine(48, [AffineCost(0.004, 0.001, micro_batch=8), AffineCost(0.0, 0.004)])
    [35, 13]
    """


def test_cost_useless_replica_message() -> None:
    """
    >>> costs = [AffineCost(0.0, 0.001), AffineCost(0.100, 0.001)]
    >>> useless_replica_message(48, costs, [24, 24], ["cpu", "cuda:0"])[:59]
    'HeterogeneousStrategy: rank 1 (cuda:0) only slow(s) the job'
    """


def test_memory_EmulatedMemoryCap() -> None:
    """
    >>> emulation, net = EmulatedMemoryCap(0, 4), torch.nn.Sequential(torch.nn.Linear(2, 1))
    >>> emulation.install(net)
    >>> net(torch.zeros(5, 2))
    Traceback (most recent call last):
    torch.OutOfMemoryError: emulated: rank 0 cannot hold 5 samples (emulate_memory_cap 4)
    >>> with torch.no_grad():
    ...     net(torch.zeros(5, 2)).shape
    torch.Size([5, 1])
    >>> emulation.install(None)
    """


def test_memory_cap_search() -> None:
    """
    >>> cap_search(lambda n: n <= 8, 24, 48), cap_search(lambda n: n <= 64, 24, 48)
    ((8, 6), (48, 2))
    >>> cap_search(lambda n: n <= 4, 10, 48, lowest=3), cap_search(lambda n: n <= 2, 10, 48, lowest=3)
    ((4, 4), (0, 3))
    """


def test_policy_measured_speeds() -> None:
    """
    >>> BalancePolicy(HeterogeneousConfig()).measured_speeds([AffineCost(0.0, 0.01), AffineCost(0.0, 0.0125)], [4, 4])
    [90.0, 90.0]
    """


def test_profiler_trial_splits() -> None:
    """
    >>> trial_splits([24, 24])
    ([12, 36], [36, 12])
    >>> trial_splits([16, 16, 16])
    ([8, 32, 8], [20, 8, 20])
    >>> trial_splits([7, 14, 27])
    ([12, 23, 13], [3, 7, 38])
    """


def test_profiler_profile_plan() -> None:
    """
    >>> plan = ProfilePlan(48, 2, warmup=1, steps=2, lag=1)
    >>> [plan.split(n, [36, 12]) for n in range(plan.switch_step)]
    [[24, 24], [24, 24], [36, 12], [42, 6], [36, 12], [42, 6], [36, 12]]
    >>> plan.rough_step, plan.first_trial, plan.gather_step, plan.switch_step
    (0, 2, 5, 7)
    """


def test_profiler_loader_prefetch_depth() -> None:
    """
    >>> loader_prefetch_depth(torch.utils.data.DataLoader(range(8), num_workers=2), loop_prefetch=0)
    4
    """


def test_profiler_stage_ratios() -> None:
    """
    >>> stage_ratios([[0.010, 0.012], [0.020], [0.031, 0.030]])
    [1.2, 1.0333333333333334]
    """


def test_rebalance_profiled_split() -> None:
    """
    >>> profiled_split(256, [AffineCost(0.0056, 3e-6), AffineCost(0.0032, 2e-5)])  # equally fast within noise
    [128, 128]
    >>> from lightning_het.balance.cost import costs_from_speeds
    >>> profiled_split(48, costs_from_speeds([1, 3]))
    [12, 36]
    """


def test_rebalance_monotone_split() -> None:
    """
    >>> monotone_split([10, 30], costs_from_speeds([2, 1]), [40, 40])
    [30, 10]
    """


def test_rebalance_speeds_and_imbalance() -> None:
    """
    >>> d = plan_rebalance([8, 4, 4], [0.1, 0.1, 0.05])
    >>> d.speeds, d.imbalance
    ([80.0, 40.0, 80.0], 2.0)
    """


def test_rebalance_plan_rebalance() -> None:
    """
    >>> d = plan_rebalance([8, 8], [0.1, 0.3])
    >>> d.adopt, d.batch_sizes, round(d.gain, 12)
    (True, [12, 4], 0.5)
    >>> plan_rebalance([12, 4], [0.101, 0.099]).adopt
    False
    """


def test_monitor_check() -> None:
    """
    >>> from types import SimpleNamespace
    >>> from lightning_het import Profiling
    >>> from lightning_het.balance.monitor import BalanceMonitor
    >>> policy = BalanceMonitor(SimpleNamespace(world_size=2, root_device=torch.device("cpu")), Profiling())
    >>> policy.check([8, 8], [0.1, 0.3], steps_per_check=50).batch_sizes
    [12, 4]
    >>> policy.check([12, 4], [0.14, 0.1], steps_per_check=50).adopt  # rank 0 slower by a third: not confirmed yet
    False
    """


def test_allocation_proportional_shares() -> None:
    """
    >>> proportional_shares(12, [1, 2, 3], [0, 0, 0], [12, 12, 12])
    [2.0, 4.0, 6.0]
    """


def test_allocation_allocate_batch_sizes() -> None:
    """
    >>> allocate_batch_sizes(12, [1, 2, 3])
    [2, 4, 6]
    >>> allocate_batch_sizes(10, [1, 1, 1])
    [4, 3, 3]
    >>> allocate_batch_sizes(12, [1, 1, 10], max_batch_sizes=[12, 12, 6])
    [3, 3, 6]
    """


def test_allocation_loss_scale() -> None:
    """
    >>> loss_scale([2, 4, 6], 2)
    1.5
    """


def test_emulation_EmulatedPlatform() -> None:
    """
    >>> EmulatedPlatform(slowdown=[1, 4])
    EmulatedPlatform(slowdown=[1.0, 4.0], memory_cap=None)
    >>> EmulatedPlatform(slowdown=[0.5])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    lightning_het.arguments.ArgumentError: Expected argument `slowdown` to hold factors >= 1 ...
    """
