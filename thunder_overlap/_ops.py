"""The trace operators thunder_overlap adds, and the executor that owns them and Thunder's collectives.

Thunder's ``torchcompile`` executor can fuse every op the torch executor runs, collectives
included (on CPU, 0.2.6 fuses an all-gather with its wait), and then no scheduler can see or move
them. Claiming all-gather, reduce-scatter and wait here, ahead of the fusion executors, gives
them symbols no fusion executor knows (:func:`with_collectives_kept_visible`). Ahead of such an
executor, ``fsdp()`` also keeps matmuls and the gathered parameters' epilogues out of fusions, so
that it cannot fuse a whole pass into one region either ([Note: fusing executors]).

The operators, by who puts them in the traces:

- bucketing (``_bucketing/trace_rewrite.py``): ``bucket_all_gather`` / ``bucket_reduce_scatter``
  and their waits, ``bucket_accumulate_grads`` (no_sync). Their first argument is the bucket's
  runtime object (:class:`BucketRuntime`, ``_bucketing/buffers.py``), which the trace carries as
  a context object: the trace refers to the state it runs on, and no registry is needed;
- coalescing (``_scheduling/launches.py``): ``coalesced_*`` issue operators take the process
  group, then a tuple with one entry per member (what ``classify`` counts), then the inputs; one
  ``coalesced_wait`` completes them all and returns every member's outputs;
- hybrid sharding (``_transforms/replicate.py``): ``replica_all_reduce`` / ``bucket_all_reduce``
  and their waits;
- mixed precision (``_transforms/mixed_precision.py``): ``shard_cast``, the cast of a parameter
  shard before its all-gather.

Analysis recognises these operators, and Thunder's collectives, by their symbols' ids (the sets
at the end of this module), and reads their arguments; it never calls the runtime objects.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import thunder.torch as ltorch
import torch
import torch.distributed as dist
from thunder.core import prims
from thunder.core.dtypes import to_dtype, to_torch_dtype
from thunder.core.proxies import FutureTensorProxy, TensorProxy
from thunder.core.symbol import BoundSymbol, Symbol
from thunder.core.trace import TraceCtx, TraceProvenance, from_trace
from thunder.distributed import prims as dist_prims
from thunder.executors import pythonex, torchex
from thunder.extend import Executor, FusionExecutor, OperatorExecutor, register_executor
from thunder.torch import to_torch_distributed_reduce_op

__all__ = [
    "ALL_GATHER_ISSUES",
    "BUCKETED_ISSUES",
    "BUCKET_ISSUES",
    "COALESCED_ISSUES",
    "DROPPED_BY_SCHEDULING",
    "PLAIN_ISSUES",
    "PLAIN_REDUCE_SCATTERS",
    "REDUCE_SCATTER_ISSUES",
    "BucketRuntime",
    "compute_name",
    "gathered_epilogues_unfused",
    "numel",
    "overlap_executor",
    "unfused_matmuls",
    "with_collectives_kept_visible",
]


class BucketRuntime(Protocol):
    """What a bucket operator calls on the bucket the trace names (``_bucketing/buffers.py``)."""

    # What its all-gather moves: the parameters' dtype, or mixed precision's param_dtype.
    gather_dtype: torch.dtype
    # What its reduce-scatter moves: the parameters' dtype (gradients in another are cast).
    reduce_dtype: torch.dtype

    def gathered_numel(self) -> int: ...
    def shard_numel(self) -> int: ...
    def unsharded_shape(self, slot: int) -> tuple[int, ...]: ...
    def shard_shape(self, slot: int) -> tuple[int, ...]: ...
    # A launch of its own: start, then finish at the wait.
    def start_all_gather(self, shards: list[torch.Tensor], slots: tuple[int, ...]) -> Any: ...
    def start_reduce_scatter(self, grads: list[torch.Tensor], divisor: float | None) -> Any: ...
    # A member of a coalesced launch: prepare, join the launch, then the views once it is complete.
    def prepare_all_gather(self, shards: list[torch.Tensor], slots: tuple[int, ...]) -> Any: ...
    def launch_all_gather(self, pending: Any, *, async_op: bool) -> Any: ...
    def finish_all_gather(self, pending: Any, slots: tuple[int, ...]) -> list[torch.Tensor]: ...
    def gathered_views(self, pending: Any, slots: tuple[int, ...]) -> list[torch.Tensor]: ...
    def prepare_reduce_scatter(self, grads: list[torch.Tensor], divisor: float | None) -> Any: ...
    def launch_reduce_scatter(self, pending: Any, *, async_op: bool) -> Any: ...
    def finish_reduce_scatter(self, pending: Any, slots: tuple[int, ...]) -> list[torch.Tensor]: ...
    def reduced_views(self, pending: Any, slots: tuple[int, ...]) -> list[torch.Tensor]: ...
    def accumulate_unsynced(self, grads: list[torch.Tensor], slots: tuple[int, ...]) -> list[torch.Tensor]: ...
    def start_all_reduce(self, reduced: list[torch.Tensor], group: dist.ProcessGroup, divisor: float) -> Any: ...
    def finish_all_reduce(self, pending: Any, slots: tuple[int, ...]) -> list[torch.Tensor]: ...


overlap_executor = OperatorExecutor("thunder_overlap")
register_executor(overlap_executor)


def _always(*args, **kwargs) -> bool:
    return True


# Thunder's collective prims, each with the operator this executor claims it with.
_CLAIMED: dict[Symbol, Symbol] = {}
for _prim, _impl in (
    (dist_prims.all_gather, torchex._all_gather_prim_impl),
    (dist_prims.reduce_scatter, torchex._reduce_scatter_prim_impl),
    (dist_prims.wait, torchex._wait_prim_impl),
):
    _CLAIMED[_prim] = overlap_executor.register_operator(f"overlap_{_prim.name}", meta=_prim.meta, fn=_impl)
    overlap_executor.register_implementation(_prim, _CLAIMED[_prim], checker=_always)


# Matmuls kept out of fusions ([Note: fusing executors]), by an executor of their own that fsdp()
# places just before an executor that could fuse them with everything else: operators with the
# prim's meta (no subsymbols, so no fusion executor can take them apart) and the torch function.
unfused_matmuls = OperatorExecutor("thunder_overlap_matmuls")
register_executor(unfused_matmuls)
_UNFUSED: dict[Symbol, str] = {}
for _prim, _meta, _fn, _claims in (
    (prims.matmul, prims.matmul.meta, torch.matmul, (ltorch.matmul, prims.matmul)),
    # The bias may be left out, as torch.nn.functional.linear allows.
    (prims.linear, lambda a, w, bias=None: prims.linear.meta(a, w, bias), torch.nn.functional.linear, (ltorch.linear, prims.linear)),
):
    _op = unfused_matmuls.register_operator(f"unfused_{_prim.name}", meta=_meta, fn=_fn, tags=[prims.OpTags.MATMUL_OP])
    _UNFUSED[_op] = _prim.name
    for _claimed in _claims:
        unfused_matmuls.register_implementation(_claimed, _op, checker=_always)


def compute_name(bsym: BoundSymbol) -> str:
    """The name of the computation ``bsym`` runs: an unfused matmul's is the op it stands for."""
    return _UNFUSED_NAMES.get(bsym.sym.id, bsym.sym.name)


