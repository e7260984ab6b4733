"""The implementations the benchmark compares, each turned into a callable training step.

Training implementations (same model, data, optimizer and initialisation scheme):

- ``thunder_overlap``: :func:`thunder_overlap.fsdp` (scheduled for ``--network`` when given).
- ``thunder_overlap_uncoalesced``: the same with every collective launched on its own
  (``OverlapConfig(_tuning=Tuning(coalesce=False))``), to measure what coalesced launches save.
- ``thunder_overlap_two_ahead``: the same with buckets prefetched two ahead, as eagerly as
  per-parameter all-gathers (``OverlapConfig(_tuning=Tuning(bucket_eager_prefetch_blocks=None))``), to measure
  what the second bucket in flight buys.
- ``thunder_overlap_own_shards``: the same with every gradient shard in a buffer of its own
  (``OverlapConfig(reduce_in_pool=False)``), to measure what reducing in idle pool buffers costs.
- ``thunder_overlap_laid_out``: the same with no bucket gathered per parameter or
  reduce-scattered from gloo's copy of its lay-out over gloo
  (``OverlapConfig(_tuning=Tuning(per_tensor_gather_max_slowdown=None, reduce_from_copy_max_slowdown=None))``),
  to measure what those paths cost.
- ``thunder_overlap_two_lay_outs``: the same with reduce-scatters that hold a pool buffer to
  their wait capped by reduce-scatter bytes alone (``OverlapConfig(_tuning=Tuning(bucket_reduce_scatter_blocks=None))``),
  to measure what capping them at one block costs.
- ``thunder_overlap_regather_all``: ZeRO3 re-gathering every parameter in the backward, none of
  what it needs first kept from the forward where that costs no memory
  (``OverlapConfig(_tuning=Tuning(zero3_keeps_free_units=False))``), to measure what keeping them saves.
- ``thunder``: Thunder's own ``thunder.distributed.fsdp(thunder.jit(model))``.
- ``fsdp2``: PyTorch ``fully_shard`` on every transformer block, then on the root (eager);
  ZeRO3 is ``reshard_after_forward=True``, ZeRO2 ``False``.
- ``fsdp2_compile``: the same with every block ``torch.compile``'d before sharding (torchtitan's way).
- ``hand_prefetch``: a hand-written ZeRO2 loop in eager PyTorch, each block's flat buffer gathered
  one block ahead and reduce-scattered as its gradients are ready (:mod:`fsdp_bench.hand_loop`).

Calibration runs of the slow-link testbed:

- ``compute_only`` (C): ``thunder.jit`` of the unsharded model on every rank, no communication
  at all: each rank does FSDP's per-rank forward and backward. Its optimizer steps the full
  model instead of a 1/world_size shard; the step reports the optimizer time separately
  (``optimizer_ms``) so the testbed can take the difference out.
- ``comm_only`` (M): thunder_overlap's collectives for this shard mode and bucketing strategy,
  replayed in trace order with no compute (:mod:`fsdp_bench.comm_replay`).
- ``compute_with_comm``: both of the above at once, with no dependency between them (the replay
  on a second thread). No schedule can beat it: it measures what overlapping costs on this
  machine (on one core per rank, the communication's CPU work is taken from the compute).
"""

from __future__ import annotations

import copy
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import thunder
import torch
import torch.nn as nn
from thunder.core.module import ThunderModule

import thunder_overlap
from thunder_overlap._analysis.blocks import find_blocks
from thunder_overlap._analysis.cost_model import CostModel, network_profile
from thunder_overlap._transforms.activation_checkpointing import checkpoint_blocks
from thunder_overlap.options import parse_bucketing_strategy, parse_sharding_strategy

from fsdp_bench.bench_config import OVERLAP_OPTIONS, BenchmarkConfig, variant_config
from fsdp_bench.bench_models import loss_fn, materialize
from fsdp_bench.comm_replay import CommReplay
from fsdp_bench.distributed import RunContext
from fsdp_bench.hand_loop import HandPrefetchZero2
from fsdp_bench.profiling import nvtx_range

__all__ = ["Step", "ModelStep", "ConcurrentStep", "make_step", "jit_options"]

