"""Lightning's launchers wrapped (replicas end together, no orphans, exit statuses) and preemption (checkpoint, 143)."""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_het._compat import batch_hooks, should_accumulate
from lightning_het._flavour import trainer_flavour
from lightning_het.cluster.rendezvous import (
    TOKEN_ENV,
    ensure_job_token,
    keep_sockets_local,
    restore_job_environment,
    save_job_environment,
)
from lightning_het.config import DEFAULT_GRACE
from lightning_het.reliability.output_dir import check_output_dir
from lightning_het.reliability.watchdog import (
    INTERRUPTED_EXIT_CODE,
    JobEnded,
    as_seconds,
    check_children,
    die_with_parent,
    end_children,
    exit_job,
    is_collective_failure,
)


class ExitCleanup:
    """At exit: destroy the default process group after a clean run; end with :attr:`exit_code` if one is set."""

    clean = True
    exit_code: int | None = None  # a preempted replica's 143: ends the process once the later exit handlers ran

    @classmethod
    @functools.cache
    def register(cls) -> None:  # once per process
        atexit.register(cls.run)

    @classmethod
    def run(cls) -> None:
        if cls.clean and dist.is_available() and dist.is_initialized():
            with contextlib.suppress(Exception):  # never turn a finished run into a failure at exit
                dist.destroy_process_group()
            # a Gloo worker thread may still hold the last collective's tensors; it needs the GIL to free them, and a
            # thread that asks for it once finalisation has begun is ended by a forced unwind that aborts the process
            time.sleep(0.1)
        if cls.exit_code is not None:  # no interpreter finalisation (backend threads): the status stays
            logging.shutdown()
            exit_job(cls.exit_code)


def validate_launch_environment(num_nodes: int, cluster: Any, environ: Mapping[str, str] = os.environ) -> None:
    """Refuse multi-node launches that would wait forever for a rendezvous that cannot happen."""
    if num_nodes <= 1 or type(cluster).__name__ != "LightningEnvironment" or cluster.creates_processes_externally:
        return  # one node, or an environment (SLURM, torchrun, ...) that says where the nodes meet
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK") if not environ.get(name)]
    if missing:
        raise ValueError(
            f"You set num_nodes={num_nodes}, but the environment variable(s) {', '.join(missing)} are not set:"
            " the nodes cannot find each other."
            " HINT: export MASTER_ADDR, MASTER_PORT and NODE_RANK on every node, or launch through SLURM / torchrun."
        )


def share_cpu_threads(num_processes: int) -> None:
    """Without ``OMP_NUM_THREADS``, give each of the node's replicas an equal share of this process's CPUs."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = max(1, cpus // max(1, num_processes))
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)


class SpawnLauncher:
    """Lightning's spawn/fork launcher, wrapped: the rendezvous checked at launch, the allocation sent back."""

    def __init__(self, strategy: Any, launcher: Any) -> None:
        self.strategy, self.launcher = strategy, launcher

    def __getattr__(self, name: str) -> Any:  # the wrapped launcher's other attributes, as Lightning reads them
        if name == "launcher":
            raise AttributeError(name)
        return getattr(self.launcher, name)

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        validate_launch_environment(self.strategy.num_nodes, self.strategy.cluster_environment)
        run = functools.partial(_with_allocation, function, self.strategy)
        result, allocation = self.launcher.launch(run, *args, trainer=trainer, **kwargs)
        if allocation:
            self.strategy.import_allocation(allocation)
        return result