def numel(t: TensorProxy) -> int:
    """Elements of ``t``, from its shape: sharded proxies keep a stale ``numel``."""
    return math.prod(int(s) for s in t.shape)


# --- bucketed collectives --------------------------------------------------------------------


bucket_all_gather = overlap_executor.register_operator(
    "bucket_all_gather",
    meta=lambda bucket, group, shards, slots: FutureTensorProxy(
        shape=(bucket.gathered_numel(),), like=shards[0], dtype=to_dtype(bucket.gather_dtype)
    ),
    fn=lambda bucket, group, shards, slots: bucket.start_all_gather(shards, slots),
)
bucket_all_gather_wait = overlap_executor.register_operator(
    "bucket_all_gather_wait",
    meta=lambda pending, bucket, slots: [TensorProxy(like=pending, shape=bucket.unsharded_shape(i)) for i in slots],
    fn=lambda pending, bucket, slots: bucket.finish_all_gather(pending, slots),
)
bucket_reduce_scatter = overlap_executor.register_operator(
    "bucket_reduce_scatter",
    meta=lambda bucket, group, grads, divisor: FutureTensorProxy(
        shape=(bucket.shard_numel(),), like=grads[0], dtype=to_dtype(bucket.reduce_dtype)
    ),
    fn=lambda bucket, group, grads, divisor: bucket.start_reduce_scatter(grads, divisor),
)


def _shard_views_meta(source: TensorProxy, bucket: BucketRuntime, slots: tuple[int, ...]) -> list[TensorProxy]:
    return [TensorProxy(like=source, shape=bucket.shard_shape(i)) for i in slots]