# Thunder's benchmark_litgpt.py optimizer settings.
_LEARNING_RATE = 5e-4
_WEIGHT_DECAY = 0.1
_BETAS = (0.9, 0.95)

Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class ModelStep:
    """Forward, backward and optimizer step of one micro-batch, each in its own NVTX range.

    ``optimizer_ms`` accumulates the optimizer's wall time (meaningful on CPU, where it is
    synchronous; the testbed uses it to size the compute-only calibration)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    nvtx: bool = False
    optimizer_ms: list[float] = field(default_factory=list)
    # Clips the gradient by its global norm between backward and optimizer (--max_norm).
    clip: Callable[[], object] | None = None

    def __call__(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with nvtx_range("forward", self.nvtx):
            loss = loss_fn(self.model(idx), targets)
        with nvtx_range("backward", self.nvtx):
            loss.backward()
        if self.clip is not None:
            with nvtx_range("clip", self.nvtx):
                self.clip()
        with nvtx_range("optimizer", self.nvtx):
            start = time.perf_counter()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.optimizer_ms.append((time.perf_counter() - start) * 1e3)
        return loss.detach()


@dataclass
class ConcurrentStep:
    """``compute``'s step on this thread while ``comm`` replays its collectives on another."""

    compute: ModelStep
    comm: CommReplay
    _thread: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(max_workers=1))

    @property
    def optimizer_ms(self) -> list[float]:
        return self.compute.optimizer_ms

    def __call__(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        replay = self._thread.submit(self.comm, idx, targets)
        loss = self.compute(idx, targets)
        replay.result()
        return loss


def _clip(model: nn.Module, cfg: BenchmarkConfig) -> Callable[[], object] | None:
    """Clipping by the global norm for ``--max_norm``: thunder_overlap's over its shards; FSDP2's
    parameters are DTensors, whose norm torch.nn.utils.clip_grad_norm_ reduces over the mesh, and
    compute_only's are whole."""
    if cfg.max_norm is None:
        return None
    if isinstance(model, ThunderModule) and cfg.impl.startswith("thunder_overlap"):
        return lambda: thunder_overlap.clip_grad_norm_(model, cfg.max_norm)
    return lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_norm)


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=_LEARNING_RATE, weight_decay=_WEIGHT_DECAY, betas=_BETAS)


def overlap_config(cfg: BenchmarkConfig, device: torch.device, impl: str = "thunder_overlap") -> thunder_overlap.OverlapConfig:
    """The options of thunder_overlap variant ``impl`` (``OVERLAP_OPTIONS``) for ``cfg``: its
    default cost model for ``device``, over ``cfg.network`` when one is given (the testbed names
    its link, which no default knows)."""
    cost_model = None
    if cfg.network is not None:
        cost_model = CostModel(CostModel.for_device(device, 1).device, network_profile(cfg.network))
    config = variant_config(impl, cost_model)
    return config if cfg.memory_budget_bytes is None else replace(config, memory_budget_bytes=cfg.memory_budget_bytes)


def jit_options(executors: str) -> dict[str, object]:
    """``thunder.jit``'s options for ``--executors`` (``EXECUTORS``): none for Thunder's defaults."""
    if executors == "default":
        return {}
    from thunder.executors.torch_compile import torch_compile_ex

    if executors == "torchcompile":
        return {"executors": [torch_compile_ex]}
    return {"executors": [torch_compile_ex, *thunder.get_default_executors()]}


def _thunder_overlap(model: nn.Module, cfg: BenchmarkConfig, ctx: RunContext, impl: str = "thunder_overlap") -> nn.Module:
    policy = thunder_overlap.MixedPrecision(torch.bfloat16, torch.float32) if cfg.mixed_precision else None
    return thunder_overlap.fsdp(
        model,
        device=ctx.device,
        sharding_strategy=cfg.shard_mode,
        bucketing_strategy=cfg.bucketing_mode,
        config=overlap_config(cfg, ctx.device, impl),
        mixed_precision=policy,
        activation_checkpointing=cfg.activation_checkpointing,
        jit_options=jit_options(cfg.executors),
    )


def _thunder(model: nn.Module, cfg: BenchmarkConfig, ctx: RunContext) -> nn.Module:
    return thunder.distributed.fsdp(
        thunder.jit(model),
        device=ctx.device,
        sharding_strategy=parse_sharding_strategy(cfg.shard_mode).thunder_type,
        bucketing_strategy=parse_bucketing_strategy(cfg.bucketing_mode).thunder_type,
    )


