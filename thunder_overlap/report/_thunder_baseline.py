"""The baseline every report compares with: the traces Thunder's own FSDP produces.

:func:`trace_thunder_fsdp` is the one place that traces a model the way Thunder does:
``thunder.distributed.fsdp(thunder.jit(model))`` on the meta device, with the same world size
and sharding type as thunder_overlap's module. No bucketing is asked for: Thunder 0.2.6 stores
its bucketing strategy and never reads it, and its ZeRO3 traces equal its ZeRO2 traces (the
unsharded parameters are saved for backward, which re-gathers nothing). The report, the demo's
prediction and the policy table all take their Thunder rows from it.

:func:`thunder_fsdp_traces_of` does it for a module that thunder_overlap already sharded: it
rebuilds the module on the meta device with its unsharded parameter shapes, and the call's
inputs from the shapes the module's prologue checks. :func:`thunder_fsdp_baseline` is what the
report and the policy comparison call: that, or the module's own traces when thunder_overlap
did not schedule it. Under hybrid sharding the baseline is Thunder's FSDP over the whole world,
the one way Thunder runs that job.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import thunder
import torch
import torch.distributed as dist
from thunder.core import dtypes, prims
from thunder.core.proxies import NumberProxy, Proxy, TensorProxy
from thunder.core.trace import TraceCtx
from thunder.distributed.transforms.fsdp_v2 import FSDPTransform
from torch import nn

from thunder_overlap._analysis.classify import find_swallowed_collectives
from thunder_overlap._transforms.in_place import full_shapes
from thunder_overlap._transforms.shardable import SHARDED_MARK
from thunder_overlap.options import ShardingStrategy, parse_sharding_strategy

__all__ = [
    "THUNDER_LABEL",
    "ThunderFSDPTraces",
    "fake_process_group",
    "thunder_fsdp_baseline",
    "thunder_fsdp_traces_of",
    "trace_thunder_fsdp",
    "world_size_of",
]

# The report's name for Thunder's own FSDP, with the version whose behaviour it describes.
THUNDER_LABEL = f"thunder {thunder.__version__}"
# What thunder.distributed.fsdp (and thunder_overlap.fsdp's mark) sets on the module it shards;
# a rebuilt twin must not carry them.
_FSDP_MODULE_ATTRIBUTES = ("use_fsdp", "process_group_for_ddp", "bucketing_strategy", "sharding_strategy", SHARDED_MARK)


@dataclass(frozen=True)
class ThunderFSDPTraces:
    """The final forward and backward execution traces of Thunder's own FSDP for one model."""

    forward: TraceCtx = field(repr=False)
    backward: TraceCtx | None = field(repr=False)
    world_size: int
    sharding: ShardingStrategy


@contextmanager
def _math_attention() -> Iterator[None]:
    # Thunder's SDPA executor asks CUDA whether flash/memory-efficient attention fits the inputs,
    # which fails on meta tensors (and on machines without a driver); the math path needs nothing.
    flags = torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled()
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    try:
        yield
    finally:
        torch.backends.cuda.enable_flash_sdp(flags[0])
        torch.backends.cuda.enable_mem_efficient_sdp(flags[1])


@contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """Rank 0 of ``world_size`` ranks of PyTorch's ``fake`` backend as the default group, with
    math attention, for tracing meta models; refuses to run beside a live default group."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("tracing at any world size needs its own fake process group; call it where no process group is initialised")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        with _math_attention():
            yield
    finally:
        dist.destroy_process_group()


def trace_thunder_fsdp(model: nn.Module, *, world_size: int, sharding, args: tuple = (), kwargs: dict | None = None) -> ThunderFSDPTraces:
    """Traces ``model`` (on the meta device; it is sharded in place) with Thunder's own FSDP.

    Runs on a fake process group of ``world_size`` ranks, or on the default group when one is
    alive (then its size must be ``world_size``, and with a real backend every rank must call
    this: Thunder's FSDP creates a process group). ``args``/``kwargs`` are the call's inputs,
    on the meta device.
    """
    sharding = parse_sharding_strategy(sharding)
    if dist.is_initialized() and dist.get_world_size() != world_size:
        raise ValueError(f"the live default process group has {dist.get_world_size()} ranks, not {world_size}")
    group = nullcontext() if dist.is_initialized() else fake_process_group(world_size)
    with group, _math_attention():
        jm = thunder.distributed.fsdp(thunder.jit(model), device=torch.device("meta"), sharding_strategy=sharding.thunder_type)
        thunder.compile_data(jm).get_computation_and_inputs(*args, **(kwargs or {}))
    forward, backward = thunder.last_traces(jm)[-1], thunder.last_backward_traces(jm)
    backward = backward[-1] if backward else None
    swallowed = [name for t in (forward, backward) if t is not None for name in find_swallowed_collectives(t)]
    if swallowed:
        raise RuntimeError(f"Thunder's FSDP trace hides collectives inside {swallowed}; the baseline cannot be simulated")
    return ThunderFSDPTraces(forward, backward, world_size, sharding)


def _fsdp_transform(jm) -> FSDPTransform | None:
    return next((t for t in thunder.compile_data(jm).transforms if isinstance(t, FSDPTransform)), None)


def _meta_twin(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers are meta tensors of their shapes.

    Taken while the original module holds its full-shaped placeholders (``full_shapes``: between
    calls it holds the shards), so the copy has the model's full shapes.
    Tied parameters stay tied: the copy maps each tensor once.
    """
    memo: dict[int, object] = {}
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = torch.empty(b.shape, dtype=b.dtype, device="meta")
    for name in _FSDP_MODULE_ATTRIBUTES:  # a process group cannot be deep-copied; dropped below
        if name in module.__dict__:
            memo[id(module.__dict__[name])] = None
    twin = copy.deepcopy(module, memo)
    for name in _FSDP_MODULE_ATTRIBUTES:
        twin.__dict__.pop(name, None)
    return twin


def _meta_value(value):
    if isinstance(value, TensorProxy):
        torch_dtype = dtypes.to_torch_dtype(value.dtype)
        return torch.empty(tuple(int(s) for s in value.shape), dtype=torch_dtype, device="meta", requires_grad=value.requires_grad)
    if isinstance(value, NumberProxy):
        return value.value
    if isinstance(value, Proxy):
        raise ValueError(f"cannot rebuild an input of type {type(value).__name__} for Thunder's baseline; pass thunder_fsdp= to report()")
    return value


def _inputs_of(prologue: TraceCtx) -> tuple[tuple, dict]:
    """The last call's positional and keyword inputs, as meta tensors of the shapes the
    prologue checks (top-level tensors and numbers only)."""
    unpacked = [b for b in prologue.bound_symbols if b.sym.id is prims.PrimIDs.UNPACK_TRIVIAL]
    containers = {b.output.name: b.output for b in unpacked if isinstance(b.output, Proxy)}
    positional: dict[int, object] = {}
    keyword: dict[str, object] = {}
    for b in prologue.bound_symbols:
        if b.sym.id is not prims.PrimIDs.UNPACK_GETITEM or not isinstance(b.args[0], Proxy):
            continue
        container, key = b.args[0].name, b.args[1]
        if container == "args" and "args" in containers:
            positional[key] = _meta_value(b.output)
        elif container == "kwargs" and "kwargs" in containers:
            keyword[key] = _meta_value(b.output)
    if sorted(positional) != list(range(len(positional))):
        raise ValueError(f"cannot rebuild the call's positional inputs {sorted(positional)}; pass thunder_fsdp= to report()")
    return tuple(positional[i] for i in range(len(positional))), keyword


def thunder_fsdp_traces_of(jm) -> ThunderFSDPTraces | None:
    """Thunder's own FSDP traces for what ``jm`` (a thunder_overlap FSDP module, run or traced
    once) computes; None when ``jm`` is not sharded by FSDP."""
    transform = _fsdp_transform(jm)
    prologues = thunder.last_prologue_traces(jm)
    if transform is None or not prologues:
        return None
    args, kwargs = _inputs_of(prologues[-1])
    sharding = ShardingStrategy(transform.sharding_strategy.name.lower())
    with full_shapes(jm):  # the original module holds the shards between calls
        twin = _meta_twin(jm._model)
    return trace_thunder_fsdp(twin, world_size=_world_size_of(jm, transform), sharding=sharding, args=args, kwargs=kwargs)


def world_size_of(jm) -> int:
    """The ranks ``jm``'s job runs on (1 where it is not sharded by FSDP), as its baseline counts them."""
    transform = _fsdp_transform(jm)
    return _world_size_of(jm, transform) if transform is not None else 1


def _world_size_of(jm, transform: FSDPTransform) -> int:
    """The ranks ``jm`` runs on: its FSDP group's, or under hybrid sharding the whole mesh's
    (Thunder 0.2.6 has no hybrid sharding: its baseline shards over every rank)."""
    from thunder_overlap._transforms import ReplicaReduceTransform

    hybrid = ReplicaReduceTransform.of(jm)
    return hybrid.device_mesh.size() if hybrid is not None else transform.world_size


def thunder_fsdp_baseline(jm) -> ThunderFSDPTraces:
    """The baseline for ``jm`` (run or traced once): Thunder's own FSDP traced anew for a
    module thunder_overlap schedules, else ``jm``'s own last traces (a module of Thunder's FSDP,
    or one with no FSDP at all, is what Thunder runs)."""
    from thunder_overlap._transforms import OverlapScheduleTransform

    if OverlapScheduleTransform.of(jm) is not None:
        traced = thunder_fsdp_traces_of(jm)
        if traced is not None:
            return traced
    forward, backward = thunder.last_traces(jm), thunder.last_backward_traces(jm)
    if not forward:
        raise ValueError("the module has not been run or traced yet: call it once (or trace it) first")
    transform = _fsdp_transform(jm)
    sharding = ShardingStrategy(transform.sharding_strategy.name.lower()) if transform is not None else ShardingStrategy.ZERO2
    return ThunderFSDPTraces(forward[-1], backward[-1] if backward else None, world_size_of(jm), sharding)