bucket_reduce_scatter_wait = overlap_executor.register_operator(
    "bucket_reduce_scatter_wait",
    meta=_shard_views_meta,
    fn=lambda pending, bucket, slots: bucket.finish_reduce_scatter(pending, slots),
)
bucket_accumulate_grads = overlap_executor.register_operator(
    "bucket_accumulate_grads",
    meta=lambda bucket, grads, slots: _shard_views_meta(grads[0], bucket, slots),
    fn=lambda bucket, grads, slots: bucket.accumulate_unsynced(grads, slots),
)

# --- hybrid sharding's all-reduce of a reduced gradient shard across replicas -----------------


def _replica_all_reduce_impl(reduced: torch.Tensor, group, divisor: float) -> tuple[dist.Work, torch.Tensor]:
    # In place: the reduce-scatter's fresh output, read by nothing but this all-reduce.
    reduced.div_(divisor)
    return dist.all_reduce(reduced, group=group, async_op=True), reduced


replica_all_reduce = overlap_executor.register_operator(
    "replica_all_reduce", meta=lambda reduced, group, divisor: FutureTensorProxy(like=reduced), fn=_replica_all_reduce_impl
)
replica_all_reduce_wait = overlap_executor.register_operator(
    "replica_all_reduce_wait", meta=lambda pending: TensorProxy(like=pending), fn=torchex._wait_prim_impl
)
bucket_all_reduce = overlap_executor.register_operator(
    "bucket_all_reduce",
    meta=lambda bucket, group, reduced, divisor: FutureTensorProxy(shape=(bucket.shard_numel(),), like=reduced[0]),
    fn=lambda bucket, group, reduced, divisor: bucket.start_all_reduce(reduced, group, divisor),
)
bucket_all_reduce_wait = overlap_executor.register_operator(
    "bucket_all_reduce_wait", meta=_shard_views_meta, fn=lambda pending, bucket, slots: bucket.finish_all_reduce(pending, slots)
)

# --- mixed precision's cast of a shard before its all-gather ---------------------------------
# An operator of its own, not prims.convert_element_type, which a fuser (nvFuser) could merge with
# other casts or with compute: then the cast would be no single-input op before its all-gather,
# and ZeRO3 could not replay it in backward ([Note: mixed precision]).
shard_cast = overlap_executor.register_operator(
    "shard_cast",
    meta=lambda shard, dtype: TensorProxy(like=shard, dtype=dtype),
    fn=lambda shard, dtype: shard.to(to_torch_dtype(dtype)),
)

# --- coalesced launches -----------------------------------------------------------------------
# Collectives issued inside one ``torch.distributed._coalescing_manager(group, async_ops=True)``
# go out as one launch (one ncclGroupStart/End on NCCL; gloo runs them correctly too). Each
# member's copy-in runs before the launch and its copy-out after the wait, as when alone.


@dataclass
class CoalescedLaunch:
    """What a coalesced issue returns and its wait consumes."""

    manager: dist.distributed_c10d._CoalescingManager | None
    # Per member, its outputs once the launch is complete (copy-out included).
    finishers: list[Callable[[], list[torch.Tensor]]]
    # Inputs that must stay referenced while the launch runs (pool buffers stay busy).
    sources: list[object]


def _launch(group: dist.ProcessGroup, launches: list[Callable[[], None]]) -> dist.distributed_c10d._CoalescingManager:
    with dist._coalescing_manager(group, async_ops=True) as manager:
        for launch in launches:
            launch()
    return manager


def _scaled_shape(t: torch.Tensor, dim: int | None, factor: float) -> list[int]:
    # As Thunder's torch executor shapes one collective's output: dim (default 0) grows or shrinks.
    shape = list(t.shape)
    axis = 0 if dim is None else dim
    shape[axis] = int(shape[axis] * factor)
    return shape


def _coalesced_all_gather(group: dist.ProcessGroup, dims: tuple[int | None, ...], shards: list[torch.Tensor]) -> CoalescedLaunch:
    outs = [torch.empty(_scaled_shape(s, d, group.size()), dtype=s.dtype, device=s.device) for s, d in zip(shards, dims, strict=True)]
    launches = [lambda o=o, s=s: dist.all_gather_into_tensor(o, s, group=group) for o, s in zip(outs, shards, strict=True)]
    return CoalescedLaunch(_launch(group, launches), [lambda o=o: [o] for o in outs], list(shards))


def _coalesced_reduce_scatter(group: dist.ProcessGroup, dims: tuple[int | None, ...], tensors: list[torch.Tensor], op) -> CoalescedLaunch:
    torch_op = to_torch_distributed_reduce_op(op)
    outs = [torch.empty(_scaled_shape(t, d, 1 / group.size()), dtype=t.dtype, device=t.device) for t, d in zip(tensors, dims, strict=True)]
    launches = [lambda o=o, t=t: dist.reduce_scatter_tensor(o, t, op=torch_op, group=group) for o, t in zip(outs, tensors, strict=True)]
    return CoalescedLaunch(_launch(group, launches), [lambda o=o: [o] for o in outs], list(tensors))


