"""The job's lifecycle: launch, run to the end together, and leave no process behind, whatever happens."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

import torch
from typing_extensions import override

from lightning_het._compat import (
    _FabricSubprocessScriptLauncher,
    _SubprocessScriptLauncher,
)
from lightning_het._flavour import fabric_flavour, trainer_flavour
from lightning_het.cluster.rendezvous import (
    TOKEN_ENV,
    ensure_job_token,
    keep_sockets_local,
    restore_job_environment,
    save_job_environment,
)
from lightning_het.reliability.output_dir import check_output_dir
from lightning_het.reliability.processes import check_children, die_with_parent, kill_children
from lightning_het.reliability.supervision import as_seconds, validate_launch_environment
from lightning_het.reliability.verdicts import (
    INTERRUPTED_EXIT_CODE,
    WATCHDOG_EXIT_CODE,
    JobEnded,
    exit_code_for,
    interruption_of,
    is_collective_failure,
)

if TYPE_CHECKING:
    from lightning_het.reliability.watchdog import Watchdog

log = logging.getLogger(__name__)

#: seconds beyond the strategy's ``timeout`` that the launching process waits, at exit, for its replicas to end.
REAP_GRACE_S = 30.0
#: the same after a run that ended with an exception here (the replicas have the verdict, or never started their run).
FAILED_REAP_GRACE_S = 10.0


def share_cpu_threads(num_processes: int) -> None:
    """Without ``OMP_NUM_THREADS``, give torch in each of the node's ``num_processes`` replicas an equal share of the
    CPUs this process may run on (at least one) and record it in ``OMP_NUM_THREADS``, as Lightning's launchers do."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = max(1, cpus // max(1, num_processes))
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)


class TimedStrategy(Protocol):
    """What the launching process reads of its strategy when it exits: the collective timeout (seconds or
    ``timedelta``; ``None``: 30 minutes), which bounds its wait for the replicas it started."""

    @property
    def process_group_timeout(self) -> timedelta | float | None: ...


class LaunchingStrategy(TimedStrategy, Protocol):
    """What :class:`HeterogeneousScriptLauncher` reads of the Trainer strategy it launches for: Lightning's launcher
    arguments, and the watchdog that judges how a run ended."""

    @property
    def cluster_environment(self) -> Any: ...
    @property
    def num_processes(self) -> int: ...
    @property
    def num_nodes(self) -> int: ...
    @property
    def watchdog(self) -> Watchdog | None: ...
    def release_watchdog(self) -> Watchdog | None: ...


class _ReplicaProcesses:
    """The launching process's replicas: started with ``PR_SET_PDEATHSIG``, reaped or killed at exit."""

    #: the strategy this launcher launches for (set by the factories :meth:`HeterogeneousScriptLauncher.for_strategy`
    #: and :func:`fabric_script_launcher`)
    strategy: TimedStrategy
    _failed = False  # a run of this process ended with an exception
    procs: list[subprocess.Popen]
    cluster_environment: Any
    num_processes: int
    num_nodes: int

    def _call_children_scripts(self) -> None:
        """Lightning's child start with ``PR_SET_PDEATHSIG`` on Linux, and the exit handler that reaps them."""
        self._check_can_spawn_children()  # type: ignore[attr-defined]
        self.procs = []
        os.environ["MASTER_ADDR"] = self.cluster_environment.main_address
        os.environ["MASTER_PORT"] = str(self.cluster_environment.main_port)
        os.environ["NODE_RANK"] = str(self.cluster_environment.node_rank())
        os.environ["LOCAL_RANK"] = str(self.cluster_environment.local_rank())
        os.environ["WORLD_SIZE"] = f"{self.num_processes * self.num_nodes}"
        preexec = die_with_parent if sys.platform.startswith("linux") else None
        for local_rank in range(1, self.num_processes):
            env = os.environ.copy()
            env["LOCAL_RANK"] = f"{local_rank}"
            if os.environ.get("PL_GLOBAL_SEED") is None and "PL_GLOBAL_SEED" in env:
                del env["PL_GLOBAL_SEED"]
            command, cwd = child_command(local_rank)
            self.procs.append(subprocess.Popen(command, env=env, cwd=cwd, preexec_fn=preexec))
        atexit.register(self._reap_children)

    def _children(self) -> list[tuple[int, subprocess.Popen]]:
        first = self.cluster_environment.node_rank() * self.num_processes
        return [(first + local_rank, proc) for local_rank, proc in enumerate(self.procs, start=1)]

    def _reap_children(self) -> None:
        """Exit handler: give the replicas ``timeout`` + 30 s (10 s after a failed run), then kill them."""
        wait = (as_seconds(self.strategy.process_group_timeout) or 1800.0) + REAP_GRACE_S
        if self._failed:
            wait = min(wait, FAILED_REAP_GRACE_S)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(proc.poll() is None for proc in self.procs):
            time.sleep(0.1)
        if killed := kill_children(self._children()):
            message = f"lightning_het: replica(s) {killed} still ran when the launching process ended; killed them."
            print(message, file=sys.stderr, flush=True)
        for proc in self.procs:
            with contextlib.suppress(Exception):
                proc.wait(timeout=5)


