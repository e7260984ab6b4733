"""The trace rewrite behind bucketing: per-parameter collectives become one per bucket.

In a forward or backward execution trace, :func:`rewrite_bucket_collectives` replaces

- the all-gathers and waits of a bucket's parameters with one bucketed all-gather and one wait,
  whose outputs keep the names of the per-parameter waits (so the unpadding slices and the
  compute read them as before), placed where the bucket's first gather and first wait were;
  with mixed precision, each shard's cast too (the bucket casts its flat shard once);
- (backward) the pad, pre-average, (mixed precision) cast, reduce-scatter and wait of a bucket's
  gradients with one
  bucketed reduce-scatter, placed at the bucket's last reduce-scatter, and one wait at its last
  wait; or, when accumulating (a backward compiled under no_sync), with one local gradient
  accumulation per bucket.

Deletions are regenerated for the rebuilt trace. Whatever cannot be bucketed stays as it was
and is listed, with the reason, in the returned :class:`BucketingSummary`. The bucketed
operators (``_ops.py``) name the bucket's runtime object, which the trace carries.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch.distributed as dist
from thunder.core import prims
from thunder.core.dtypes import to_dtype, to_torch_dtype
from thunder.core.proxies import FutureTensorProxy, TensorProxy
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx, TraceProvenance, TraceTag, from_trace, tracectx
from thunder.executors import pythonex

from thunder_overlap import _ops as ops
from thunder_overlap._analysis.classify import AnnotatedTrace, Collective, CollectiveKind, classify_trace
from thunder_overlap._bucketing.buffers import BucketBuffers
from thunder_overlap._bucketing.plan import BucketPlan
from thunder_overlap._scheduling.orders import with_deletions

__all__ = ["BucketIndex", "BucketingSummary", "forward_input_names", "rewrite_bucket_collectives"]

logger = logging.getLogger(__name__)


@dataclass
class BucketingSummary:
    """What the last rewrite of one pass did."""

    all_gathers: int = 0
    reduce_scatters: int = 0
    # Buckets whose gradients were summed locally instead (a backward compiled under no_sync).
    accumulations: int = 0
    # Per-parameter collectives left as they were: (what, why).
    unbucketed: list[tuple[str, str]] = field(default_factory=list)


@dataclass(frozen=True)
class BucketIndex:
    """What the rewrite knows of the buckets: their buffers, the FSDP process group, and which
    (index into ``buckets``, slot) a computation-trace input name is, if any."""

    buckets: Sequence[BucketBuffers]
    process_group: dist.ProcessGroup
    slot_of_input: Callable[[str], tuple[int, int] | None]


@dataclass
class _Member:
    """One per-parameter collective that joins a bucketed one."""

    slot: int
    start: BoundSymbol
    wait: BoundSymbol
    # Bound symbols absorbed into the bucketed collective (a gather's cast; padding, pre-averaging).
    prologue: list[BoundSymbol] = field(default_factory=list)
    # What the bucketed collective reads: the shard, or the gradient before padding.
    source: TensorProxy | None = None
    divisor: float | None = None


def forward_input_names(forward_trace: TraceCtx) -> list[str | None]:
    """The forward's input names in the order the backward returns their gradients."""
    ret = forward_trace.bound_symbols[-1]
    first = ret.args[0] if ret.args else None
    if isinstance(first, tuple) and first and isinstance(first[0], dict):
        first = first[0]
    flat_args = list(first["flat_args"]) if isinstance(first, dict) and "flat_args" in first else []
    return [getattr(a, "name", None) for a in flat_args]


def rewrite_bucket_collectives(
    trace: TraceCtx,
    index: BucketIndex,
    *,
    forward_inputs: list[str | None] | None = None,
    accumulate: bool = False,
) -> tuple[TraceCtx, BucketingSummary]:
    """Buckets the collectives of a forward or backward execution trace (see the module docstring).

    Args:
        forward_inputs: for a backward trace, :func:`forward_input_names` of its forward.
        accumulate: a backward compiled under no_sync: sum each bucket's gradients locally.

    Returns the rewritten trace (``trace`` itself when nothing was bucketed) and the summary.
    Raises NotImplementedError when accumulating and some gradient cannot be bucketed.
    """
    rewrite = _Rewrite(trace, index)
    rewrite.bucket_all_gathers()
    is_backward = TraceTag.BACKWARD in trace.tags
    if is_backward:
        rewrite.bucket_reduce_scatters(forward_inputs, accumulate)
    if not rewrite.new_bsyms:
        return trace, rewrite.summary
    return _rebuild(trace, rewrite.new_bsyms, rewrite.removed, is_backward), rewrite.summary


