"""The step clock (compute vs gradient-sync wait) and the slowdown emulation factor."""

from __future__ import annotations

import time

import pytest
import torch

from lightning_het.balance import clock as clock_module
from lightning_het.balance.clock import StepClock, emulate_slower_device
from tests.helpers.tiny import burn


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward takes ``seconds``: slept, or computed (CPU time) with ``busy``."""

    @staticmethod
    def forward(ctx, x, seconds, busy):
        ctx.seconds, ctx.busy = seconds, busy
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        (burn if ctx.busy else time.sleep)(ctx.seconds)
        return grad, None, None


@pytest.fixture
def sleeping_counts_as_computing(monkeypatch):
    """The process CPU clock reads the wall clock: a step that sleeps is timed as one that computes throughout, so
    the emulation tests below are exact whatever the machine's load (a real computation would be stretched by it)."""
    monkeypatch.setattr(time, "process_time", time.perf_counter)


def _loss(backward_s: float, sync_s: float, busy: bool = False) -> torch.Tensor:
    """A loss whose backward computes for ``backward_s`` and then, like DDP, blocks ``sync_s`` in a final callback.

    DDP queues its end-of-backward callback (the one waiting for the all-reduce) when the last gradient is ready; the
    leaf hook below does the same, so it runs after the clock's callback, as in a real job.
    """
    w = torch.ones(3, requires_grad=True)

    def last_gradient_ready(grad):
        torch.autograd.Variable._execution_engine.queue_callback(lambda: time.sleep(sync_s))

    w.register_hook(last_gradient_ready)
    return _SlowBackward.apply(w, backward_s, busy).sum()


def _automatic_step(clock: StepClock, forward_s: float, backward_s: float, sync_s: float) -> None:
    clock.step_start(4)
    time.sleep(forward_s)
    loss = _loss(backward_s, sync_s)
    clock.forward_end()
    clock.before_backward(loss)
    loss.backward()
    clock.after_backward()


class TestStepClock:
    @pytest.mark.parametrize("factor", [1.0, 3.0])
    @pytest.mark.usefixtures("sleeping_counts_as_computing")
    def test_compute_wait_and_emulation_factor(self, factor):
        clock = StepClock(slowdown=factor)
        for _ in range(3):
            _automatic_step(clock, forward_s=0.03, backward_s=0.02, sync_s=0.03)
        t = clock.flush()
        assert len(t) == 3 and t.batch_sizes == [4, 4, 4]
        compute, wait = sorted(t.compute_s)[1], sorted(t.wait_s)[1]
        assert factor * 0.05 <= compute <= factor * 0.05 + 0.04  # the slowdown stretches forward and backward ...
        assert 0.03 <= wait <= 0.07  # ... but happens before the gradient synchronisation
        assert all(s >= c + w for s, c, w in zip(t.step_s, t.compute_s, t.wait_s))

    @pytest.mark.usefixtures("sleeping_counts_as_computing")
    def test_manual_optimisation_order(self):
        """``manual_backward`` inside ``training_step``: the forward sleep excludes the time spent in backward."""
        clock = StepClock(slowdown=2.0)
        clock.step_start(8)
        time.sleep(0.03)
        loss = _loss(0.02, 0.03)
        clock.before_backward(loss)
        loss.backward()
        clock.after_backward()
        clock.forward_end()  # training_step returns after its own backward
        t = clock.flush()
        assert 0.10 <= t.compute_s[0] <= 0.14
        assert 0.03 <= t.wait_s[0] <= 0.07

    @pytest.mark.usefixtures("sleeping_counts_as_computing")
    def test_flush_closes_step_and_record_false_still_emulates(self):
        clock = StepClock(slowdown=2.0, record=False)
        start = time.perf_counter()
        _automatic_step(clock, forward_s=0.02, backward_s=0.01, sync_s=0.0)
        assert time.perf_counter() - start >= 0.06
        assert len(clock.flush()) == 0
        recording = StepClock()
        _automatic_step(recording, 0.0, 0.0, 0.0)
        assert len(recording.flush()) == 1 and len(recording.flush()) == 0

    def test_retained_graph_does_not_fire_twice(self):
        clock = StepClock(slowdown=3.0)
        w = torch.ones(2, requires_grad=True)
        clock.step_start(2)
        loss = (w * 2).sum()
        clock.forward_end()
        clock.before_backward(loss)
        loss.backward(retain_graph=True)
        clock.after_backward()
        start = time.perf_counter()
        loss.backward()  # not through the strategy: no hook may fire
        assert time.perf_counter() - start < 0.05

    def test_time_off_the_cpu_is_not_stretched(self):
        """A replica descheduled on shared cores (here: sleeping inside its step) is not slowed down ``f``-fold for
        it: only the CPU work is stretched, so scheduling noise is not amplified into imbalance."""
        clock = StepClock(slowdown=4.0)
        for _ in range(3):
            clock.step_start(4)
            time.sleep(0.04)  # off the CPU
            burn(0.01)
            loss = _loss(0.01, 0.0, busy=True)
            clock.forward_end()
            clock.before_backward(loss)
            loss.backward()
            clock.after_backward()
        compute = sorted(clock.flush().compute_s)[1]
        assert 0.04 + 4 * 0.02 <= compute <= 0.04 + 4 * 0.02 + 0.07  # the wall-time rule would give >= 0.24

    def test_invalid_slowdown(self):
        from lightning_het import EmulatedPlatform, HeterogeneousStrategy

        with pytest.raises(ValueError, match="`slowdown`"):  # checked where it is given: the clock trusts it
            EmulatedPlatform(slowdown=[0.5])
        with pytest.raises(ValueError, match="`emulate_slowdown`"):
            HeterogeneousStrategy(emulate_slowdown=[1.0, 0.5])