class ScriptLauncherMixin(_ReplicaProcesses):
    """The lifecycle guarantees of this module, mixed into each Trainer package's ``popen`` launcher."""

    #: the strategy leaves the end-of-run barrier to this launcher (:meth:`_finish`)
    finishes_runs = True
    #: multi-node rendezvous variables are checked at launch (:meth:`launch`), not at Trainer construction
    validates_launch_environment = True
    _in_run = False
    _observer: threading.Thread | None = None
    _token: str | None = None  # the job token the replicas this process launched were given
    _observer_stop: threading.Event | None = None  # set to end the observer thread
    strategy: LaunchingStrategy

    @classmethod
    def for_strategy(cls, strategy: LaunchingStrategy) -> ScriptLauncherMixin:
        """The launcher for ``strategy``, on the ``_SubprocessScriptLauncher`` of the strategy's Lightning package."""
        launcher = trainer_flavour(strategy).ScriptLauncher(
            strategy.cluster_environment, strategy.num_processes, strategy.num_nodes
        )
        launcher.strategy = strategy
        return launcher

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        # multi-node rendezvous variables: checked here, when processes start, not at Trainer construction
        validate_launch_environment(self.num_nodes, self.cluster_environment)
        environment = save_job_environment()  # put back when this Trainer call ends (a later job starts clean)
        try:
            return self._launch(function, *args, trainer=trainer, **kwargs)
        finally:
            self._stop_observer()
            restore_job_environment(environment)

    def _launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        if not self.cluster_environment.creates_processes_externally:
            if trainer is not None and self.cluster_environment.global_rank() == 0:
                check_output_dir(trainer.default_root_dir)  # before any replica starts
            self._token = ensure_job_token()
            keep_sockets_local(self.num_nodes)
            self._call_children_scripts()
        elif self._token is not None:  # a later Trainer call with the replicas launched by the first one
            os.environ[TOKEN_ENV] = self._token
            keep_sockets_local(self.num_nodes)
        if self.procs:
            self._start_observer()
        share_cpu_threads(self.num_processes)
        self._in_run = True
        try:
            result = function(*args, **kwargs)
        except BaseException as exc:
            self._in_run = False
            self._failed = True
            code = self._exit_code(exc)
            if code is not None:
                raise JobEnded(code) from exc
            raise
        self._in_run = False
        self._finish(trainer)
        return result

    def _start_observer(self) -> None:
        """During a Trainer call, until the watchdog runs: a local replica that fails ends the job."""
        stop = self._observer_stop = threading.Event()

        def observe() -> None:
            while not stop.wait(0.5):
                watchdog = self.strategy.watchdog
                if not self._in_run or (watchdog is not None and watchdog.running):
                    if all(proc.poll() is not None for proc in self.procs):
                        return
                    continue
                verdict = check_children(self._children())
                if verdict is None:
                    continue
                message = (
                    f"[rank {self.cluster_environment.global_rank()}] lightning_het: {verdict.message} before the"
                    f" replicas could start their run. Ending the job (exit status {exit_code_for(verdict)})."
                )
                print(message, file=sys.stderr, flush=True)
                kill_children(self._children())
                sys.stdout.flush()
                os._exit(exit_code_for(verdict))

        self._observer = threading.Thread(target=observe, name="lightning-het-replica-observer", daemon=True)
        self._observer.start()

    def _stop_observer(self) -> None:
        observer, self._observer = self._observer, None
        if observer is None or self._observer_stop is None:
            return
        self._observer_stop.set()
        if observer is not threading.current_thread():
            observer.join(timeout=5.0)

    def _finish(self, trainer: Any) -> None:
        """Run-to-the-end barrier: wait (watched) until every replica has finished this Trainer call."""
        from lightning_het.reliability.supervision import stop_watchdog

        stop_watchdog(self.strategy.release_watchdog(), trainer, finished=True)

    def _exit_code(self, exc: BaseException) -> int | None:
        """124/130 when ``exc`` only reflects how the job ended elsewhere (or Ctrl-C); ``None``: propagate ``exc``."""
        if isinstance(exc, JobEnded):
            return None
        watchdog = self.strategy.watchdog
        verdict = watchdog.on_exception(exc) if watchdog is not None else None
        if interruption_of(exc) is not None:
            return exit_code_for(verdict) if verdict is not None else INTERRUPTED_EXIT_CODE
        if verdict is None or not is_collective_failure(exc):
            return None
        if verdict.kind == "failed" and watchdog is not None and watchdog.rank in verdict.culprits:
            return None
        return exit_code_for(verdict) if verdict.kind != "failed" else WATCHDOG_EXIT_CODE