class _Rewrite:
    """One pass's edits: bucketed ops to insert (by position) and per-parameter ops to remove."""

    def __init__(self, trace: TraceCtx, index: BucketIndex) -> None:
        self.trace = trace
        self.index = index
        self.annotated = classify_trace(trace, roles_only=True)
        self.positions = {id(b): i for i, b in enumerate(trace.bound_symbols)}
        self.summary = BucketingSummary()
        self.new_bsyms: dict[int, list[BoundSymbol]] = defaultdict(list)  # position -> bucketed ops placed there
        self.removed: set[int] = set()

    def bucket_all_gathers(self) -> None:
        annotated, summary = self.annotated, self.summary
        casts = _shard_casts(self.trace)
        members: dict[int, list[_Member]] = defaultdict(list)
        for c in annotated.collectives:
            if c.kind is not CollectiveKind.ALL_GATHER or c.wait is None:
                continue
            start, wait = annotated.nodes[c.start].bsym, annotated.nodes[c.wait].bsym
            gathered = start.args[0]
            # Mixed precision gathers a cast of the shard; the bucket casts its flat shard instead.
            cast = casts.get(gathered.name) if isinstance(gathered, TensorProxy) else None
            shard = cast.args[0] if cast is not None else gathered
            located = self.index.slot_of_input(shard.name) if isinstance(shard, TensorProxy) else None
            if located is None:
                summary.unbucketed.append((f"all_gather({getattr(shard, 'name', shard)})", "not a parameter of a bucket"))
                continue
            if start.args[3] is not None:
                summary.unbucketed.append((f"all_gather({shard.name})", f"gathers along dim {start.args[3]}, not dim 0"))
                continue
            bucket_id, slot = located
            gather_dtype = self.index.buckets[bucket_id].gather_dtype
            if to_torch_dtype(gathered.dtype) != gather_dtype:
                problem = f"gathers {to_torch_dtype(gathered.dtype)}, its bucket {gather_dtype}"
                summary.unbucketed.append((f"all_gather({shard.name})", problem))
                continue
            members[bucket_id].append(_Member(slot, start, wait, prologue=[cast] if cast is not None else [], source=shard))

        positions = self.positions
        for bucket_id, group in members.items():
            bucket = self.index.buckets[bucket_id]
            slots = tuple(m.slot for m in group)
            with tracectx(self.trace):
                # In the gather dtype, as what each member gathered.
                future = FutureTensorProxy(shape=(bucket.gathered_numel(),), like=group[0].start.args[0])
            start = ops.bucket_all_gather.bind(bucket, self.index.process_group, [m.source for m in group], slots, output=future)
            wait = ops.bucket_all_gather_wait.bind(future, bucket, slots, output=tuple(m.wait.output for m in group))
            self.new_bsyms[min(positions[id(m.start)] for m in group)].append(start)
            self.new_bsyms[min(positions[id(m.wait)] for m in group)].append(wait)
            self.removed.update(positions[id(b)] for m in group for b in (*m.prologue, m.start, m.wait))
            summary.all_gathers += 1
            logger.debug("bucket %s: one all-gather for %d parameters", bucket.label, len(group))

    def bucket_reduce_scatters(self, forward_inputs: list[str | None] | None, accumulate: bool) -> None:
        summary, positions = self.summary, self.positions
        groups = self._reduce_scatter_groups(forward_inputs)
        per_parameter = [u for u in summary.unbucketed if u[0].startswith("reduce_scatter")]
        if accumulate and per_parameter:
            # Thunder would hand autograd None for these gradients and they would be lost.
            raise NotImplementedError(
                "thunder_overlap: under no_sync only bucketed gradients can be accumulated, and these "
                f"reduce-scatters could not be bucketed: {per_parameter}"
            )
        for bucket_id, group in groups:
            bucket = self.index.buckets[bucket_id]
            slots = tuple(m.slot for m in group)
            sources = [m.source for m in group]
            outputs = tuple(m.wait.output for m in group)
            last_start = max(positions[id(m.start)] for m in group)
            self.removed.update(positions[id(b)] for m in group for b in (m.start, m.wait, *m.prologue))
            if accumulate:
                self.new_bsyms[last_start].append(ops.bucket_accumulate_grads.bind(bucket, sources, slots, output=outputs))
                summary.accumulations += 1
                logger.debug("bucket %s: %d gradients summed locally (no_sync)", bucket.label, len(group))
                continue
            with tracectx(self.trace):
                # In the bucket's dtype: the lay-out casts gradients of another.
                future = FutureTensorProxy(shape=(bucket.plan.shard_numel,), like=group[0].source, dtype=to_dtype(bucket.plan.dtype))
            start = ops.bucket_reduce_scatter.bind(bucket, self.index.process_group, sources, group[0].divisor, output=future)
            self.new_bsyms[last_start].append(start)
            wait = ops.bucket_reduce_scatter_wait.bind(future, bucket, slots, output=outputs)
            self.new_bsyms[max(positions[id(m.wait)] for m in group)].append(wait)
            summary.reduce_scatters += 1
            logger.debug("bucket %s: one reduce-scatter for %d gradients", bucket.label, len(group))

    def _reduce_scatter_groups(self, forward_inputs: list[str | None] | None) -> list[tuple[int, list[_Member]]]:
        """The backward's reduce-scatters by bucket, each bucket's in slot order; whatever cannot
        be bucketed goes to ``summary.unbucketed``."""
        annotated = self.annotated
        ret = self.trace.bound_symbols[-1]
        returned = ret.args[0] if ret.args and isinstance(ret.args[0], (tuple, list)) else ()
        position_of_grad = {g.name: j for j, g in enumerate(returned) if isinstance(g, TensorProxy)}
        members: dict[int, list[_Member]] = defaultdict(list)
        for c in annotated.collectives:
            if c.kind is not CollectiveKind.REDUCE_SCATTER or c.wait is None:
                continue
            member, problem = self._reduce_scatter_member(c, position_of_grad, forward_inputs)
            if problem is not None:
                self.summary.unbucketed.append((f"reduce_scatter({annotated.nodes[c.start].inputs[0]})", problem))
                continue
            members[member[0]].append(member[1])
        groups = []
        for bucket_id, group in members.items():
            problem = _incomplete(self.index.buckets[bucket_id].plan, group)
            if problem is not None:
                self.summary.unbucketed += [(f"reduce_scatter({m.source.name})", problem) for m in group]
                continue
            groups.append((bucket_id, sorted(group, key=lambda m: m.slot)))
        return groups

    def _reduce_scatter_member(
        self, c: Collective, position_of_grad: dict[str, int], forward_inputs: list[str | None] | None
    ) -> tuple[tuple[int, _Member] | None, str | None]:
        """The bucket slot a gradient's reduce-scatter fills and what it absorbs, or why it cannot."""
        annotated: AnnotatedTrace = self.annotated
        start, wait = annotated.nodes[c.start].bsym, annotated.nodes[c.wait].bsym
        position = position_of_grad.get(wait.output.name)
        if position is None or forward_inputs is None or position >= len(forward_inputs):
            return None, "its result is not returned as a parameter's gradient"
        located = self.index.slot_of_input(forward_inputs[position] or "")
        if located is None:
            return None, "not the gradient of a parameter of a bucket"
        if start.args[4] is not None or "SUM" not in str(start.args[1]):
            return None, f"reduces with {start.args[1]} along dim {start.args[4]}, not a sum along dim 0"
        bucket_id, slot = located
        bucket = self.index.buckets[bucket_id]
        member = _Member(slot, start, wait, source=start.args[0])
        # Walk from the reduce-scatter's input back through the padding, pre-averaging and (mixed
        # precision) cast of its prologue; whatever comes before them (a bias gradient's sum)
        # stays where it is.
        producer = {o.name: annotated.nodes[i].bsym for i in c.prologue for o in annotated.nodes[i].bsym.flat_proxy_outs}
        while member.source.name in producer and _is_absorbable(producer[member.source.name], bucket):
            bsym = producer[member.source.name]
            problem = _absorb(bsym, member, self.index.process_group.size())
            if problem is not None:
                return None, problem
            member.prologue.append(bsym)
            member.source = next(a for a in bsym.flat_proxy_args if isinstance(a, TensorProxy))
        # A gradient computed in the gather dtype is cast by the lay-out into the bucket's.
        if to_torch_dtype(member.source.dtype) not in (bucket.plan.dtype, bucket.gather_dtype):
            return None, f"gradient dtype {member.source.dtype} differs from the bucket's {bucket.plan.dtype}"
        return (bucket_id, member), None