def _coalesced_buckets(prepare: str, launch: str, finish: str) -> Callable:
    """A coalesced launch of bucketed collectives; ``members`` holds, per bucket, (the bucket,
    the argument its prepare takes after the inputs, the slots its wait returns)."""

    def run(group: dist.ProcessGroup, members: tuple[tuple[BucketRuntime, Any, tuple[int, ...]], ...], inputs: list) -> CoalescedLaunch:
        buckets = [bucket for bucket, _, _ in members]
        pendings = [getattr(b, prepare)(i, extra) for b, (_, extra, _), i in zip(buckets, members, inputs, strict=True)]
        launches = [lambda b=b, p=p: getattr(b, launch)(p, async_op=False) for b, p in zip(buckets, pendings, strict=True)]
        finishers = [
            lambda b=b, p=p, s=slots: getattr(b, finish)(p, s) for b, p, (_, _, slots) in zip(buckets, pendings, members, strict=True)
        ]
        return CoalescedLaunch(_launch(group, launches), finishers, pendings)

    return run


def _coalesced_wait(launch: CoalescedLaunch, shapes: tuple[tuple[int, ...], ...]) -> list[torch.Tensor]:
    """Waits for the whole launch; every member's outputs, member after member."""
    launch.manager.wait()
    # Drop the manager (it holds the backend's works), then let the backend release the bucket
    # members' pool buffers before their copy-outs take new views.
    launch.manager = None
    for source in launch.sources:
        settle = getattr(source, "settle", None)
        if settle is not None:
            settle()
    outputs = [t for finish in launch.finishers for t in finish()]
    if len(outputs) != len(shapes):
        raise RuntimeError(f"thunder_overlap: a coalesced launch produced {len(outputs)} outputs, its trace expects {len(shapes)}")
    return outputs


# A coalesced launch's future stands for every member's output, back to back: its numel is theirs
# summed, which is what the cost model and the memory estimator read.
def _coalesced_op(kind: str, meta, fn):
    return overlap_executor.register_operator(f"coalesced_{kind}", meta=meta, fn=fn)


