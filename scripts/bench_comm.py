#!/usr/bin/env python
"""Benchmark of the communication modes on two emulated nodes joined by a slow link.

Two network namespaces play two nodes with two replicas each (world size 4, node ids ``[0, 0, 1, 1]``). A veth pair
joins them and is shaped with ``tc`` (token bucket, 1 Gbit/s by default, plus ``netem`` delay when the kernel has
it); traffic between the two replicas of a node stays inside its namespace (loopback). Each process is started like
one launcher per node would start it (``NODE_RANK``, ``LOCAL_RANK``, ``MASTER_ADDR`` = node 0's veth address). The
job trains a communication-bound MLP (10.5 M parameters, 42 MB of gradients) under each configuration in turn, from
the same initial weights and data:

* ``ddp``: ``lightning.Trainer(strategy="ddp")`` (on CPU Lightning registers no comm hook: a flat all-reduce);
* ``allreduce``, ``hierarchical``, ``node_local`` (K = 4 and 16; ``outer int8 K=32``: DiLoCo's outer Nesterov step
  and int8 syncs): ``Trainer(strategy=HeterogeneousStrategy(comm=NodeLocal(sync_every=K), ...))``, which must detect the
  two nodes by itself. ``hierarchical`` runs as a user gets it: its first ``2 * --autotune-steps + 1`` steps
  (untimed, inside the warm-up) time the flat and the hierarchical reduction and keep the faster; ``hierarchy only``
  forces the node hierarchy (``Hierarchical(autotune_steps=0)``).

``--runner raw`` runs the same configurations on a bare ``DistributedDataParallel`` with
:meth:`lightning_het.CommAlgorithm.install` instead (no Lightning; ``ddp`` is then DDP without a hook).

Reported per configuration: mean step time (s), inter-node bytes per step measured on the veth (both directions,
TCP/IP headers included) and predicted by the byte model, and the loss on a held-out batch after a fixed number of
steps (evaluated on the consensus model, after the epoch-end ``sync``).

Run (root; needs ``ip`` and ``tc``; 3-4 minutes on 2 cores)::

    python scripts/bench_comm.py --plot docs/img/bench_comm.png

Quick check without namespaces or shaping (localhost, tiny model, < 60 s on 2 idle cores; used as a test)::

    python scripts/bench_comm.py --tiny

Namespaces, veth and workers are removed/killed in a ``finally`` block and on SIGINT/SIGTERM, also on failure.
Results go to ``--out`` (``bench_results/comm``: ``results.json``, ``results.csv``, worker logs).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from _workers import REPO, Worker, run_workers, worker_env

if str(REPO) not in sys.path:  # the package without installing it (workers get it through PYTHONPATH)
    sys.path.insert(0, str(REPO))
NODE_IDS = [0, 0, 1, 1]
NODE_ADDRS = ("198.18.0.1", "198.18.0.2")  # RFC 2544 benchmarking range
#: (name, comm, K, measured flat-vs-hierarchical choice)
CONFIGS: list[tuple[str, str, int | None, bool]] = [
    ("ddp", "ddp", None, False),
    ("allreduce", "allreduce", None, False),
    ("hierarchical", "hierarchical", None, True),
    ("hierarchy only", "hierarchical", None, False),
    ("node_local K=4", "node_local", 4, False),
    ("node_local K=16", "node_local", 16, False),
    ("outer int8 K=32", "node_local", 32, False),
]
#: the sync keywords of a configuration (by name) beyond the plain average
SYNC_SETTINGS: dict[str, dict[str, Any]] = {"outer int8 K=32": {"outer_optimizer": "nesterov", "sync_dtype": "int8"}}


@dataclass
class Result:
    """One configuration's outcome (rank 0's view; times in seconds, bytes per optimizer step)."""

    name: str
    comm: str
    global_sync_every: int | None
    step_time_s: float
    inter_bytes_measured: float | None
    inter_bytes_model: float
    eval_loss: float
    train_loss_last: float
    consensus: bool
    steps: int
    reduction: str | None = None  #: ``hierarchical`` modes: the reduction that ran in the timed steps
    step_time_runs: list[float] | None = None  #: one mean step time per repeat (``--repeat``)


# --------------------------------------------------------------------------- emulated nodes
def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


@contextlib.contextmanager
def emulated_nodes(rate: str | None, delay_ms: float) -> Iterator[tuple[list[str], list[str], str]]:
    """Create two namespaces joined by a shaped veth pair; yield (namespaces, interface names, shaping note)."""
    tag = f"lhb{os.getpid() % 100000}"
    namespaces = [f"{tag}n0", f"{tag}n1"]
    ifaces = [f"{tag}a", f"{tag}b"]
    notes: list[str] = []
    try:
        for ns in namespaces:
            _sh("ip", "netns", "add", ns)
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        _sh("ip", "link", "add", ifaces[0], "type", "veth", "peer", "name", ifaces[1])
        for ns, iface, addr in zip(namespaces, ifaces, NODE_ADDRS):
            _sh("ip", "link", "set", iface, "netns", ns)
            _sh("ip", "-n", ns, "addr", "add", f"{addr}/30", "dev", iface)
            _sh("ip", "-n", ns, "link", "set", iface, "up")
        for ns, iface in zip(namespaces, ifaces):
            notes.append(_shape(ns, iface, rate, delay_ms))
        yield namespaces, ifaces, notes[0]
    finally:
        for ns in namespaces:  # deleting a namespace also deletes its end of the veth pair (and the pair)
            _sh("ip", "netns", "del", ns, check=False)
        _sh("ip", "link", "del", ifaces[0], check=False)


def _shape(ns: str, iface: str, rate: str | None, delay_ms: float) -> str:
    """Egress shaping of one veth end: netem delay (if available) with a tbf rate limit below it."""
    tc = ("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", iface)
    tbf = ("tbf", "rate", rate or "", "burst", "256kb", "latency", "20ms")
    netem = ("root", "handle", "1:", "netem", "delay", f"{delay_ms}ms")
    if delay_ms > 0 and _sh(*tc, *netem, check=False).returncode == 0:
        if rate:
            _sh(*tc, "parent", "1:1", "handle", "10:", *tbf)
        return f"tbf rate {rate} + netem delay {delay_ms} ms" if rate else f"netem delay {delay_ms} ms"
    if rate:
        _sh(*tc, "root", *tbf)
        return f"tbf rate {rate}" + (" (netem unavailable in this kernel: no added delay)" if delay_ms > 0 else "")
    return "unshaped"


# --------------------------------------------------------------------------- orchestration
def _launch_and_wait(
    args: argparse.Namespace, out: Path, namespaces: list[str] | None, ifaces: list[str] | None
) -> None:
    from lightning_het.cluster.rendezvous import free_port  # torch is imported only when a job starts

    port = free_port() if namespaces is None else 29555
    master = "127.0.0.1" if namespaces is None else NODE_ADDRS[0]
    workers = []
    for rank, node in enumerate(NODE_IDS):
        env = worker_env(
            master,
            port,
            OMP_NUM_THREADS="1",
            MKL_NUM_THREADS="1",
            GLOO_SOCKET_IFNAME="lo" if ifaces is None else ifaces[node],
            # what one launcher per node sets (Lightning's LightningEnvironment): the strategy finds the nodes
            NODE_RANK=str(node),
            LOCAL_RANK=str(NODE_IDS[:rank].count(node)),
            WORLD_SIZE=str(len(NODE_IDS)),
        )
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--rank", str(rank), *args.passthrough]
        if namespaces is not None:
            cmd = ["ip", "netns", "exec", namespaces[node], *cmd, "--ifname", ifaces[node]]  # type: ignore[index]
        workers.append(Worker(cmd, env, out / f"worker{rank}.log"))
    run_workers(workers, timeout=args.timeout, name="bench_comm", cwd=Path.cwd())


def _raise_on_signal(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def orchestrate(args: argparse.Namespace) -> list[Result]:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _raise_on_signal)
    if args.tiny:
        link = "localhost (no namespaces, no shaping)"
        _launch_and_wait(args, out, None, None)
    else:
        with emulated_nodes(args.rate, args.delay_ms) as (namespaces, ifaces, link):
            _launch_and_wait(args, out, namespaces, ifaces)
    payload = json.loads((out / "results.json").read_text())
    payload["link"] = link
    (out / "results.json").write_text(json.dumps(payload, indent=2))
    return report(payload, out, args.plot)


def report(payload: dict[str, Any], out: Path, plot_path: str | None) -> list[Result]:
    """Write results.csv, print the Markdown table, draw the plot."""
    results = [Result(**r) for r in payload["results"]]
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(results[0])))
        writer.writeheader()
        writer.writerows(asdict(r) for r in results)
    print(markdown_table(results, payload))
    if plot_path:
        plot(results, payload, Path(plot_path))
    return results


def markdown_table(results: list[Result], payload: dict[str, Any]) -> str:
    base = results[0]
    lines = [
        f"link: {payload['link']}; model: {payload['params'] / 1e6:.1f} M parameters"
        f" ({payload['grad_bytes'] / 1e6:.1f} MB of gradients); batch sizes {payload['batch_sizes']};"
        f" {payload['timed_steps']} timed steps after {payload['warmup_steps']} untimed",
        "",
        "| configuration | reduction | step time (s) | speed-up vs ddp | inter-node MB/step measured | model"
        " | fewer bytes vs ddp | held-out loss | consensus |",
        "|---|---|---:|---:|---:|---:|---:|---:|:-:|",
    ]
    for r in results:
        measured = f"{r.inter_bytes_measured / 1e6:.1f}" if r.inter_bytes_measured is not None else "-"
        ref = base.inter_bytes_measured if base.inter_bytes_measured is not None else base.inter_bytes_model
        mine = r.inter_bytes_measured if r.inter_bytes_measured is not None else r.inter_bytes_model
        fewer = f"{ref / mine:.1f}x" if mine else "all"
        lines.append(
            f"| {r.name} | {r.reduction or '-'} | {r.step_time_s:.3f} | {base.step_time_s / r.step_time_s:.2f}x"
            f" | {measured}"
            f" | {r.inter_bytes_model / 1e6:.1f} | {fewer} | {r.eval_loss:.5f} | {'yes' if r.consensus else 'NO'} |"
        )
    return "\n".join(lines)


def plot(results: list[Result], payload: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.name for r in results]
    colors = ["#777777", "#4c72b0", "#55a868", "#8fd19e", "#dd8452", "#c44e52"][: len(results)]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    axes[0].bar(names, [r.step_time_s for r in results], color=colors)
    axes[0].set_ylabel("step time (s)")
    measured = [(r.inter_bytes_measured or 0) / 1e6 for r in results]
    axes[1].bar(names, measured, color=colors, label="measured on veth")
    axes[1].scatter(
        names,
        [r.inter_bytes_model / 1e6 for r in results],
        color="black",
        marker="_",
        s=400,
        label="byte model",
        zorder=3,
    )
    axes[1].set_ylabel("inter-node MB per step")
    axes[1].legend(fontsize=8)
    axes[2].bar(names, [r.eval_loss for r in results], color=colors)
    axes[2].set_ylabel(f"held-out loss after {results[0].steps} steps")
    lo = min(r.eval_loss for r in results)
    axes[2].set_ylim(lo * 0.95, max(r.eval_loss for r in results) * 1.02)
    for ax in axes:
        ax.tick_params(axis="x", rotation=30, labelsize=8)
    fig.suptitle(f"2 nodes x 2 replicas, {payload['link']}, {payload['params'] / 1e6:.1f} M params", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}")


# --------------------------------------------------------------------------- worker
def _read_link_bytes(ifname: str | None) -> int | None:
    if not ifname:
        return None
    stats = Path(f"/sys/class/net/{ifname}/statistics")
    return int((stats / "tx_bytes").read_text()) + int((stats / "rx_bytes").read_text())


class _Job:
    """What every configuration of one worker shares: ranks, data, model recipe, node groups."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        import torch.distributed as dist

        from lightning_het.cluster.topology import build_node_groups

        self.args = args
        self.rank, self.world = args.rank, len(NODE_IDS)
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=self.rank, world_size=self.world)
        self.groups = build_node_groups(NODE_IDS, self.rank)
        self.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
        self.total = sum(self.batch_sizes)
        self.mine = slice(sum(self.batch_sizes[: self.rank]), sum(self.batch_sizes[: self.rank + 1]))
        self.means = torch.randn(args.classes, args.features, generator=torch.Generator().manual_seed(123))
        self.held_out = self.batch(10**6, 512)

    def batch(self, step: int, size: int) -> tuple[Any, Any]:
        """Step ``step``'s global batch (the same on every rank): Gaussian noise around a random mean per class."""
        import torch

        g = torch.Generator().manual_seed(step)
        y = torch.randint(0, self.args.classes, (size,), generator=g)
        return torch.randn(size, self.args.features, generator=g) + self.args.signal * self.means[y], y

    def model(self) -> Any:
        import torch

        torch.manual_seed(0)
        layers: list[torch.nn.Module] = []
        width = self.args.features
        for _ in range(self.args.layers):
            layers += [torch.nn.Linear(width, self.args.hidden), torch.nn.ReLU()]
            width = self.args.hidden
        return torch.nn.Sequential(*layers, torch.nn.Linear(width, self.args.classes))