def _with_allocation(function: Callable, strategy: Any, *args: Any, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
    """In a spawned worker: ``function``'s result and the strategy's allocation."""
    return function(*args, **kwargs), strategy.export_allocation()


class ScriptLauncher:
    """Lightning's ``popen`` launcher, wrapped: no orphan replicas, the end-of-run barrier, exit statuses 124/130."""

    is_interactive_compatible = False
    finishes_runs = True  # the strategy leaves the end-of-run barrier to this launcher

    def __init__(self, strategy: Any, launcher: Any) -> None:
        self.strategy, self.cluster_environment = strategy, launcher.cluster_environment
        self.num_processes, self.num_nodes = launcher.num_processes, launcher.num_nodes
        self.procs: list[subprocess.Popen] = []
        self._failed = self._in_run = False  # _failed: a run of this process ended with an exception
        self._token: str | None = None  # the job token the replicas this process launched were given
        self._observer_stop, self._wrapped = threading.Event(), type(launcher)

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # Lightning's, to `isinstance`: its Ctrl-C path then calls `kill`
        return self._wrapped

    def __deepcopy__(self, memo: dict[int, Any]) -> ScriptLauncher:
        return self  # shared: this process's replicas and observer thread

    def kill(self, signum: int) -> None:
        """Send ``signum`` to the replicas this process started (Lightning's launcher interface)."""
        for proc in [proc for proc in self.procs if proc.poll() is None]:
            proc.send_signal(signum)

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        validate_launch_environment(self.num_nodes, self.cluster_environment)
        fabric = trainer is None and not hasattr(self.strategy, "guards")
        environment = None if fabric else save_job_environment()  # put back when this Trainer call ends
        try:
            if not self.cluster_environment.creates_processes_externally:
                if trainer is not None and self.cluster_environment.global_rank() == 0:
                    check_output_dir(trainer.default_root_dir)  # before any replica starts
                self._token = ensure_job_token()
                keep_sockets_local(self.num_nodes)
                self._start_children()
            elif self._token is not None:  # a later Trainer call with the replicas launched by the first one
                os.environ[TOKEN_ENV] = self._token
                keep_sockets_local(self.num_nodes)
            share_cpu_threads(self.num_processes)
            self._in_run = True  # Fabric: your loop runs after this call, watched until the process ends
            if self.procs:
                self._observer_stop = threading.Event()
                threading.Thread(target=self._observe, name="lightning-het-replica-observer", daemon=True).start()
            try:
                result = function(*args, **kwargs)
            except BaseException as exc:
                self._in_run, self._failed = False, True
                code = None if isinstance(exc, JobEnded) else self._exit_code(exc)
                if code is not None:
                    raise JobEnded(code) from exc
                raise
            if not fabric:
                self._in_run = False
                self.strategy.guards.stop_watchdog(trainer, finished=True)  # wait for every replica
            return result
        finally:
            if not fabric:
                self._observer_stop.set()
                restore_job_environment(environment)

    def _start_children(self) -> None:
        """Lightning's child start, with ``PR_SET_PDEATHSIG`` (Linux) and an exit handler that reaps them."""
        env = self.cluster_environment
        if env.local_rank() != 0:  # Lightning's message: the cluster environment should create these processes
            raise RuntimeError(
                "Lightning attempted to launch new distributed processes with `local_rank > 0`. This should not happen:"
                " the cluster environment says it does not create the processes (`creates_processes_externally`)."
            )
        os.environ.update(MASTER_ADDR=env.main_address, MASTER_PORT=str(env.main_port), NODE_RANK=str(env.node_rank()))
        os.environ.update(LOCAL_RANK=str(env.local_rank()), WORLD_SIZE=f"{self.num_processes * self.num_nodes}")
        for local_rank in range(1, self.num_processes):
            command, cwd = child_command(local_rank)
            env_vars = {**os.environ, "LOCAL_RANK": f"{local_rank}"}
            self.procs.append(subprocess.Popen(command, env=env_vars, cwd=cwd, preexec_fn=die_with_parent))
        atexit.register(self._reap_children)
        previous = sys.excepthook

        def note_failure(*exc_info: Any) -> None:  # Fabric's loop runs outside the launcher: see an uncaught exception
            self._failed = True
            previous(*exc_info)

        sys.excepthook = note_failure

    def children(self) -> list[tuple[int, subprocess.Popen]]:
        """(global rank, process) of the replicas this process launched."""
        return list(enumerate(self.procs, start=self.cluster_environment.node_rank() * self.num_processes + 1))

    def _observe(self) -> None:
        """Until the watchdog runs: a local replica that fails ends the job."""
        stop = self._observer_stop
        while not stop.wait(0.5):
            if not self._in_run or self._failed or getattr(self.strategy, "watchdog", None) is not None:
                if all(proc.poll() is not None for proc in self.procs):
                    return
                continue
            verdict = check_children(self.children())
            if verdict is not None:
                rank, code = self.cluster_environment.global_rank(), verdict.exit_code
                message = f"{verdict.message} before the replicas could start their run. Ending the job"
                print(f"[rank {rank}] lightning_het: {message} (exit status {code}).", file=sys.stderr, flush=True)
                end_children(self.children())
                os._exit(code)

    def _reap_children(self) -> None:
        """Exit handler: give the replicas ``timeout`` + 30 s (10 s after a failed run), then kill them."""
        wait = (as_seconds(self.strategy.process_group_timeout) or 1800.0) + 30.0
        if killed := end_children(self.children(), 10.0 if self._failed else wait):
            message = f"lightning_het: replica(s) {killed} still ran when the launching process ended; killed them."
            print(message, file=sys.stderr, flush=True)
        for proc in self.procs:
            with contextlib.suppress(Exception):
                proc.wait(timeout=5)

    def _exit_code(self, exc: BaseException) -> int | None:
        """124/130 when ``exc`` only reflects how the job ended elsewhere (or Ctrl-C); ``None``: propagate ``exc``."""
        watchdog = getattr(self.strategy, "watchdog", None)
        verdict = watchdog.on_exception(exc) if watchdog is not None else None
        if isinstance(exc, KeyboardInterrupt):
            return verdict.exit_code if verdict is not None else INTERRUPTED_EXIT_CODE
        blamed_here = verdict is None or (verdict.kind == "failed" and watchdog.rank in verdict.culprits)
        return None if blamed_here or not is_collective_failure(exc) else verdict.exit_code


def child_command(local_rank: int) -> tuple[list[str], str | None]:
    """The command and directory (``None``: this one) of replica ``local_rank``, as Lightning's launcher runs it."""
    import __main__

    spec, hydra = getattr(__main__, "__spec__", None), sys.modules.get("hydra.core.hydra_config")
    if hydra is None or not hydra.HydraConfig.initialized():  # imported by a running Hydra app
        script = ["-m", spec.name] if spec is not None else [os.path.abspath(sys.argv[0])]
        return [sys.executable, *script, *sys.argv[1:]], None
    from hydra.utils import get_original_cwd, to_absolute_path

    script = ["-m", spec.name] if spec is not None else [to_absolute_path(sys.argv[0])]
    overrides = [f'hydra.run.dir="{hydra.HydraConfig.get().run.dir}"', f"hydra.job.name=train_ddp_process_{local_rank}"]
    return [sys.executable, *script, *sys.argv[1:], *overrides, "hydra.output_subdir=null"], get_original_cwd()


PREEMPTION_EXIT_CODE = 128 + signal.SIGTERM  # what a shell reports for a process ended by SIGTERM
# signals treated as a preemption notice (plus a SLURM environment's ``requeue_signal``)
AGREE_EVERY_S = 1.0  # seconds of training between the replicas' agreements on a signal (a small all-reduce each)
PREEMPTION_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGUSR1)