def _shard_casts(trace: TraceCtx) -> dict[str, BoundSymbol]:
    """Mixed precision's casts of a shard for its all-gather (``shard_cast``), by the cast's name:
    those nothing else reads, which a bucket's gather can replace with its own cast."""
    readers = Counter(a.name for b in trace.bound_symbols if b.sym.id is not prims.PrimIDs.DEL for a in b.flat_proxy_args)
    return {b.output.name: b for b in trace.bound_symbols if b.sym.id == ops.shard_cast.id and readers[b.output.name] == 1}


def _is_absorbable(bsym: BoundSymbol, bucket: BucketBuffers) -> bool:
    name = bsym.sym.name
    return "pad" in name or name in ("true_divide", "div") or _is_gradient_cast(bsym, bucket)


def _is_gradient_cast(bsym: BoundSymbol, bucket: BucketBuffers) -> bool:
    """Mixed precision's cast of a gradient from the gather dtype to the bucket's, in a bucket
    that lays its gradients out: the lay-out's ``_chunk_cat`` casts as it copies (as FSDP2
    reduces). A bucket that sends its gradients where they are sends them cast by the trace
    ([Note: mixed precision])."""
    if bsym.sym.name not in ("to", "convert_element_type") or bucket.gather_dtype == bucket.plan.dtype:
        return False
    if bucket.layout.can_send_gradients:
        return False
    inputs = [a for a in bsym.flat_proxy_args if isinstance(a, TensorProxy)]
    outputs = [o for o in bsym.flat_proxy_outs if isinstance(o, TensorProxy)]
    return (
        len(inputs) == len(outputs) == 1
        and to_torch_dtype(inputs[0].dtype) == bucket.gather_dtype
        and to_torch_dtype(outputs[0].dtype) == bucket.plan.dtype
    )


