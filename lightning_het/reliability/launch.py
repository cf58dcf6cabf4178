"""Launching: Lightning's launchers wrapped so that replicas end together, leave no process behind, and say why."""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from lightning_het.cluster.rendezvous import (
    TOKEN_ENV,
    ensure_job_token,
    keep_sockets_local,
    restore_job_environment,
    save_job_environment,
)
from lightning_het.reliability.output_dir import check_output_dir
from lightning_het.reliability.verdicts import INTERRUPTED_EXIT_CODE, JobEnded, exit_code_for, is_collective_failure
from lightning_het.reliability.watchdog import as_seconds, check_children, die_with_parent, end_children, exit_job


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
        self.strategy = strategy
        self.cluster_environment = launcher.cluster_environment
        self.num_processes, self.num_nodes = launcher.num_processes, launcher.num_nodes
        self.procs: list[subprocess.Popen] = []
        self._failed = self._in_run = False  # _failed: a run of this process ended with an exception
        self._token: str | None = None  # the job token the replicas this process launched were given
        self._observer_stop = threading.Event()
        self._wrapped = type(launcher)

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # Lightning's, to `isinstance`: its Ctrl-C path then calls `kill`
        return self._wrapped

    def __deepcopy__(self, memo: dict[int, Any]) -> ScriptLauncher:
        return self  # shared: this process's replicas and observer thread

    def kill(self, signum: int) -> None:
        """Send ``signum`` to the replicas this process started (Lightning's launcher interface)."""
        for proc in self.procs:
            if proc.poll() is None:
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
        preexec = die_with_parent if sys.platform.startswith("linux") else None
        for local_rank in range(1, self.num_processes):
            command, cwd = child_command(local_rank)
            env_vars = {**os.environ, "LOCAL_RANK": f"{local_rank}"}
            self.procs.append(subprocess.Popen(command, env=env_vars, cwd=cwd, preexec_fn=preexec))
        atexit.register(self._reap_children)
        previous = sys.excepthook

        def note_failure(*exc_info: Any) -> None:  # Fabric's loop runs outside the launcher: see an uncaught exception
            self._failed = True
            previous(*exc_info)

        sys.excepthook = note_failure

    def children(self) -> list[tuple[int, subprocess.Popen]]:
        """(global rank, process) of the replicas this process launched."""
        first = self.cluster_environment.node_rank() * self.num_processes
        return list(enumerate(self.procs, start=first + 1))

    def _observe(self) -> None:
        """Until the watchdog runs: a local replica that fails ends the job."""
        stop = self._observer_stop
        while not stop.wait(0.5):
            watchdog = getattr(self.strategy, "watchdog", None)
            if not self._in_run or self._failed or (watchdog is not None and watchdog.running):
                if all(proc.poll() is not None for proc in self.procs):
                    return
                continue
            verdict = check_children(self.children())
            if verdict is not None:
                rank, code = self.cluster_environment.global_rank(), exit_code_for(verdict)
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
            return exit_code_for(verdict) if verdict is not None else INTERRUPTED_EXIT_CODE
        blamed_here = verdict is None or (verdict.kind == "failed" and watchdog.rank in verdict.culprits)
        return None if blamed_here or not is_collective_failure(exc) else exit_code_for(verdict)


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