def _run_config(job: _Job, name: str, comm: str, k: int | None, tune: bool) -> tuple[Result, int, int]:
    """Train one configuration from the shared initial weights; return its result, #params and gradient bytes."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from lightning_het.comm import algorithm_for
    from lightning_het.comm.allreduce import flat_allreduce_traffic

    args, rank, sizes = job.args, job.rank, job.batch_sizes
    ddp = DistributedDataParallel(job.model(), gradient_as_bucket_view=args.bucket_view)
    params = sum(p.numel() for p in ddp.parameters())
    grad_bytes = sum(p.numel() * p.element_size() for p in ddp.parameters())
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    ctl = None
    if comm != "ddp":
        flat = {"global_sync_every": k, "comm_autotune_steps": args.autotune_steps if tune else 0}
        ctl = algorithm_for(comm, **flat, **SYNC_SETTINGS.get(name, {}))
        ctl.install(ddp, [opt], NODE_IDS, rank, sizes, groups=job.groups)  # its hooks run with each step
    scale = job.world * sizes[rank] / job.total  # the strategy's loss pre-scaling
    last_loss = torch.zeros(())

    def step(s: int) -> None:
        nonlocal last_loss
        x, y = job.batch(s, job.total)
        loss = torch.nn.functional.cross_entropy(ddp(x[job.mine]), y[job.mine])
        opt.zero_grad(set_to_none=True)
        (loss * scale).backward()
        opt.step()
        last_loss = loss.detach() * sizes[rank] / job.total

    for s in range(1, args.warmup_steps + 1):
        step(s)
    before = ctl.stats if ctl else None
    dist.barrier()
    link0, t0 = _read_link_bytes(args.ifname), time.perf_counter()
    for s in range(args.warmup_steps + 1, args.warmup_steps + args.steps + 1):
        step(s)
    dist.barrier()
    t1, link1 = time.perf_counter(), _read_link_bytes(args.ifname)
    dist.all_reduce(last_loss)  # global-batch mean loss of the last step (share-weighted)
    if ctl is not None and before is not None:
        model_bytes = (ctl.stats["job_bytes_inter_total"] - before["job_bytes_inter_total"]) / args.steps
        ctl.sync()  # end of run = end of epoch: one consensus model
    else:
        model_bytes = float(flat_allreduce_traffic(grad_bytes, NODE_IDS)[1].sum())
    result = _result(
        job,
        ddp.module,
        name=name,
        comm=comm,
        global_sync_every=k,
        window=(t0, t1, link0, link1),
        inter_bytes_model=model_bytes,
        train_loss_last=float(last_loss),
        steps=args.warmup_steps + args.steps,
        reduction=ctl.reduction if ctl is not None else None,
    )
    return result, params, grad_bytes


def _result(
    job: _Job,
    net: Any,
    window: tuple[float, float, int | None, int | None],
    **fields: Any,
) -> Result:
    """Evaluate ``net`` on the held-out batch, check that all ranks hold the same weights, and fill a ``Result``.

    ``window`` is ``(t0, t1, link_bytes0, link_bytes1)`` around the timed steps; ``fields`` are the rest of the row.
    """
    import torch
    import torch.distributed as dist

    steps = job.args.steps
    t0, t1, link0, link1 = window
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    checks: list[Any] = [None] * job.world
    dist.all_gather_object(checks, (float(flat.sum()), float(flat.abs().sum())))
    with torch.no_grad():
        eval_loss = float(torch.nn.functional.cross_entropy(net(job.held_out[0]), job.held_out[1]))
    return Result(
        step_time_s=(t1 - t0) / steps,
        inter_bytes_measured=None if link0 is None or link1 is None else (link1 - link0) / steps,
        eval_loss=eval_loss,
        consensus=all(c == checks[0] for c in checks),
        **fields,
    )


def _run_config_lightning(job: _Job, name: str, comm: str, k: int | None, tune: bool) -> tuple[Result, int, int]:
    """The same configuration through ``lightning.Trainer``: ``strategy="ddp"`` or ``HeterogeneousStrategy(comm=...)``.

    Each process was started by its own "launcher" with ``NODE_RANK`` / ``LOCAL_RANK`` set (Lightning's
    ``LightningEnvironment``), so the strategy detects the two nodes by itself. The loader yields consecutive samples,
    so every step's global batch is the same 16 samples under DDP's ``DistributedSampler`` (strided) and the
    strategy's proportional sampler (contiguous slices). One extra step ends the epoch outside the timed window, so
    the epoch-end consensus of ``node_local`` is not timed (as in the raw runner).
    """
    import lightning as L
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_het import HeterogeneousStrategy
    from lightning_het.comm.allreduce import flat_allreduce_traffic
    from lightning_het.config import typed_keywords

    args = job.args
    if job.total % job.world:
        raise ValueError(f"--runner lightning needs a global batch divisible by {job.world} for the ddp baseline")
    total_steps = args.warmup_steps + args.steps + 1
    xs, ys = zip(*(job.batch(s, job.total) for s in range(1, total_steps + 1)))
    # plain DDP splits the same global batch equally (the strategy re-splits it by --batch-sizes)
    loader = DataLoader(TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=job.total // job.world, shuffle=False)

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = job.model()

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=args.lr, momentum=0.9)

    class Window(L.Callback):
        """Times steps ``warmup_steps+1 .. warmup_steps+steps`` and reads the link and byte counters around them."""

        marks: dict[str, Any] = {}

        def _mark(self, trainer: L.Trainer, key: str) -> None:
            dist.barrier()
            stats = getattr(trainer.strategy, "comm_stats", {}) or {}
            self.marks[key] = (time.perf_counter(), _read_link_bytes(args.ifname), stats.get("job_bytes_inter_total"))
            self.marks[key + "_reduction"] = getattr(trainer.strategy, "comm_reduction", None)

        def on_train_batch_start(self, trainer: L.Trainer, *_: Any) -> None:
            if trainer.global_step == args.warmup_steps:
                self._mark(trainer, "start")

        def on_train_batch_end(self, trainer: L.Trainer, *_: Any) -> None:
            if trainer.global_step == args.warmup_steps + args.steps:
                self._mark(trainer, "end")

    if comm == "ddp":
        strategy: Any = "ddp"
    else:
        settings = {
            "comm": comm,
            "global_sync_every": k,
            "comm_autotune_steps": args.autotune_steps if tune else 0,
            "telemetry": False,
            **SYNC_SETTINGS.get(name, {}),
        }
        typed, _ = typed_keywords(settings)  # the row's flat settings as the comm and profiling objects
        strategy = HeterogeneousStrategy(
            global_batch_size=job.total,
            speeds=[float(b) for b in job.batch_sizes],  # proportional allocation reproduces --batch-sizes exactly
            process_group_backend="gloo",
            **typed,
        )
    model = Module()
    window = Window()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=job.world // 2,
        num_nodes=2,
        strategy=strategy,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[window],
    )
    trainer.fit(model, loader)
    (t0, link0, bytes0), (t1, link1, bytes1) = window.marks["start"], window.marks["end"]
    params = sum(p.numel() for p in model.parameters())
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if comm == "ddp":
        model_bytes = float(flat_allreduce_traffic(grad_bytes, NODE_IDS)[1].sum())
    else:
        detected, sizes = trainer.strategy.node_ids, trainer.strategy.batch_sizes
        if detected != NODE_IDS or sizes != job.batch_sizes:
            raise RuntimeError(
                f"strategy found node ids {detected} / batch sizes {sizes}, expected {NODE_IDS} / {job.batch_sizes}"
            )
        model_bytes = (bytes1 - bytes0) / args.steps
    result = _result(
        job,
        model.net,
        name=name,
        comm=comm,
        global_sync_every=k,
        window=(t0, t1, link0, link1),
        inter_bytes_model=model_bytes,
        train_loss_last=float("nan"),
        steps=total_steps,
        reduction=window.marks["start_reduction"],
    )
    return result, params, grad_bytes


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    job = _Job(args)
    configs = [c for c in CONFIGS if not args.only or c[0] in args.only]
    runs: dict[str, list[Result]] = {name: [] for name, *_ in configs}
    params = grad_bytes = 0
    for _ in range(args.repeat):  # round robin, so slow drifts of the machine's load hit every configuration alike
        for name, comm, k, tune in configs:
            run = _run_config_lightning if args.runner == "lightning" else _run_config
            result, params, grad_bytes = run(job, name, comm, k, tune)
            runs[name].append(result)
            if job.rank == 0:
                print(json.dumps(asdict(result)), flush=True)
    results = []
    for rs in runs.values():
        times = [r.step_time_s for r in rs]
        measured = [r.inter_bytes_measured for r in rs if r.inter_bytes_measured is not None]
        merged = rs[0]
        merged.step_time_s = statistics.median(times)
        merged.step_time_runs = times
        merged.inter_bytes_measured = statistics.mean(measured) if measured else None
        results.append(asdict(merged))
    if job.rank == 0:
        payload = {
            "results": results,
            "params": params,
            "grad_bytes": grad_bytes,
            "batch_sizes": job.batch_sizes,
            "timed_steps": args.steps,
            "warmup_steps": args.warmup_steps,
            "argv": sys.argv[1:],
        }
        (Path(args.out) / "results.json").write_text(json.dumps(payload, indent=2))
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------- CLI
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="localhost, no namespaces, tiny model (< 60 s)")
    p.add_argument("--rate", default="1gbit", help="tc rate of the inter-node link, or 'none' to leave it unshaped")
    p.add_argument("--delay-ms", type=float, default=0.5, help="one-way netem delay if the kernel has sch_netem")
    p.add_argument("--steps", type=int, default=None, help="timed steps per configuration (default 32; tiny 6)")
    p.add_argument("--warmup-steps", type=int, default=None, help="untimed steps first (default 12; tiny 3)")
    p.add_argument(
        "--autotune-steps",
        type=int,
        default=None,
        help="comm_autotune_steps of the 'hierarchical' row (default 5; tiny 1); keep 2x+1 <= --warmup-steps",
    )
    p.add_argument("--features", type=int, default=None, help="input width (default 1024; tiny 32)")
    p.add_argument("--hidden", type=int, default=None, help="hidden width (default 2048; tiny 64)")
    p.add_argument("--layers", type=int, default=3, help="hidden layers")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--batch-sizes", default="4,4,4,4", help="per-replica samples per step, ranks 0..3")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--signal", type=float, default=0.2, help="scale of the class means relative to unit noise")
    p.add_argument(
        "--bucket-view",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="DDP gradient_as_bucket_view (saves two gradient copies per step, for every configuration alike)",
    )
    p.add_argument(
        "--runner",
        choices=["lightning", "raw"],
        default="lightning",
        help="lightning: Trainer(strategy='ddp') vs HeterogeneousStrategy(comm=...); raw: DDP + comm algorithm",
    )
    p.add_argument("--repeat", type=int, default=1, help="run the configurations this many times; median step time")
    p.add_argument("--only", nargs="*", default=None, help="subset of configurations by name")
    p.add_argument("--out", default=str(REPO / "bench_results" / "comm"))
    p.add_argument("--plot", default=None, help="write a PNG plot here")
    p.add_argument("--report", default=None, help="only re-render table and plot from this results.json")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before the workers are killed")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--ifname", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    tiny = args.tiny
    defaults = {
        "steps": (6, 32),
        "warmup_steps": (3, 12),
        "autotune_steps": (1, 5),
        "features": (32, 1024),
        "hidden": (64, 2048),
    }
    for key, (small, big) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, small if tiny else big)
    if args.rate.lower() == "none":
        args.rate = None
    sizes = args.batch_sizes.split(",")
    if len(sizes) != len(NODE_IDS) or not all(b.isdigit() and int(b) > 0 for b in sizes):
        p.error(f"--batch-sizes needs {len(NODE_IDS)} positive integers (ranks 0..3), got {args.batch_sizes!r}")
    if args.steps < 1 or args.warmup_steps < 0 or args.repeat < 1 or args.autotune_steps < 0:
        p.error("--steps and --repeat must be >= 1, --warmup-steps and --autotune-steps >= 0")
    # what every worker needs to rebuild the same configuration
    args.passthrough = [
        "--steps", str(args.steps), "--warmup-steps", str(args.warmup_steps), "--features", str(args.features),
        "--autotune-steps", str(args.autotune_steps),
        "--hidden", str(args.hidden), "--layers", str(args.layers), "--classes", str(args.classes),
        "--batch-sizes", args.batch_sizes, "--lr", str(args.lr), "--signal", str(args.signal),
        "--out", str(Path(args.out).resolve()),
        "--bucket-view" if args.bucket_view else "--no-bucket-view", "--repeat", str(args.repeat),
        "--runner", args.runner,
    ]  # fmt: skip
    if args.only:
        args.passthrough += ["--only", *args.only]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.report:
        path = Path(args.report)
        report(json.loads(path.read_text()), path.parent, args.plot)
        return 0
    if not args.tiny and os.geteuid() != 0:
        print("bench_comm.py needs root for network namespaces; use --tiny for a localhost run", file=sys.stderr)
        return 2
    orchestrate(args)
    print("command: python scripts/bench_comm.py " + " ".join(sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
