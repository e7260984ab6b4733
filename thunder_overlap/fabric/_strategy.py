"""``FSDPOverlapStrategy``: Lightning Fabric's strategy over :func:`thunder_overlap.fsdp`.

Fabric owns the processes and the loop; this strategy starts the process group, shards the module
with ``fsdp()`` in ``setup_module`` and routes Fabric's clipping, ``no_backward_sync`` and
checkpoints to thunder_overlap's sharded versions. See [Note: Fabric strategy] in docs/design.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, ExitStack, nullcontext
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn as nn
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.strategies.strategy import TBroadcast, _BackwardSyncControl
from lightning.fabric.utilities.distributed import _init_dist_connection, _sync_ddp_if_available
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.fabric.utilities.seed import reset_seed
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from thunder.core.module import ThunderModule
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.optim import Optimizer

from thunder_overlap.api import fsdp
from thunder_overlap.clip_grad import clip_grad_norm_, clip_grad_value_
from thunder_overlap.config import OverlapConfig
from thunder_overlap.fabric import _checkpoint
from thunder_overlap.fabric._precision import resolve_precision
from thunder_overlap.options import (
    BucketingStrategy,
    MixedPrecision,
    ShardingStrategy,
    parse_bucketing_strategy,
    parse_sharding_strategy,
)

__all__ = ["FSDPOverlapStrategy"]

STATE_DICT_TYPES = ("sharded", "full")


class FSDPOverlapStrategy(ParallelStrategy):
    """Fabric's strategy for thunder_overlap's FSDP: ``Fabric(strategy=FSDPOverlapStrategy(...))``,
    or ``Fabric(strategy="thunder_overlap")`` for the defaults.

    Args:
        sharding_strategy: ``"zero2"``, ``"zero3"`` or ``"auto"`` (as :func:`thunder_overlap.fsdp`).
        bucketing_strategy: ``"none"``, ``"layer"``, ``"block"`` or ``"auto"``.
        mixed_precision: a :class:`~thunder_overlap.MixedPrecision`; or leave it None and pass
            ``Fabric(precision="bf16-mixed")``, which means ``MixedPrecision(torch.bfloat16, torch.float32)``.
        config: scheduler options (:class:`~thunder_overlap.OverlapConfig`).
        block_types: the block classes (or class names, such as litgpt's ``"Block"``).
        activation_checkpointing: True: every block recomputes its activations in the backward
            (as :func:`thunder_overlap.fsdp`'s ``activation_checkpointing``).
        jit_options: keywords for ``thunder.jit`` (a module not yet jitted).
        state_dict_type: how ``fabric.save`` writes: ``"sharded"`` (a directory every rank writes,
            loadable at any world size) or ``"full"`` (one ``torch.load``-able file of the
            original parameter names and shapes, written by rank 0). ``fabric.load`` reads either.
        hybrid_sharding: with ``num_nodes > 1``, shard within each node and replicate across
            nodes (HSDP) instead of sharding over every rank.

    Fabric's ``precision`` may be ``"32-true"``, ``"bf16-true"`` or ``"bf16-mixed"``.
    """

    def __init__(
        self,
        sharding_strategy: ShardingStrategy | str = "zero3",
        bucketing_strategy: BucketingStrategy | str = "block",
        mixed_precision: MixedPrecision | None = None,
        config: OverlapConfig | None = None,
        block_types: type[nn.Module] | str | list[type[nn.Module] | str] | tuple[type[nn.Module] | str, ...] | None = None,
        activation_checkpointing: bool = False,
        jit_options: Mapping[str, Any] | None = None,
        state_dict_type: Literal["sharded", "full"] = "sharded",
        hybrid_sharding: bool = False,
    ) -> None:
        # Checked here, where the strategy is built: before Fabric starts any process.
        self._sharding = parse_sharding_strategy(sharding_strategy)
        self._bucketing = parse_bucketing_strategy(bucketing_strategy)
        if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
            raise TypeError(f"mixed_precision must be a thunder_overlap.MixedPrecision or None, got {mixed_precision!r}")
        if config is not None and not isinstance(config, OverlapConfig):
            raise TypeError(f"config must be a thunder_overlap.OverlapConfig or None, got {config!r}")
        if not isinstance(activation_checkpointing, bool):
            raise TypeError(f"activation_checkpointing must be a bool, got {activation_checkpointing!r}")
        if jit_options is not None and not isinstance(jit_options, Mapping):
            raise TypeError(f"jit_options must be a dict of thunder.jit keywords or None, got {jit_options!r}")
        if state_dict_type not in STATE_DICT_TYPES:
            raise ValueError(f"state_dict_type must be one of {', '.join(map(repr, STATE_DICT_TYPES))}, got {state_dict_type!r}")
        if not isinstance(hybrid_sharding, bool):
            raise TypeError(f"hybrid_sharding must be a bool, got {hybrid_sharding!r}")
        self._mixed_precision = mixed_precision
        self._config = config
        self._block_types = block_types
        self._activation_checkpointing = activation_checkpointing
        self._jit_options = dict(jit_options or {})
        self._state_dict_type = state_dict_type
        self._hybrid_sharding = hybrid_sharding
        self._num_nodes = 1
        self._device_mesh: DeviceMesh | None = None
        super().__init__()
        self._backward_sync_control = _NoBackwardSync(self._bucketing)

    # --- what Fabric sets and reads ---------------------------------------------------------------

    @property
    def precision(self) -> Precision:
        return self._precision if self._precision is not None else Precision()

    @precision.setter
    def precision(self, precision: Precision | None) -> None:
        """Fabric sets its plugin here, when ``Fabric(...)`` is built: an unsupported one fails there."""
        if precision is None:
            self._precision = None
            return
        self._precision, self._mixed_precision = resolve_precision(precision, self._mixed_precision)

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def state_dict_type(self) -> str:
        return self._state_dict_type

    # --- processes ----------------------------------------------------------------------------------

    def _configure_launcher(self) -> None:
        """Fabric calls this when it is built, once the number of nodes is known."""
        assert self.cluster_environment is not None
        if self._hybrid_sharding and self.num_nodes < 2:
            raise ValueError(f"hybrid_sharding=True replicates across nodes and needs num_nodes > 1, got num_nodes={self.num_nodes}")
        if not self.cluster_environment.creates_processes_externally:  # else torchrun or a cluster did
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self._set_world_ranks()
        assert self.cluster_environment is not None
        backend = "nccl" if self.root_device.type == "cuda" else "gloo"
        _init_dist_connection(self.cluster_environment, backend, timeout=default_pg_timeout)
        if self._hybrid_sharding:
            self._device_mesh = init_device_mesh(
                self.root_device.type, (self.num_nodes, self.num_processes), mesh_dim_names=("replicate", "shard")
            )

    def _set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    # --- the model and its optimizers -----------------------------------------------------------

    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """``empty_init=True`` builds on the meta device: ``fsdp()`` then allocates and initialises
        only this rank's shards, the same on every rank (the same seed: ``fabric.seed_everything``)."""
        stack = ExitStack()
        stack.enter_context(torch.device("meta") if empty_init else self.root_device)
        stack.enter_context(self.precision.module_init_context())
        return stack

    def module_to_device(self, module: nn.Module) -> None:
        """Nothing: ``setup_module`` places each rank's shards on its device."""

    def setup_module(self, module: nn.Module) -> ThunderModule:
        """Shards ``module`` with :func:`thunder_overlap.fsdp`; afterwards ``module``'s parameters
        are the returned module's shards (the same objects)."""
        return fsdp(
            module,
            device=self.root_device,
            sharding_strategy=self._sharding,
            bucketing_strategy=self._bucketing,
            config=self._config,
            block_types=self._block_types,
            device_mesh=self._device_mesh,
            mixed_precision=self._mixed_precision,
            activation_checkpointing=self._activation_checkpointing,
            jit_options=self._jit_options or None,
        )

    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any = None) -> tuple:
        """``fabric.setup(model, optimizer)``: optimizers built on the unsharded parameters are
        rebound to the shards, which they can be only before their first step."""
        names = {id(p): name for name, p in module.named_parameters(remove_duplicate=False)}
        for index, optimizer in enumerate(optimizers):
            _check_no_state(optimizer, index)
            _check_own_parameters(optimizer, index, names)
        sharded = self.setup_module(module)
        shards = dict(sharded.named_parameters(remove_duplicate=False))
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["params"] = [shards[names[id(p)]] for p in group["params"]]
        return sharded, optimizers, scheduler

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        return optimizer

    # --- training -------------------------------------------------------------------------------------

    def clip_gradients_norm(
        self, module: nn.Module, optimizer: Optimizer, max_norm: float | int, norm_type: float | int = 2.0, error_if_nonfinite: bool = True
    ) -> torch.Tensor:
        """The whole model's norm over its shards (:func:`thunder_overlap.clip_grad_norm_`)."""
        self.precision.unscale_gradients(optimizer)
        return clip_grad_norm_(module, max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite)

    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: float | int) -> None:
        self.precision.unscale_gradients(optimizer)
        clip_grad_value_(module, clip_val)

    def all_reduce(self, tensor: torch.Tensor, group: Any = None, reduce_op: str | dist.ReduceOp | None = "mean") -> torch.Tensor:
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not dist.is_available() or not dist.is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not dist.is_available() or not dist.is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    # --- checkpoints ------------------------------------------------------------------------------

    def save_checkpoint(
        self,
        path: str | Path,
        state: dict[str, nn.Module | Optimizer | Any],
        storage_options: Any = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """``fabric.save``: through :mod:`thunder_overlap.checkpoint` (``state_dict_type``)."""
        if storage_options is not None:
            raise TypeError("FSDPOverlapStrategy.save_checkpoint takes no storage_options: it writes with thunder_overlap.checkpoint")
        if filter is not None:
            raise ValueError("fabric.save(..., filter=...) is not supported by FSDPOverlapStrategy: save the whole state")
        path = Path(self.broadcast(str(path)))
        _checkpoint.save(path, state, full=self._state_dict_type == "full")

    def load_checkpoint(
        self,
        path: str | Path,
        state: nn.Module | Optimizer | dict[str, nn.Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """``fabric.load``: a sharded directory (any world size) or a full file, whichever ``path`` is."""
        path = Path(self.broadcast(str(path)))
        return _checkpoint.load(path, state, strict=strict, weights_only=weights_only)

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(
            "thunder_overlap", cls, description="thunder_overlap's FSDP for Thunder (ZeRO3, block buckets, overlapped)"
        )


class _NoBackwardSync(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: thunder_overlap's ``no_sync`` (gradients summed in the buckets)."""

    def __init__(self, bucketing: BucketingStrategy) -> None:
        self._bucketing = bucketing

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        if not enabled:
            return nullcontext()
        if not isinstance(module, ThunderModule):
            raise TypeError(f"fabric.no_backward_sync takes the model fabric.setup_module returned, got {type(module).__name__}")
        if not self._bucketing.has_buckets:
            raise ValueError(
                "fabric.no_backward_sync needs bucketing_strategy 'layer', 'block' or 'auto' (the strategy has 'none'): "
                "thunder_overlap sums unreduced gradients in the bucket buffers; or accumulate by calling fabric.backward "
                "on each micro-batch outside no_backward_sync"
            )
        return module.no_sync()


def _check_no_state(optimizer: Optimizer, index: int) -> None:
    if optimizer.state:
        raise ValueError(
            f"optimizer {index} ({type(optimizer).__name__}) already has state for {len(optimizer.state)} parameters: "
            "its state is of the unsharded parameters, which fabric.setup shards. Set up the model and optimizer before "
            "the first optimizer step, or build the optimizer after fabric.setup_module(model)"
        )


def _check_own_parameters(optimizer: Optimizer, index: int, names: dict[int, str]) -> None:
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            if id(parameter) not in names:
                raise ValueError(
                    f"optimizer {index} ({type(optimizer).__name__}) holds a parameter of shape {tuple(parameter.shape)} that is "
                    "not one of the model's: pass the optimizer built on this model's parameters"
                )