class TestEmulateSlowerDevice:
    @pytest.mark.parametrize(
        ("wall", "cpu", "expected"),
        [
            (0.010, None, 0.030),  # an accelerator: the synchronised wall time is the work
            (0.010, 0.004, 0.012),  # descheduled for 6 ms on shared cores: only the 4 ms of CPU work are stretched
            (0.010, 0.035, 0.030),  # intra-op threads: CPU time above wall time, the wall time counts
            (0.0, 0.0, 0.0),
        ],
    )
    def test_delay_is_f_minus_one_times_the_work(self, monkeypatch, wall, cpu, expected):
        slept: list[float] = []
        monkeypatch.setattr(clock_module.time, "sleep", slept.append)
        assert emulate_slower_device(4.0, wall, cpu) == pytest.approx(expected)
        assert slept == ([pytest.approx(expected)] if expected else [])

    def test_factor_one_never_sleeps(self, monkeypatch):
        monkeypatch.setattr(clock_module.time, "sleep", lambda s: pytest.fail(f"slept {s}"))
        assert emulate_slower_device(1.0, 0.5, 0.5) == 0.0


class _FakeDevice:
    """A device whose one stream runs queued work only when told (:meth:`run`), as a GPU runs behind the host."""

    def __init__(self) -> None:
        self.queued = 0.0  # seconds of work queued so far (the stream's end)
        self.ran = 0.0  # seconds of it the device has run
        self.event_waits = 0

    def queue(self, seconds: float) -> None:
        self.queued += seconds

    def run(self, until: float | None = None) -> None:
        self.ran = self.queued if until is None else min(until, self.queued)


class _FakeEvent:
    """``torch.cuda.Event(enable_timing=True)`` on :class:`_FakeDevice`: records the stream's end; complete once run."""

    def __init__(self, device: _FakeDevice) -> None:
        self.device, self.at = device, None

    def record(self) -> None:
        self.at = self.device.queued

    def query(self) -> bool:
        return self.device.ran >= self.at

    def synchronize(self) -> None:
        self.device.event_waits += 1
        self.device.run(max(self.device.ran, self.at))

    def elapsed_time(self, end: _FakeEvent) -> float:
        assert self.query() and end.query(), "elapsed_time of an event the device has not reached"
        return (end.at - self.at) * 1e3


class _QueuedBackward(torch.autograd.Function):
    """Identity whose backward queues ``seconds`` of kernels on the fake device (the host does not wait)."""

    @staticmethod
    def forward(ctx, x, device, seconds):
        ctx.device, ctx.seconds = device, seconds
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.device.queue(ctx.seconds)
        return grad, None, None


def _device_step(clock: StepClock, device: _FakeDevice, forward_s: float, backward_s: float, allreduce_s: float):
    """One step as on a GPU with NCCL: kernels queued, not waited for; DDP's end-of-backward callback (queued after
    the clock's) makes the compute stream wait for the bucket all-reduces, which wait for the slowest replica."""
    clock.step_start(4)
    device.queue(forward_s)
    w = torch.ones(3, requires_grad=True)
    w.register_hook(
        lambda grad: torch.autograd.Variable._execution_engine.queue_callback(lambda: device.queue(allreduce_s))
    )
    loss = _QueuedBackward.apply(w, device, backward_s).sum()
    clock.forward_end()
    clock.before_backward(loss)
    loss.backward()
    clock.after_backward()


