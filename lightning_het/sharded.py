"""``HeterogeneousFSDPStrategy``: Lightning's FSDP2 path (``ModelParallelStrategy``) with speed-proportional shares and
exact gradients; the parts of :class:`~lightning_het.HeterogeneousStrategy`, other glue (``docs/sharded.md``)."""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.optim import Optimizer
from typing_extensions import override

from lightning_het.arguments import ArgumentError
from lightning_het.config import Profiling, Reliability
from lightning_het.strategy import HeterogeneousStrategyMixin


class HeterogeneousFSDPStrategy(HeterogeneousStrategyMixin, ModelParallelStrategy):
    """FSDP2 whose replicas' shares of each global batch follow their speeds, each loss scaled by ``W * b_r / B`` (the
    exact gradient of the global batch). ``sharding``: ``"full"`` (one mesh dimension over every replica) or
    ``"hybrid"`` (replicate across nodes, shard inside a node; the default when the job spans several nodes)."""

    strategy_name = "heterogeneous_fsdp"
    _start_method = "popen"  # ModelParallelStrategy's script launcher (the launcher HeterogeneousParts wraps)

    def __init__(
        self,
        *,
        sharding: Literal["full", "hybrid"] | None = None,
        global_batch_size: int | None = None,
        speeds: Sequence[float] | None = None,
        min_batch_size: int = 1,
        max_batch_sizes: Sequence[int] | None = None,
        max_micro_batch_sizes: Sequence[int] | Literal["auto"] | None = None,
        node_ids: Sequence[int] | None = None,
        profiling: Profiling | None = None,
        reliability: Reliability | None = None,
        **kwargs: Any,
    ) -> None:
        if sharding not in (None, "full", "hybrid"):
            raise ArgumentError(
                "sharding", f"Expected `sharding` to be 'full', 'hybrid' or None, but got {sharding!r}."
            )
        for name in ("comm", "device_map", "cpu_threads", "data_parallel_size", "tensor_parallel_size"):
            if name in kwargs:
                raise ArgumentError(name, f"`{type(self).__name__}` does not take `{name}` (FSDP2 shards the model).")
        self._sharding, self._shard_mesh = sharding, None
        self._memory: list[dict[str, int]] | None = None  # each replica's shards after the fit's first step
        ours = ("global_batch_size", "speeds", "min_batch_size", "max_batch_sizes", "max_micro_batch_sizes", "node_ids")
        keywords = {k: v for k, v in locals().items() if k in (*ours, "profiling", "reliability")}
        super().__init__(**keywords, **kwargs)
        if sharding == "hybrid" and self.config.node_ids is not None:  # before any replica starts
            hybrid_groups(self.config.node_ids)

    @property
    def shard_mesh(self) -> DeviceMesh:
        """The mesh the model is sharded over: ``("shard",)`` or ``("replicate", "shard")`` (``"hybrid"``)."""
        if self._shard_mesh is None:
            raise RuntimeError("The shard mesh exists once the processes have started (`setup_environment`).")
        return self._shard_mesh

    @override
    def _configure_launcher(self) -> None:
        # what the mixin's launcher wraps where the processes exist already (Lightning's launcher: the others)
        env = self.cluster_environment
        self._launcher = SimpleNamespace(
            cluster_environment=env, num_processes=self.num_processes, num_nodes=self.num_nodes
        )
        super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        self._data_parallel_size, self._tensor_parallel_size = self.num_nodes * self.num_processes, 1
        super().setup_environment()  # the process group, Lightning's device mesh, the watchdog, this replica's node
        self._shard_mesh = self._mesh()
        module = self.lightning_module
        if not is_overridden("configure_model", module):  # the default `configure_model`: shard every layer
            module.configure_model = self._shard_module  # type: ignore[method-assign]

    def _mesh(self) -> DeviceMesh:
        ids = self._node_ids or [0] * self.world_size
        if (self._sharding or ("hybrid" if len(set(ids)) > 1 else "full")) == "full":
            return self.device_mesh["data_parallel"]
        return DeviceMesh(
            self.root_device.type, torch.tensor(hybrid_groups(ids)), mesh_dim_names=("replicate", "shard")
        )

    def _shard_module(self) -> None:
        """``fully_shard`` every module that holds parameters, then each child of the LightningModule (its roots)."""
        module = self.lightning_module
        if any(isinstance(m, FSDPModule) for m in module.modules()):
            return
        if next(module.parameters(recurse=False), None) is not None:
            raise ValueError(
                f"{type(module).__name__} holds parameters of its own (not in a submodule), which the default"
                " sharding cannot reach. HINT: move them into a submodule, or shard in `configure_model`."
            )
        for child in module.children():
            if next(child.parameters(), None) is None:
                continue
            for inner in reversed(list(child.modules())):  # the innermost first, as fully_shard requires
                if inner is not child and next(inner.parameters(recurse=False), None) is not None:
                    fully_shard(inner, mesh=self.shard_mesh)
            fully_shard(child, mesh=self.shard_mesh)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        fitting = self._start_setup(trainer)
        if fitting:
            self._memory = None
        self._shard_module()  # a `configure_model` that did not shard
        super(HeterogeneousStrategyMixin, self).setup(trainer)  # ModelParallelStrategy's: the optimizers on the shards
        self._model_ready(trainer)
        if fitting:
            self._resume_fit(trainer, "sharded")
        self._attach_guards(trainer, fitting, saves=False)  # no emergency checkpoint: a sharded save needs everyone

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        # micro-batches: the parameters stay gathered from the first piece's forward to the step's last backward, so
        # that replicas running different numbers of pieces run the same collectives
        self._keep_gathered(self.policy.micro is not None)
        return super().training_step(*args, **kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        self._keep_gathered(False)  # the step's last backward: reduce-scatter, then reshard
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    def _keep_gathered(self, keep: bool) -> None:
        if self.policy.micro is not None:
            for m in self._fsdp_modules():
                m.set_reshard_after_forward(not keep, recurse=False)
                m.set_reshard_after_backward(not keep, recurse=False)

    def _fsdp_modules(self) -> list[FSDPModule]:
        return [m for m in self.lightning_module.modules() if isinstance(m, FSDPModule)]

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """FSDP2's ``no_sync``: the gradients stay unsharded and local until the next backward that syncs."""
        modules = self._fsdp_modules()
        for m in modules:
            m.set_requires_gradient_sync(False, recurse=False)
        try:
            yield
        finally:
            for m in modules:
                m.set_requires_gradient_sync(True, recurse=False)

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._memory is None:  # the fit's first step: every replica's shards, optimizer state included
            held = sharded_memory(self.lightning_module, self.optimizers)
            self._memory = [
                dict(zip(held, map(int, row))) for row in self.policy.gather(list(map(float, held.values())))
            ]
        return output

    @override
    def balance_report(self, include_series: bool = False) -> dict[str, Any]:
        """As :class:`~lightning_het.HeterogeneousStrategy`'s, with ``"memory"``: each replica's bytes of parameters,
        gradients and optimizer state after the fit's first step."""
        return {**super().balance_report(include_series), "memory": self._memory}

    @override
    def balance_table(self) -> str:
        rows = [f"{r:4d} {m['params'] / 2**20:10.3f} {m['grads'] / 2**20:9.3f} {m['optimizer'] / 2**20:9.3f}"
                for r, m in enumerate(self._memory or [])]  # fmt: skip
        memory = ["rank params MiB grads MiB optim MiB", *rows] if rows else []
        return "\n".join([super().balance_table(), *memory])

    @override
    def teardown(self) -> None:
        module = getattr(self, "_lightning_module", None)
        if module is not None and vars(module).get("configure_model") == self._shard_module:
            del module.configure_model
        super().teardown()


def hybrid_groups(node_ids: Sequence[int]) -> list[list[int]]:
    """Each node's ranks: the rows of the ``("replicate", "shard")`` mesh (every node needs as many replicas)."""
    nodes = sorted(set(node_ids))
    groups = [[rank for rank, node in enumerate(node_ids) if node == n] for n in nodes]
    if len({len(group) for group in groups}) > 1:
        raise ValueError(
            f"`sharding='hybrid'` replicates the model across nodes and shards it inside each, so every node needs as"
            f" many replicas, but node_ids={list(node_ids)} puts {[len(g) for g in groups]} on the nodes {nodes}."
            " HINT: use `sharding='full'`."
        )
    return groups


def sharded_memory(module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> dict[str, int]:
    """Bytes this replica holds of the parameters, gradients and optimizer state (its shards)."""

    def local(t: torch.Tensor) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    params = list(module.parameters())
    states = [v for opt in optimizers for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {
        "params": sum(local(p) for p in params),
        "grads": sum(local(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(local(v) for v in states),
    }
