"""The real distributed engines: a local SLURM cluster (``srun``, ``sbatch``, the submitit launcher of Hydra) and
``torchrun`` with two agents in two network namespaces (two emulated hosts).

The SLURM tests need a running cluster (``scripts/ci/slurm_up.sh``; ``SLURM_CONF`` or ``$LH_SLURM_DIR/slurm.conf``
points at it), the ``torchrun`` test needs root for ``ip netns``. Where they are missing the tests skip with the reason,
unless ``LH_REQUIRE_ENGINES=1`` (set by ``.ci/run``): then a missing engine is a failure, so CI cannot pass by
skipping them. Every job gets a unique name and is cancelled when its test ends; the namespaces are removed, and
whatever still runs in them is killed, whatever the outcome.

Exactness is checked as in the local tests: the weights after training equal those of one process training on the
whole global batch (``tests.helpers.tiny.reference_weights``), whatever split the profiled speeds chose.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from tests.helpers import harness
from tests.helpers.jobs import REPO, job_env, run_in_session
from tests.helpers.tiny import make_dataset, reference_weights

pytestmark = pytest.mark.slow

REQUIRE = os.environ.get("LH_REQUIRE_ENGINES") == "1"
STAND_INS = REPO / "scripts" / "ci" / "bin"  # the `sacct` stand-in (no accounting database on the test cluster)
DOCS = REPO / "docs" / "clusters.md"


def _unavailable(reason: str) -> None:
    """Skip with ``reason``; fail instead where the engines are required (CI)."""
    if REQUIRE:
        pytest.fail(f"{reason} (LH_REQUIRE_ENGINES=1: the engine tests must run on this machine)", pytrace=False)
    pytest.skip(reason)


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in b)


# --------------------------------------------------------------------------------------------------------- SLURM
@pytest.fixture(scope="module")
def slurm_env() -> dict[str, str]:
    """Environment that reaches the local cluster: ``SLURM_CONF``, the stand-ins and this interpreter first on PATH,
    the repository importable, and none of an enclosing job's ``SLURM_*`` variables."""
    missing = [tool for tool in ("srun", "sbatch", "scontrol", "sinfo", "scancel") if shutil.which(tool) is None]
    if missing:
        _unavailable(f"SLURM client tools missing ({', '.join(missing)}): apt-get install slurm-client")
    conf = os.environ.get("SLURM_CONF") or str(Path(os.environ.get("LH_SLURM_DIR", "/tmp/lh-slurm")) / "slurm.conf")
    if not Path(conf).is_file():
        _unavailable(f"no SLURM cluster: {conf} does not exist (start one with scripts/ci/slurm_up.sh, as root)")
    # no MASTER_PORT either: jobs running side by side on one node would all rendezvous on it (Lightning derives a
    # port from the job id when none is set)
    env = {
        k: v
        for k, v in job_env().items()
        if not k.startswith(("SLURM_", "SBATCH_", "SRUN_")) and k not in ("MASTER_ADDR", "MASTER_PORT")
    }
    env["SLURM_CONF"] = conf
    env["PATH"] = os.pathsep.join([str(STAND_INS), str(Path(sys.executable).parent), env.get("PATH", "")])
    state = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True, timeout=30)
    if state.returncode != 0 or not re.search(r"^(idle|mixed|allocated)", state.stdout, flags=re.M):
        _unavailable(f"the SLURM cluster of {conf} has no usable node: {state.stdout.strip()} {state.stderr.strip()}")
    return env


@pytest.fixture
def job_name(slurm_env):
    """A unique SLURM job name; every job of that name is cancelled when the test ends."""
    name = f"lh-test-{uuid.uuid4().hex[:8]}"
    yield name
    subprocess.run(["scancel", f"--name={name}"], env=slurm_env, capture_output=True, timeout=30)