def _fsdp2(model: nn.Module, cfg: BenchmarkConfig, ctx: RunContext, *, compile_blocks: bool) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if cfg.bucketing_mode != "none":
        warnings.warn(
            f"fsdp2 communicates per fully_shard unit (one block); --bucketing_mode={cfg.bucketing_mode} is ignored", stacklevel=2
        )
    blocks = find_blocks(model)
    if not blocks:
        raise ValueError(f"--model_name={cfg.model_name!r} has no repeated blocks (nn.ModuleList) to fully_shard")
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    options = {"mesh": mesh, "reshard_after_forward": cfg.shard_mode == "zero3"}
    if cfg.mixed_precision:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for _, block in blocks:
        if compile_blocks:
            block.compile()
        fully_shard(block, **options)
    fully_shard(model, **options)
    return materialize(model, ctx.device)


def _hand_prefetch(model: nn.Module, cfg: BenchmarkConfig, ctx: RunContext) -> nn.Module:
    if cfg.bucketing_mode != "block":
        warnings.warn(
            f"hand_prefetch communicates one flat buffer per block; --bucketing_mode={cfg.bucketing_mode} is ignored", stacklevel=2
        )
    return HandPrefetchZero2(materialize(model, ctx.device))


def _compute_only(model: nn.Module, cfg: BenchmarkConfig, ctx: RunContext) -> nn.Module:
    # With mixed precision a rank computes on bf16 parameters: a bf16 copy computes the same.
    model = materialize(model, ctx.device)
    if cfg.activation_checkpointing:
        checkpoint_blocks(model, find_blocks(model))
    return thunder.jit(model.to(torch.bfloat16) if cfg.mixed_precision else model, **jit_options(cfg.executors))


_SHARDERS: dict[str, Callable[[nn.Module, BenchmarkConfig, RunContext], nn.Module]] = {
    **{impl: lambda m, cfg, ctx, impl=impl: _thunder_overlap(m, cfg, ctx, impl) for impl in OVERLAP_OPTIONS},
    "thunder": _thunder,
    "fsdp2": lambda m, cfg, ctx: _fsdp2(m, cfg, ctx, compile_blocks=False),
    "fsdp2_compile": lambda m, cfg, ctx: _fsdp2(m, cfg, ctx, compile_blocks=True),
    "hand_prefetch": _hand_prefetch,
    "compute_only": _compute_only,
    # Sharded like thunder_overlap; make_step then swaps the training step for the replay.
    "comm_only": _thunder_overlap,
    # Jitted unsharded like compute_only; make_step adds the replay of a sharded copy.
    "compute_with_comm": _compute_only,
}


def _comm_replay(model: ThunderModule, sample: tuple[torch.Tensor, torch.Tensor], ctx: RunContext) -> CommReplay:
    """Runs one untimed forward+backward so thunder_overlap produces its traces, then replays them."""
    loss_fn(model(sample[0]), sample[1]).backward()
    model.zero_grad(set_to_none=True)
    traces = [thunder.last_traces(model)[-1], thunder.last_backward_traces(model)[-1]]
    return CommReplay(traces, ctx.device)


def make_step(model: nn.Module, cfg: BenchmarkConfig, ctx: RunContext, sample: tuple[torch.Tensor, torch.Tensor]) -> tuple[nn.Module, Step]:
    """Shards (or jits) the meta ``model`` for ``cfg.impl``; returns it and its training step.
    ``sample`` is one batch, used by ``comm_only`` to produce the traces it replays."""
    if cfg.impl == "compute_with_comm":
        replay = _comm_replay(_thunder_overlap(copy.deepcopy(model), cfg, ctx), sample, ctx)
        compute = _compute_only(model, cfg, ctx)
        return compute, ConcurrentStep(ModelStep(compute, _optimizer(compute), nvtx=ctx.is_cuda, clip=_clip(compute, cfg)), replay)
    sharded = _SHARDERS[cfg.impl](model, cfg, ctx)
    if cfg.impl == "comm_only":
        return sharded, _comm_replay(sharded, sample, ctx)
    return sharded, ModelStep(sharded, _optimizer(sharded), nvtx=ctx.is_cuda, clip=_clip(sharded, cfg))