coalesced_all_gather = _coalesced_op(
    "all_gather",
    lambda group, dims, shards: FutureTensorProxy(shape=(sum(numel(s) for s in shards) * group.size(),), like=shards[0]),
    _coalesced_all_gather,
)
coalesced_reduce_scatter = _coalesced_op(
    "reduce_scatter",
    lambda group, dims, tensors, op: FutureTensorProxy(shape=(sum(numel(t) for t in tensors) // group.size(),), like=tensors[0]),
    _coalesced_reduce_scatter,
)
coalesced_bucket_all_gather = _coalesced_op(
    "bucket_all_gather",
    lambda group, members, shards: FutureTensorProxy(
        shape=(sum(b.gathered_numel() for b, _, _ in members),), like=shards[0][0], dtype=to_dtype(members[0][0].gather_dtype)
    ),
    _coalesced_buckets("prepare_all_gather", "launch_all_gather", "gathered_views"),
)
coalesced_bucket_reduce_scatter = _coalesced_op(
    "bucket_reduce_scatter",
    lambda group, members, grads: FutureTensorProxy(
        shape=(sum(b.shard_numel() for b, _, _ in members),), like=grads[0][0], dtype=to_dtype(members[0][0].reduce_dtype)
    ),
    _coalesced_buckets("prepare_reduce_scatter", "launch_reduce_scatter", "reduced_views"),
)
coalesced_wait = _coalesced_op(
    "wait",
    lambda pending, shapes: [TensorProxy(like=pending, shape=shape) for shape in shapes],
    _coalesced_wait,
)


# --- the operators by symbol id ----------------------------------------------------------------
# A bound symbol is recognised by ``bsym.sym.id``: a PrimID for Thunder's prims (before an
# executor claims them), the registered name for an executor's operator (the torch executor's
# implementations of those prims, this module's operators).


def _ids(*symbols: Symbol) -> frozenset:
    return frozenset(symbol.id for symbol in symbols)


# Thunder's one-tensor all-gather and reduce-scatter: the prims and their torch and overlap
# implementations (the members a plain coalesced launch takes in).
_PLAIN_ALL_GATHERS = _ids(dist_prims.all_gather, torchex.all_gather_prim_impl, _CLAIMED[dist_prims.all_gather])
PLAIN_REDUCE_SCATTERS = _ids(dist_prims.reduce_scatter, torchex.reduce_scatter_prim_impl, _CLAIMED[dist_prims.reduce_scatter])
PLAIN_ISSUES = _PLAIN_ALL_GATHERS | PLAIN_REDUCE_SCATTERS
# The bucketed collectives' issue operators (the members a bucket coalesced launch takes in).
BUCKET_ISSUES = _ids(bucket_all_gather, bucket_reduce_scatter)
# Issues that move buckets, alone or coalesced.
BUCKETED_ISSUES = BUCKET_ISSUES | _ids(coalesced_bucket_all_gather, coalesced_bucket_reduce_scatter)
# Coalesced launches' issue operators: they take (group, one entry per member, inputs...).
COALESCED_ISSUES = _ids(coalesced_all_gather, coalesced_reduce_scatter, coalesced_bucket_all_gather, coalesced_bucket_reduce_scatter)
# Every issue of an all-gather, and of a reduce-scatter (any other collective is an all-reduce).
ALL_GATHER_ISSUES = _PLAIN_ALL_GATHERS | _ids(bucket_all_gather, coalesced_all_gather, coalesced_bucket_all_gather)
REDUCE_SCATTER_ISSUES = PLAIN_REDUCE_SCATTERS | _ids(bucket_reduce_scatter, coalesced_reduce_scatter, coalesced_bucket_reduce_scatter)
# This module's matmuls, by id, with the name of the op each runs.
_UNFUSED_NAMES = {op.id: name for op, name in _UNFUSED.items()}
# Deletions, which scheduling drops and regenerates for the new order.
DROPPED_BY_SCHEDULING = frozenset({prims.PrimIDs.DEL, pythonex.clear_mutable_collection.id})


def _can_swallow_collectives(executor: Executor) -> bool:
    collective_ids = (dist_prims.all_gather.id, torchex.all_gather_prim_impl.id, torchex.wait_prim_impl.id)
    return isinstance(executor, FusionExecutor) and any(i in executor.implmap for i in collective_ids)


_WAITS = _ids(dist_prims.wait, torchex.wait_prim_impl, _CLAIMED[dist_prims.wait])


class _GatheredEpiloguesUnfused(FusionExecutor):
    """Fuses nothing. Its pass runs before the fusing executors' and hands each op computed from
    gathered parameters alone (the unpadding slice, a cast) to the torch executor, so that it
    stays top-level where ZeRO3 can replay it in the backward ([Note: fusing executors])."""

    def fusion_pass(self, trace: TraceCtx) -> TraceCtx:
        gathered: set[str] = set()
        bsyms = []
        for bsym in trace.bound_symbols:
            tensors = [p.name for p in bsym.flat_proxy_args if isinstance(p, TensorProxy)]
            impl = torchex.ex.implmap.get(bsym.sym.id)
            if bsym.sym.id in _WAITS:
                gathered.update(p.name for p in bsym.flat_proxy_outs)
            elif tensors and gathered.issuperset(tensors) and impl is not None and impl.symbol is not None:
                if impl.checker is None or impl.checker(*bsym.args, **bsym.kwargs):
                    bsym = impl.symbol.bind(*bsym.args, output=bsym.output, **bsym.kwargs)
                    gathered.update(p.name for p in bsym.flat_proxy_outs)
            bsyms.append(bsym)
        unfused = from_trace(trace)
        unfused.bound_symbols = bsyms
        unfused.set_provenance(TraceProvenance("thunder_overlap: gathered parameters' epilogues kept out of fusions"))
        return unfused


gathered_epilogues_unfused = _GatheredEpiloguesUnfused("thunder_overlap_epilogues")
register_executor(gathered_epilogues_unfused)


def with_collectives_kept_visible(executors: list[Executor]) -> list[Executor]:
    """``executors`` with ``overlap_executor`` first when one of them could fuse collectives,
    and ``unfused_matmuls`` and ``gathered_epilogues_unfused`` just before that one: executors
    the user put before it still claim their ops first (a matmul executor's, say).

    Otherwise the list is returned unchanged, so Thunder's own passes (which know the torch
    executor's collective symbols) produce the same order as they do for Thunder's FSDP.
    """
    ours = (overlap_executor, unfused_matmuls, gathered_epilogues_unfused)
    theirs = [e for e in executors if e not in ours]
    fuser = next((i for i, e in enumerate(theirs) if _can_swallow_collectives(e)), None)
    if fuser is None:
        return list(executors)
    return [overlap_executor, *theirs[:fuser], unfused_matmuls, gathered_epilogues_unfused, *theirs[fuser:]]