def test_srun_three_tasks_profiled_exact(slurm_env, job_name, tmp_path):
    """``srun --ntasks-per-node=3``: Lightning takes the ranks from SLURM; the profiled split trains exactly."""
    cfg = {"devices": 3, "strategy": "heterogeneous", "epochs": 2, "n": 60}
    command = ["srun", "--nodes=1", "--ntasks-per-node=3", f"--job-name={job_name}", "--time=10"]
    command += ["--kill-on-bad-exit=1", sys.executable, *harness.command("tiny", tmp_path, cfg)]
    result = run_in_session(command, cwd=REPO, env=slurm_env, timeout=300)
    assert result.returncode == 0, result.stdout[-6000:]

    dumps = [torch.load(tmp_path / f"rank{r}.pt") for r in range(3)]
    reference = reference_weights(make_dataset(60), 12, epochs=2, seed=0)  # loader batch 4 x 3 replicas
    for dump in dumps:
        assert dump["cluster_environment"] == "SLURMEnvironment"
        assert dump["node_ids"] == [0, 0, 0]
        assert dump["speeds"] == dumps[0]["speeds"] and all(s > 0 for s in dump["speeds"])  # profiled, agreed
        assert sum(dump["batch_sizes"]) == 12 and dump["global_step"] == 10
        assert _max_diff(dump["state_dict"], reference) < 1e-5
        assert _max_diff(dump["state_dict"], dumps[0]["state_dict"]) == 0.0
    assert "samples/s" in result.stdout  # the balance table of profiled speeds


def documented_job_script() -> str:
    """The ``sbatch`` job script of docs/clusters.md (the fenced block that starts with ``#!/bin/bash``)."""
    blocks = re.findall(r"```bash\n(#!/bin/bash\n.*?)```", DOCS.read_text(), flags=re.S)
    assert len(blocks) == 1, f"expected one job script in {DOCS}, found {len(blocks)}"
    return blocks[0]


#: a small run of the app on every engine: 2 replicas, one short epoch, no prediction map
APP_ARGS = ["experiment=quick", "trainer.max_epochs=1", "prediction_map=false"]


def _check_app_metrics(path: Path, seed: int) -> dict:
    metrics = json.loads(path.read_text())
    for key in ("test/oa", "test/aa", "test/kappa"):
        assert 0.0 <= metrics[key] <= 1.0, (key, metrics[key])
    balance = metrics["balance"]
    assert metrics["world_size"] == 2 and len(balance["batch_sizes"]) == 2
    assert sum(balance["batch_sizes"]) == balance["global_batch_size"] and balance["profiled"]
    assert f"seed={seed}" in (path.parent / ".hydra" / "overrides.yaml").read_text()
    return metrics


@pytest.fixture(scope="module")
def sbatch_run(slurm_env, tmp_path_factory) -> dict:
    """``sbatch --wait`` of the documented job script with the app's tiny settings (seed 0); its metrics."""
    work = tmp_path_factory.mktemp("sbatch")
    script = work / "job.sh"
    script.write_text(documented_job_script())
    name = f"lh-test-{uuid.uuid4().hex[:8]}"
    try:
        result = run_in_session(
            ["sbatch", "--wait", "--parsable", f"--job-name={name}", str(script), *APP_ARGS, "seed=0"],
            cwd=work,
            env=slurm_env,
            timeout=300,
        )
    finally:
        subprocess.run(["scancel", f"--name={name}"], env=slurm_env, capture_output=True, timeout=30)
    job = result.stdout.strip().splitlines()[0] if result.stdout.strip() else "?"
    logs = "\n".join(p.read_text()[-4000:] for p in work.glob("*.out"))
    assert result.returncode == 0, f"{result.stdout}\n{logs}"
    # the documented default run directory: outputs/<task>/slurm-<job id>.<step id>, shared by both tasks
    runs = list((work / "outputs" / "train").glob(f"slurm-{job}.*"))
    assert len(runs) == 1, (sorted(p.name for p in (work / "outputs").rglob("*")), logs)
    return {"metrics": _check_app_metrics(runs[0] / "metrics.json", seed=0), "logs": logs}


def test_sbatch_documented_job_script(sbatch_run):
    assert sbatch_run["metrics"]["num_nodes"] == 1
    assert "test: OA" in sbatch_run["logs"]  # rank 0's summary in the job's output file


def _run_sweep(slurm_env, tmp_path: Path, args: list[str], timeout: float) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "lightning_het.app", "-m", "hydra/launcher=slurm_cpu", *args]
    # the test node has 8 CPUs and the machine's memory: ask for little of both
    command += ["hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=1", "hydra.launcher.timeout_min=10"]
    return run_in_session(command, cwd=tmp_path, env=slurm_env, timeout=timeout, merge_stderr=False)


def _cancel_sweep(slurm_env, sweep_dir: Path) -> None:
    """Cancel every job the sweep submitted (submitit names its job folders by job id)."""
    ids = {p.name.split("_")[0] for p in (sweep_dir / ".submitit").glob("*") if p.name[0].isdigit()}
    if ids:
        subprocess.run(["scancel", *sorted(ids)], env=slurm_env, capture_output=True, timeout=30)