class HeterogeneousScriptLauncher(ScriptLauncherMixin, _SubprocessScriptLauncher):
    """Lightning's ``popen`` launcher, plus the lifecycle guarantees of this module."""


def fabric_script_launcher(strategy: TimedStrategy, launcher: Any) -> Any:
    """Fabric's ``popen`` launcher ``launcher`` for ``strategy``, plus no orphans (on the strategy's Fabric package)."""
    built = fabric_flavour(strategy).ScriptLauncher(
        launcher.cluster_environment, launcher.num_processes, launcher.num_nodes
    )
    built.strategy = strategy
    return built


class FabricReplicaProcesses(_ReplicaProcesses):
    """No orphans and an uncaught exception noted, mixed into each Fabric package's ``popen`` launcher."""

    def _call_children_scripts(self) -> None:
        super()._call_children_scripts()
        previous = sys.excepthook

        def note_failure(*exc_info: Any) -> None:  # the loop runs outside the launcher: see an uncaught exception
            self._failed = True
            previous(*exc_info)

        sys.excepthook = note_failure


class HeterogeneousFabricScriptLauncher(FabricReplicaProcesses, _FabricSubprocessScriptLauncher):
    """Fabric's ``popen`` launcher, plus no orphans."""


def child_command(local_rank: int) -> tuple[list[str], str | None]:
    """The command line and working directory (``None``: this one) that start replica ``local_rank``: this script
    again, as Lightning's launcher runs it; under Hydra from the job's original directory, with this run's output
    directory and no config files of its own."""
    import __main__

    spec = getattr(__main__, "__spec__", None)
    if not _hydra_in_use():
        script = ["-m", spec.name] if spec is not None else [os.path.abspath(sys.argv[0])]
        return [sys.executable, *script, *sys.argv[1:]], None
    from hydra.core.hydra_config import HydraConfig
    from hydra.utils import get_original_cwd, to_absolute_path

    script = ["-m", spec.name] if spec is not None else [to_absolute_path(sys.argv[0])]
    overrides = [f'hydra.run.dir="{HydraConfig.get().run.dir}"', f"hydra.job.name=train_ddp_process_{local_rank}"]
    return [sys.executable, *script, *sys.argv[1:], *overrides, "hydra.output_subdir=null"], get_original_cwd()


def _hydra_in_use() -> bool:
    try:
        from hydra.core.hydra_config import HydraConfig
    except ImportError:
        return False
    return HydraConfig.initialized()