class PreemptedMixin:
    """Raised on every replica after the preemption checkpoint is written; ends the process with status 143."""

    def __init__(self, checkpoint: str | None, signals: Sequence[int]) -> None:
        super().__init__(PREEMPTION_EXIT_CODE)
        self.checkpoint, self.signals = checkpoint, list(signals)


class Preempted(PreemptedMixin, SIGTERMException):
    """Raised on every replica after the preemption checkpoint is written; ends the process with status 143."""


def _signal_name(signum: int) -> str:
    return next((s.name for s in signal.Signals if s == signum), f"signal {signum}")


class PreemptionHandler:
    """One replica's signal notice, deadline and step-boundary agreement; the Trainer's signal connector."""

    received_sigterm = False

    def __init__(
        self,
        grace: float = DEFAULT_GRACE,
        checkpoint: str | None = None,
        *,
        children: Callable[[], Sequence[Any]] = list,
        exit: Callable[[int], None] = exit_job,
    ) -> None:
        self.grace, self._children, self._exit = float(grace), children, exit
        self.checkpoint = checkpoint or None  # where to save (``None``: stop without saving)
        self.rank, self.world_size, self.fitting, self.extra_signals = 0, 1, True, ()
        # the signal this replica received (0: none): set by the pipe reader, and by the Python-level handler only
        self.received = self._handler_saw = 0
        self._previous: dict[int, Any] = {}  # the signal handlers taken over, and the wakeup fd
        self._previous_wakeup_fd, self._pipe, self._reader, self._deadline = -1, None, None, None  # fds, threads
        self.deadline_at: float | None = None  # when (``time.monotonic()``) the armed deadline ends this process
        self._lock = threading.Lock()
        # the replicas agreed to stop; the optimizer step of the next agreement; (step, time.monotonic()) of the last
        self.preempting, self.next_agreement, self._last_agreement = False, 0, None

    def __deepcopy__(self, memo: dict[int, Any]) -> PreemptionHandler:
        return self  # shared: this process's signal handlers and threads

    def __getstate__(self) -> dict[str, Any]:
        return {}  # a pickled Trainer: the live handler stays in its process

    def register_signal_handlers(self) -> None:
        """The signal connector's: take over the preemption signals (main thread only; a no-op elsewhere)."""
        if self._pipe is not None or threading.current_thread() is not threading.main_thread():
            return
        self._signals: tuple[int, ...] = tuple(dict.fromkeys(map(int, [*PREEMPTION_SIGNALS, *self.extra_signals])))
        self._pipe = read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        for signum in self._signals:
            self._previous[signum] = signal.getsignal(signum)
            signal.signal(signum, self._on_signal)
        self._previous_wakeup_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        self._reader = threading.Thread(target=self._read_pipe, args=(read_fd,), name="lightning-het-sigs", daemon=True)
        self._reader.start()

    def teardown(self) -> None:
        """The signal connector's: give the signals back (main thread); an armed deadline keeps running."""
        if self._pipe is None or threading.current_thread() is not threading.main_thread():
            return
        with contextlib.suppress(ValueError):
            signal.set_wakeup_fd(self._previous_wakeup_fd)
        for signum, handler in self._previous.items():
            with contextlib.suppress(TypeError, ValueError):
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()
        read_fd, write_fd = self._pipe
        with contextlib.suppress(OSError):
            os.write(write_fd, b"\0")  # wakes the reader, which then ends
        self._reader.join(timeout=1.0)  # type: ignore[union-attr]
        self._pipe = None
        for fd in (read_fd, write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)

    def close(self) -> None:
        """End of a run: give the signals back; if preempting, wait for the launched replicas, then kill them."""
        self.teardown()
        if self.preempting:  # (its deadline is armed)
            end_children(self._children(), max(self.deadline_at - time.monotonic() - 1.0, 0.0))  # type: ignore[operator]

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._handler_saw = signum  # main thread, between bytecodes: the pipe reader does the rest

    def _read_pipe(self, read_fd: int) -> None:  # the one writer of `received`
        with contextlib.suppress(OSError):
            while (data := os.read(read_fd, 64)) and 0 not in data:
                for signum in (s for s in data if s in self._signals and not self.received):
                    self.received = signum  # outside fit there is nothing to save: end now
                    self.arm_deadline(self.grace if self.fitting else 0.0, f"received {_signal_name(signum)}")

    def arm_deadline(self, seconds: float, reason: str) -> None:
        """End this process (status 143) ``seconds`` from now unless it ends first; the earliest deadline wins."""
        at = time.monotonic() + seconds
        with self._lock:
            if self.deadline_at is not None and self.deadline_at <= at:
                return
            self.deadline_at = at
            if self._deadline is None:  # else the running thread re-reads `deadline_at`
                name = "lightning-het-preemption-deadline"
                self._deadline = threading.Thread(target=self._await_deadline, args=(reason,), name=name, daemon=True)
                self._deadline.start()

    def _await_deadline(self, reason: str) -> None:
        while (left := self.deadline_at - time.monotonic()) > 0:  # type: ignore[operator]
            time.sleep(min(left, 0.2))
        late = f"and did not end within preemption_grace={self.grace:g} s" if self.fitting else "outside fit"
        message = f"this replica {reason} {late}; ending it now with exit status {PREEMPTION_EXIT_CODE}."
        print(f"[rank {self.rank}] lightning_het preemption: {message}", file=sys.stderr, flush=True)
        end_children(self._children())  # the launched replicas (exit_job: every descendant, on Linux)
        self._exit(PREEMPTION_EXIT_CODE)  # SIGKILLs the loader workers too (they ignore SIGTERM)

    def agree(self, device: torch.device, step: int = 0) -> list[int]:
        """Which replica received which signal (0: none), all-reduced if optimizer ``step`` is due, else all zeros."""
        local = [0] * (self.world_size + 1)
        local[self.rank] = int(self.received or self._handler_saw)
        if self.world_size < 2 or not (dist.is_available() and dist.is_initialized()):
            return local[:-1]
        if step < self.next_agreement:
            return [0] * self.world_size
        now, last = time.monotonic(), self._last_agreement
        local[-1] = -1
        if last is not None and step > last[0]:
            per_step = (now - last[1]) / (step - last[0])
            local[-1] = -min(max(int(AGREE_EVERY_S / max(per_step, 1e-6)), 1), 64)  # 1 to 64 steps
        flags = torch.tensor(local, dtype=torch.int32, device=device if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # the last entry: minus the fewest steps any replica asks for
        agreed = [int(v) for v in flags.tolist()]
        self.next_agreement, self._last_agreement = step - agreed[-1], (step, now)
        return agreed[:-1]

    def preempt(self, trainer: pl.Trainer, signals: Sequence[int]) -> PreemptedMixin:
        """Save the checkpoint (all ranks take part, rank 0 writes) and return the exception to raise."""
        self.preempting = True
        self.arm_deadline(self.grace, "was preempted")
        ExitCleanup.exit_code = PREEMPTION_EXIT_CODE  # once the exit handlers ran: no interpreter finalisation
        started, path, saved = time.monotonic(), self.checkpoint, None
        try:
            if path is not None:  # a local file: into ``path + ".tmp"`` (all ranks), then rank 0 renames it
                trainer.save_checkpoint(path if "://" in path else f"{path}.tmp")
                if trainer.is_global_zero and "://" not in path:
                    os.replace(f"{path}.tmp", path)
                saved = path
        finally:
            if self.rank == 0:
                who, names = [r for r, s in enumerate(signals) if s], sorted({_signal_name(s) for s in signals if s})
                done, resume = "saved no checkpoint (preemption_checkpoint=False)", ""
                if path is not None:
                    done = f"saved {saved}" if saved else "could NOT save a checkpoint"
                    resume = f" Resume with trainer.fit(..., ckpt_path={saved or path!r})."
                message = (
                    f"replica(s) {who} received {'/'.join(names)}; all {self.world_size} replica(s) stopped after"
                    f" global step {trainer.global_step} (epoch {trainer.current_epoch}); {done} in"
                    f" {time.monotonic() - started:.2f} s; exiting with status {PREEMPTION_EXIT_CODE}.{resume}"
                )
                print(f"lightning_het preemption: {message}", file=sys.stderr, flush=True)
        return trainer_flavour(trainer).Preempted(saved, signals)  # the trainer's package's SIGTERMException


def preemption_path(trainer: pl.Trainer, checkpoint: Any = None) -> str:
    """Where the preemption checkpoint goes for the strategy's ``preemption_checkpoint`` (``False``: where it would)."""
    if checkpoint is None or checkpoint is False:
        model_checkpoint = trainer_flavour(trainer).ModelCheckpoint  # the trainer's package's
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, model_checkpoint) and callback.dirpath:
                return os.path.join(callback.dirpath, callback.CHECKPOINT_NAME_LAST + callback.FILE_EXTENSION)
        return os.path.join(trainer.default_root_dir, "checkpoints", "last.ckpt")
    path = os.fspath(checkpoint)
    return os.path.join(path, "last.ckpt") if os.path.isdir(path) or path.endswith(("/", os.sep)) else path