def test_submitit_sweep_two_seeds(slurm_env, sbatch_run, tmp_path):
    """``-m hydra/launcher=slurm_cpu seed=0,1``: one SLURM job per seed, each with its own metrics.json; seed 0
    trains exactly as the ``sbatch`` run did, whatever split each profiled."""
    sweep_dir = tmp_path / "sweep"
    try:
        result = _run_sweep(slurm_env, tmp_path, [*APP_ARGS, "seed=0,1", f"hydra.sweep.dir={sweep_dir}"], timeout=400)
    finally:
        _cancel_sweep(slurm_env, sweep_dir)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    jobs = sorted(p.name for p in sweep_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
    assert jobs == ["0", "1"]
    seed0, seed1 = (_check_app_metrics(sweep_dir / job / "metrics.json", seed=int(job)) for job in jobs)
    assert seed0["output_dir"] == str(sweep_dir / "0") and seed1["output_dir"] == str(sweep_dir / "1")
    assert seed0["test/loss"] != seed1["test/loss"]  # two seeds, two runs
    # same seed, another engine and (usually) another split: the same weights, hence the same losses
    reference = sbatch_run["metrics"]
    assert seed0["test/loss"] == pytest.approx(reference["test/loss"], rel=1e-4, abs=1e-6)
    assert seed0["history"][0]["val/loss"] == pytest.approx(reference["history"][0]["val/loss"], rel=1e-4, abs=1e-6)


def test_submitit_sweep_job_that_dies_ends_the_sweep(slurm_env, tmp_path):
    """A job that dies before it can report (here its batch script exits 3 before ``srun``) ends the sweep with an
    error naming the job and its state. Without accounting, ``sacct`` is what submitit asks and nothing answers; the
    stand-in on PATH answers from ``scontrol`` (without it this sweep waits forever)."""
    sweep_dir = tmp_path / "sweep"
    started = time.monotonic()
    try:
        result = _run_sweep(
            slurm_env,
            tmp_path,
            ["experiment=quick", "seed=0", f"hydra.sweep.dir={sweep_dir}", 'hydra.launcher.setup=["exit 3"]'],
            timeout=180,
        )
    finally:
        _cancel_sweep(slurm_env, sweep_dir)
    assert result.returncode != 0
    assert "has not produced any output (state: FAILED)" in result.stderr, result.stderr[-4000:]
    assert time.monotonic() - started < 180


# ------------------------------------------------------------------------------------------------------- torchrun
def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


@pytest.fixture
def two_hosts():
    """Two network namespaces joined by a veth pair, 198.18.0.1 and 198.18.0.2 (the benchmarking range); removed with
    everything still running inside them when the test ends. Yields ``[(namespace, interface, address), ...]``."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("unshare") is None:
        _unavailable("torchrun across network namespaces needs root, `ip` (iproute2) and `unshare` (util-linux)")
    tag = f"lh{os.getpid() % 100000}"
    hosts = [(f"{tag}n{i}", f"{tag}v{i}", f"198.18.0.{i + 1}") for i in range(2)]
    try:
        for ns, _, _ in hosts:
            _ip("netns", "add", ns)
        _ip("link", "add", hosts[0][1], "type", "veth", "peer", "name", hosts[1][1])
        for ns, dev, addr in hosts:
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
    except subprocess.CalledProcessError as err:
        _remove_namespaces(hosts)
        _unavailable(f"cannot create network namespaces: {err.stderr.strip()}")
    try:
        yield hosts
    finally:
        _remove_namespaces(hosts)


def _kill_namespace(ns: str) -> None:
    """SIGKILL every process in network namespace ``ns``."""
    for pid in _ip("netns", "pids", ns, check=False).stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def _remove_namespaces(hosts) -> None:
    for ns, _, _ in hosts:
        _kill_namespace(ns)
        _ip("netns", "del", ns, check=False)  # also removes the veth pair


def _end_agents(agents: list) -> None:
    """Kill the agents (``(process, log)`` pairs) still running and close their logs."""
    for process, log in agents:
        if process.poll() is None:
            process.kill()
            process.wait()
        log.close()


def test_torchrun_two_hosts_hierarchical_and_node_local(two_hosts, tmp_path):
    """Two torchrun agents (c10d rendezvous), each in its own network namespace with its own host name, 2 workers
    each: the strategy sees two nodes; ``comm="hierarchical"`` trains exactly, ``node_local`` ends in consensus."""
    common = {"devices": 2, "num_nodes": 2, "epochs": 2, "n": 60}
    strategy = {"speeds": [1, 2, 3, 4], "global_batch_size": 12}
    fits = [
        {**common, "strategy": {**strategy, "comm": "hierarchical", "comm_autotune_steps": 0}},
        {**common, "strategy": {**strategy, "comm": "node_local", "global_sync_every": 2}},
    ]
    endpoint = f"{two_hosts[0][2]}:29400"
    env = {k: v for k, v in job_env().items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONUNBUFFERED"] = "1"  # the agents' logs show how far the workers got, also when they are killed
    agents = []
    for index, (ns, dev, addr) in enumerate(two_hosts):
        torchrun = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={two_hosts[0][0]}",
            # which agent hosts the rendezvous store: its host name does not resolve to the endpoint's address here
            f"--rdzv-conf=is_host={int(index == 0)},join_timeout=120",
            f"--local-addr={addr}",  # what the workers get as MASTER_ADDR (else: this host's name)
            *harness.command("tiny", tmp_path, fits),
        ]  # fmt: skip
        # gloo binds to the address the host name resolves to (127.0.0.1 here) unless told the interface
        command = ["ip", "netns", "exec", ns, "env", f"GLOO_SOCKET_IFNAME={dev}", "unshare", "--uts", "sh", "-c"]
        command += [f'hostname lh-node{index} && exec "$@"', "sh", *torchrun]
        log = (tmp_path / f"agent{index}.log").open("w")
        agents.append((subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    try:
        deadline = time.monotonic() + 300
        for process, _ in agents:
            process.wait(timeout=max(1.0, deadline - time.monotonic()))  # a hang ends here, then the asserts
    except subprocess.TimeoutExpired:
        pass
    finally:
        _end_agents(agents)
    logs = "\n".join((tmp_path / f"agent{i}.log").read_text()[-3000:] for i in range(2))
    assert [process.returncode for process, _ in agents] == [0, 0], logs

    exact, local = ([torch.load(tmp_path / str(i) / f"rank{r}.pt") for r in range(4)] for i in range(2))
    reference = reference_weights(make_dataset(60), 12, epochs=2, seed=0)
    assert [d["hostname"] for d in exact] == ["lh-node0", "lh-node0", "lh-node1", "lh-node1"]
    for dump in exact:
        assert dump["cluster_environment"] == "TorchElasticEnvironment"
        assert dump["node_ids"] == [0, 0, 1, 1]
        assert dump["comm_mode"] == "hierarchical" and dump["comm_reduction"] == "hierarchical"
        assert _max_diff(dump["state_dict"], reference) < 1e-5
        assert _max_diff(dump["state_dict"], exact[0]["state_dict"]) == 0.0
    # only the node leaders (ranks 0 and 2) send between the hosts
    assert [d["comm_stats"]["bytes_inter_per_step"] > 0 for d in exact] == [True, False, True, False]
    for dump in local:
        assert dump["comm_mode"] == "node_local"
        assert _max_diff(dump["state_dict"], local[0]["state_dict"]) == 0.0  # consensus at the end
    assert _max_diff(local[0]["state_dict"], reference) > 1e-3  # really local steps between the averages
    assert local[0]["comm_stats"]["global_syncs"] >= 4


ELASTIC = {"epochs": 3, "n": 64, "batch_size": 4, "timeout": 3.0, "step_sleep": 0.15}
ELASTIC_PER_NODE = 2  # Lightning runs the same number of replicas on every node
ELASTIC_GLOBAL_BATCH = 2 * ELASTIC_PER_NODE * ELASTIC["batch_size"]  # kept by the restarted replicas
ELASTIC_STEPS = ELASTIC["epochs"] * ELASTIC["n"] // ELASTIC_GLOBAL_BATCH
ELASTIC_KILL_AT = ELASTIC["n"] // ELASTIC_GLOBAL_BATCH + 2  # the second node is killed after this step (epoch 1)


def _elastic_agent(index: int, hosts: list, out: Path, cfg: dict) -> list[str]:
    """The command of torchrun agent ``index`` (elastic: 1 to 2 nodes, 1 restart) in the namespace of host ``index``;
    the first host's agent hosts the rendezvous."""
    ns, dev, addr = hosts[index]
    endpoint = f"{hosts[0][2]}:29400"
    rdzv = "join_timeout=120,last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3"
    torchrun = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", f"--nproc-per-node={ELASTIC_PER_NODE}",
        "--max-restarts=1", "--monitor-interval=0.2", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={hosts[0][0]}", f"--rdzv-conf=is_host={int(index == 0)},{rdzv}", f"--local-addr={addr}",
        *harness.command("emergency", out, cfg),
    ]  # fmt: skip
    command = ["ip", "netns", "exec", ns, "env", f"GLOO_SOCKET_IFNAME={dev}", "unshare", "--uts", "sh", "-c"]
    return [*command, f'hostname lh-node{index} && exec "$@"', "sh", *torchrun]