class TestCudaEvents:
    """The GPU step clock, on a fake device: durations from events, read a step late, no synchronisation per step."""

    @pytest.fixture
    def no_synchronize(self, monkeypatch):
        calls: list[object] = []
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: calls.append(a))
        return calls

    def test_compute_excludes_the_allreduce_and_is_read_one_step_late(self, no_synchronize):
        device = _FakeDevice()
        clock = StepClock(events=lambda: _FakeEvent(device))
        for _ in range(4):
            _device_step(clock, device, forward_s=0.03, backward_s=0.02, allreduce_s=0.05)
            device.run(until=device.queued - 0.01)  # the device runs behind the host: the step's tail is pending
            assert device.event_waits == 0
        t = clock.flush()  # the epoch's gather: one wait for the last events
        assert device.event_waits == 1 and no_synchronize == []
        assert len(t) == 4 and t.batch_sizes == [4] * 4
        assert t.compute_s == pytest.approx([0.05] * 4)  # forward + local backward; the all-reduce wait left out
        assert t.wait_s == pytest.approx([0.05] * 4)
        assert t.step_s == pytest.approx([0.10] * 4)

    def test_a_gpu_replica_never_synchronises_per_step(self, monkeypatch, no_synchronize):
        """The clock of a replica on ``cuda``, as the strategy builds it (events faked: no GPU here)."""
        device = _FakeDevice()
        monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing=False: _FakeEvent(device))
        clock = StepClock(device=torch.device("cuda", 0))
        for _ in range(5):
            _device_step(clock, device, 0.02, 0.02, 0.01)
            device.run()
        assert no_synchronize == []  # four device synchronisations per step before
        assert clock.flush().compute_s == pytest.approx([0.04] * 5)

    def test_steps_are_booked_once_the_device_has_run_them(self, no_synchronize):
        device = _FakeDevice()
        clock = StepClock(events=lambda: _FakeEvent(device))
        _device_step(clock, device, 0.03, 0.02, 0.0)
        _device_step(clock, device, 0.03, 0.02, 0.0)  # the device has run nothing yet: step 0 stays pending
        device.run()
        _device_step(clock, device, 0.03, 0.02, 0.0)  # steps 0 and 1 complete: booked at this step's start
        t = clock.flush()
        assert len(t) == 3 and t.compute_s == pytest.approx([0.05] * 3)
        assert device.event_waits == 1 and no_synchronize == []

    def test_open_step_is_read_at_the_agreement(self, no_synchronize):
        device = _FakeDevice()
        clock = StepClock(record=False, events=lambda: _FakeEvent(device))
        _device_step(clock, device, 0.01, 0.03, 0.02)
        batch, seconds = clock.open_step()
        assert batch == 4 and callable(seconds) and device.event_waits == 0  # nothing read at the step's end
        assert seconds() == pytest.approx(0.04) and device.event_waits == 1  # read when the profiler agrees

    def test_gpu_picks_events_and_emulation_the_host_clock(self, monkeypatch, no_synchronize):
        """Events on a GPU; under emulation, or on a CPU, the host clock (a GPU synchronised at each mark)."""
        monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing=False: pytest.fail("an event was made"))
        for device, slowdown, synchronises in [("cpu", 1.0, False), (None, 2.0, False), ("cuda", 2.0, True)]:
            clock = StepClock(slowdown=slowdown, device=None if device is None else torch.device(device))
            _automatic_step(clock, forward_s=0.0, backward_s=0.0, sync_s=0.0)
            assert len(clock.flush()) == 1 and bool(no_synchronize) == synchronises


def test_sampled_clock_times_every_nth_step_and_counts_all():
    """``every=4``: steps 1, 5, 9 are timed (each timed step closed by the next step's start), all 10 are counted;
    an untimed step gets no marks; the summary reports 10 steps and totals scaled from the timed ones."""
    from lightning_het.balance.monitor import epoch_summary

    clock = StepClock()
    clock.every = 4
    timed = []
    for _ in range(10):
        timed.append(clock.step_start(4))
        if timed[-1]:
            clock.forward_end()
        time.sleep(0.002)
    assert timed == [n % 4 == 0 for n in range(10)]
    t = clock.flush()
    assert t.index == [1, 5, 9] and t.steps == 10 and t.covered == 10 and len(t) == 3
    assert all(s >= 0.002 for s in t.step_s)  # each closed by the next step's start, not left open
    summary = epoch_summary([t])
    assert summary["steps"] == [10]
    assert summary["compute_total_s"][0] == pytest.approx(sum(t.compute_s) * 10 / 3)
    emulated = StepClock(slowdown=1.5)
    emulated.every = 4
    assert all(emulated.step_start(4) for _ in range(5))  # under emulation every step is stretched, so timed