def _absorb(bsym: BoundSymbol, member: _Member, world_size: int) -> str | None:
    """Checks that a padding or pre-averaging op is one the bucketed reduce-scatter can do
    itself (``_chunk_cat`` pads rows with zeros; the divisor is applied in place); records the
    divisor."""
    name = bsym.sym.name
    if name in ("to", "convert_element_type"):
        return None  # a gradient cast (_is_gradient_cast): the lay-out casts
    if "pad" in name:
        _, value, config = bsym.args[:3]
        rows_only = all(tuple(c) == (0, 0, 0) for c in config[1:]) and config[0][0] == 0 and config[0][2] == 0
        if value != 0 or not rows_only:
            return f"pads with {config} (value {value}); only zero rows at the end are bucketed"
        rows = bsym.args[0].shape[0] + config[0][1]
        if rows % world_size:
            return f"pads to {rows} rows, not a multiple of the world size {world_size}"
        return None
    if name in ("true_divide", "div") and len(bsym.args) == 2 and isinstance(bsym.args[1], (int, float)):
        if member.divisor is not None:
            return "divides twice"
        member.divisor = float(bsym.args[1])
        return None
    return f"its gradient is divided by {bsym.args[1:]!r}, not by a number"


def _incomplete(plan: BucketPlan, group: list[_Member]) -> str | None:
    slots = sorted(m.slot for m in group)
    if slots != list(range(len(plan.slots))):
        return f"bucket {plan.label!r}: this trace reduce-scatters {len(slots)} of its {len(plan.slots)} gradients"
    if len({m.divisor for m in group}) != 1:
        return f"bucket {plan.label!r}: its gradients are pre-averaged by different divisors"
    return None


def _rebuild(trace: TraceCtx, new_bsyms: dict[int, list[BoundSymbol]], removed: set[int], is_backward: bool) -> TraceCtx:
    rebuilt = from_trace(trace)
    bsyms: list[BoundSymbol] = []
    for i, bsym in enumerate(trace.bound_symbols):
        bsyms.extend(new_bsyms.get(i, ()))
        # Deletions (and, in backward, clearing of the saved tensors) are regenerated below.
        regenerated = bsym.sym.id is prims.PrimIDs.DEL or (is_backward and bsym.sym.id == pythonex.clear_mutable_collection.id)
        if i in removed or regenerated:
            continue
        bsyms.append(bsym)
    rebuilt.bound_symbols = bsyms
    rebuilt = with_deletions(rebuilt, clear_collections=is_backward)
    rebuilt.set_provenance(TraceProvenance("thunder_overlap: bucketed collectives"))
    return rebuilt