def _wait_for_step(steps: Path, step: int, agents: list, limit: float) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and all(a.poll() is None for a, _ in agents):
        if steps.exists() and any(int(line.split()[0]) >= step for line in steps.read_text().splitlines()):
            return
        time.sleep(0.05)
    raise AssertionError(f"the job did not reach step {step}")


def test_torchrun_elastic_a_lost_node_is_finished_on_the_survivor_with_no_step_lost(two_hosts, tmp_path):
    """Two elastic torchrun agents (c10d, ``--nnodes=1:2 --max-restarts=1``) of two workers each, in two network
    namespaces; the second node (agent and workers) is SIGKILLed mid-epoch. The survivors agree and write the emergency
    checkpoint, exit 124; torchrun restarts them alone; they resume by themselves (``TORCHELASTIC_RESTART_COUNT``) and
    finish: the weights of an uninterrupted run, no step trained twice, the time from the kill to the first resumed
    step reported."""
    cfg = {**ELASTIC, "root": str(tmp_path / "root")}
    env = {k: v for k, v in job_env().items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONUNBUFFERED"] = "1"
    env["LOGLEVEL"] = "INFO"  # the agents log their rendezvous rounds and restarts
    # a fresh store per rendezvous round: torch shares one across rounds, whose keys of the workers of the round before
    # (their gloo addresses) the restarted workers would read
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    agents = []
    for index in (1, 0):  # the second node waits for the store of the first: both join the first round
        log = (tmp_path / f"agent{index}.log").open("w")
        command = _elastic_agent(index, two_hosts, tmp_path, cfg)
        agents.append((subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    first = agents[1][0]
    try:
        _wait_for_step(tmp_path / "steps_rank0.txt", ELASTIC_KILL_AT, agents, 240)
        killed_at = time.time()
        _kill_namespace(two_hosts[1][0])  # the second node's agent and worker
        first.wait(timeout=240)
    finally:
        _end_agents(agents)
    logs = [(tmp_path / f"agent{i}.log").read_text() for i in (0, 1)]
    assert first.returncode == 0, "\n".join(log[-4000:] for log in logs)
    assert "emergency checkpoint of global step" in logs[0] and "will restart worker group" in logs[0]
    lines = [line.split() for line in (tmp_path / "steps_rank0.txt").read_text().splitlines()]
    steps = [int(step) for step, _ in lines]
    assert sorted(steps) == list(range(1, ELASTIC_STEPS + 1)), steps  # every step once: none lost, none trained twice
    resumed = min(float(at) for step, at in lines if float(at) > killed_at and int(step) > ELASTIC_KILL_AT)
    saved = torch.load(tmp_path / "root" / "checkpoints" / "emergency.ckpt", weights_only=True)["global_step"]
    print(f"elastic: killed after step >= {ELASTIC_KILL_AT}, emergency checkpoint of step {saved}, first resumed step"
          f" {resumed - killed_at:.1f} s after the kill (goal: timeout {ELASTIC['timeout']:g} s + 30 s)")  # fmt: skip
    assert resumed - killed_at <= ELASTIC["timeout"] + 30 + 30  # the goal plus slack for a loaded CI machine
    reference = reference_weights(make_dataset(ELASTIC["n"]), ELASTIC_GLOBAL_BATCH, epochs=ELASTIC["epochs"], seed=0)
    for rank in range(ELASTIC_PER_NODE):
        dump = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert dump["world_size"] == ELASTIC_PER_NODE and dump["global_step"] == ELASTIC_STEPS
        assert _max_diff(dump["state_dict"], reference) < 1e-5