@batch_hooks("on_train_batch_end")
class PreemptionCallbackMixin:
    """Runs the agreement after optimizer steps (mixed into each package's ``Callback``), between the strategy's
    ``before`` and ``after`` batch-end work: the one callback of ours Lightning dispatches at every batch."""

    def __init__(self, handler: PreemptionHandler, before: Callable | None = None, after: Callable | None = None):
        self.handler: PreemptionHandler | None = handler
        self.before, self.after = before, after

    def __getstate__(self) -> dict[str, Any]:  # pickled: the live handler and the strategy's parts stay in its process
        return {**self.__dict__, "handler": None, "before": None, "after": None}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.before is not None:
            self.before(trainer, batch_idx)
        handler = self.handler  # cheap test first: most steps are between agreements; accumulating: no place to stop
        if handler is not None and trainer.global_step >= handler.next_agreement and not should_accumulate(trainer):
            signals = handler.agree(pl_module.device, trainer.global_step)
            if any(signals):
                raise handler.preempt(trainer, signals)
        if self.after is not None:
            self.after(trainer, batch_idx)


class PreemptionCallback(PreemptionCallbackMixin, Callback):
    """Runs the agreement after optimizer steps; added to the Trainer by the strategy (after its callbacks)."""


def _shielded_init(inner: Callable[[int], Any] | None, rank: int, signals: Sequence[int], worker_id: int) -> None:
    """``worker_init_fn``: ignore the preemption signals, die with the replica, then run the original ``inner``."""
    die_with_parent()  # a worker stuck in __getitem__ never reaches torch's own parent check
    for signum in signals:
        signal.signal(signum, signal.SIG_IGN)  # the worker ends with its replica (torch watches the parent)
    with contextlib.suppress(ValueError):
        signal.set_wakeup_fd(-1)  # a forked worker inherits the replica's wakeup pipe
    if inner is not None:
        inner(worker_id)
    elif int(os.environ.get("PL_SEED_WORKERS", 0)):
        from lightning.fabric.utilities.seed import pl_worker_init_function

        pl_worker_init_function(worker_id, rank=rank)


def shield_loader_workers(dataloader: object, rank: int, signals: Sequence[int] = PREEMPTION_SIGNALS) -> object:
    """Make ``dataloader``'s workers ignore the preemption signals and die with their replica; return it."""
    if getattr(dataloader, "num_workers", 0) and hasattr(dataloader, "worker_init_fn"):
        current = dataloader.worker_init_fn
        if getattr(current, "func", None) is not _shielded_init:
            dataloader.worker_init_fn = functools.partial(_shielded_init, current, rank, tuple(int(s) for s in signals))
    return dataloader
