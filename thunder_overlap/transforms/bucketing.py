"""Bucketing: one all-gather and one reduce-scatter per bucket, on persistent buffers.

Thunder's FSDP gathers and reduce-scatters every parameter on its own. This transform changes:

- the module: each bucket's shards move into one flat buffer
  (:class:`~thunder_overlap.bucketing.buffers.BucketBuffers`) and the parameters become views of it;
- the forward and backward execution traces: the all-gathers and waits of a bucket's parameters
  become one ``bucket_all_gather`` and one ``bucket_all_gather_wait``, whose outputs keep the
  names of the per-parameter waits (so the unpadding slices and the compute read them as before);
  the pad, pre-average, reduce-scatter and wait of a bucket's gradients become one
  ``bucket_reduce_scatter`` and its wait. ZeRO3's backward re-gathers are bucketed the same way.
  A backward compiled under no_sync gets one ``bucket_accumulate_grads`` per bucket instead,
  which sums the gradients locally; the bucket's next reduce-scatter sends the sum.

A bucket's gather starts where its first parameter's did and its reduce-scatter where the last
gradient's did; :class:`OverlapScheduleTransform`, which runs next, moves them from there.
Collectives this transform cannot bucket (a parameter it does not know, a gradient that is not
returned as is, a bucket whose gradients are only partly in the trace) stay per-parameter and are
listed, with the reason, in :attr:`BucketingTransform.summaries` and in a warning.
"""

from __future__ import annotations

import logging
import warnings
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from thunder.core import prims
from thunder.core.dtypes import to_torch_dtype
from thunder.core.proxies import FutureTensorProxy, TensorProxy
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx, TraceProvenance, TraceTag, from_trace, tracectx
from thunder.core.transform_common import Transform
from thunder.distributed import get_skip_data_parallel_grad_sync
from thunder.executors.passes import del_last_used

from thunder_overlap.analysis.classify import AnnotatedTrace, Collective, CollectiveKind, classify_trace, parameter_names_of_inputs
from thunder_overlap.bucketing.buffers import BucketBuffers, BufferPool, register_bucket
from thunder_overlap.bucketing.plan import BucketPlan, bucket_owner, plan_buckets
from thunder_overlap.options import BucketingStrategy, parse_bucketing_strategy
from thunder_overlap.transforms.executor import (
    bucket_accumulate_grads,
    bucket_all_gather,
    bucket_all_gather_wait,
    bucket_reduce_scatter,
    bucket_reduce_scatter_wait,
)

__all__ = ["BucketingTransform", "BucketingSummary"]

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


@dataclass
class _Member:
    """One per-parameter collective that joins a bucketed one."""

    slot: int
    start: BoundSymbol
    wait: BoundSymbol
    # Bound symbols absorbed into the bucketed collective (padding, pre-averaging).
    prologue: list[BoundSymbol] = field(default_factory=list)
    # What the bucketed collective reads: the shard, or the gradient before padding.
    source: TensorProxy | None = None
    divisor: float | None = None


class BucketingTransform(Transform):
    """Lays buckets out in persistent flat buffers and bucket-wise collectives in the traces.

    Args:
        strategy: :attr:`BucketingStrategy.LAYER` or ``BLOCK`` (or their names; see
            :func:`~thunder_overlap.bucketing.plan.bucket_owner`).
        process_group: the FSDP process group.
        cap_bytes: largest unsharded bucket size; None for no cap.
    """

    def __init__(
        self, strategy: BucketingStrategy | str, process_group: dist.ProcessGroup, cap_bytes: int | None = None
    ) -> None:
        self.strategy = parse_bucketing_strategy(strategy)
        if not self.strategy.has_buckets:
            raise ValueError(f"BucketingTransform needs strategy 'layer' or 'block', got {strategy!r}")
        self.process_group = process_group
        self.cap_bytes = cap_bytes
        self.buckets: dict[int, BucketBuffers] = {}
        self.pool = BufferPool()
        self.summaries: dict[str, BucketingSummary] = {}
        # parameter name (every alias of a tied parameter) -> (bucket id, slot)
        self._slots: dict[str, tuple[int, int]] = {}
        # computation-trace input name -> parameter name, from every prologue seen
        self._parameter_of_input: dict[str, str] = {}
        self._forward_inputs: list[str] | None = None

    @property
    def plans(self) -> list[BucketPlan]:
        return [b.plan for b in self.buckets.values()]

    def buffer_storages(self) -> set[int]:
        """Data pointers of every persistent buffer: flat shards, gradient shards, the pool."""
        storages = {b.flat_shard.untyped_storage().data_ptr() for b in self.buckets.values()}
        storages |= {g.untyped_storage().data_ptr() for b in self.buckets.values() for g in b.grad_shards}
        return storages | {p.untyped_storage().data_ptr() for p in self.pool.buffers}

    @property
    def allocations(self) -> int:
        """Buffers allocated so far, by the pool and for gradient shards."""
        return self.pool.allocations + sum(b.allocations for b in self.buckets.values())

    @staticmethod
    def of(module) -> BucketingTransform | None:
        """The bucketing transform of a module ``thunder_overlap.fsdp`` returned, if any."""
        from thunder import compile_data

        return next((t for t in compile_data(module).transforms if isinstance(t, BucketingTransform)), None)

    # --- module -----------------------------------------------------------------------------

    def transform_module(self, model) -> None:
        owners = bucket_owner(model._model, self.strategy)
        shared = model._get_shared_names()
        shards = list(model.named_parameters())
        plans = plan_buckets(shards, owners, world_size=self.process_group.size(), cap_bytes=self.cap_bytes)
        current = dict(shards)
        for plan in plans:
            first = current[plan.slots[0].name]
            flat = torch.empty(plan.shard_numel, dtype=plan.dtype, device=first.device)
            bucket = BucketBuffers(plan, flat, self.process_group, self.pool)
            bucket_id = register_bucket(bucket)
            self.buckets[bucket_id] = bucket
            for index, slot in enumerate(plan.slots):
                view = bucket.shard_view(index)
                with torch.no_grad():
                    view.copy_(current[slot.name])
                parameter = nn.Parameter(view, requires_grad=plan.requires_grad)
                for alias in shared[slot.name]:
                    model._overrides_parameters[alias] = parameter
                    self._slots[alias] = (bucket_id, index)

    # --- traces -----------------------------------------------------------------------------

    def transform_traces_pre_prologue(self, prologue_trace, computation_trace, epilogue_trace, **kwargs):
        self._parameter_of_input.update(parameter_names_of_inputs(prologue_trace, computation_trace))
        return prologue_trace, computation_trace, epilogue_trace

    def transform_trace_post_optimization(self, computation_trace: TraceCtx, **kwargs) -> TraceCtx:
        is_backward = TraceTag.BACKWARD in computation_trace.tags
        if not is_backward:
            ret = computation_trace.bound_symbols[-1]
            self._forward_inputs = [getattr(a, "name", None) for a in _forward_flat_args(ret)]
        summary = BucketingSummary()
        annotated = classify_trace(computation_trace)
        new_bsyms: dict[int, list[BoundSymbol]] = defaultdict(list)  # position -> bucketed ops placed there
        removed: set[int] = set()
        self._bucket_all_gathers(computation_trace, annotated, summary, new_bsyms, removed)
        if is_backward:
            self._bucket_reduce_scatters(computation_trace, annotated, summary, new_bsyms, removed)
        pass_name = "forward"
        if is_backward:
            pass_name = "backward (no_sync)" if get_skip_data_parallel_grad_sync() else "backward"
        self.summaries[pass_name] = summary
        logger.info(
            "%s: %d bucket all-gathers, %d bucket reduce-scatters, %d bucket accumulations, %d collectives left unbucketed",
            pass_name, summary.all_gathers, summary.reduce_scatters, summary.accumulations, len(summary.unbucketed),
        )
        if summary.unbucketed:
            # Correct but slower (one collective per parameter): say so rather than leave it to summaries.
            listed = "; ".join(f"{what}: {why}" for what, why in summary.unbucketed)
            warnings.warn(
                f"thunder_overlap bucketing ({pass_name}): {len(summary.unbucketed)} collectives stay per-parameter: {listed}",
                stacklevel=2,
            )
        if not new_bsyms:
            return computation_trace
        return _rebuild(computation_trace, new_bsyms, removed, is_backward)

    def _slot_of_input(self, name: str) -> tuple[int, int] | None:
        parameter = self._parameter_of_input.get(name)
        return self._slots.get(parameter) if parameter is not None else None

    def _bucket_all_gathers(self, trace, annotated, summary, new_bsyms, removed) -> None:
        members: dict[int, list[_Member]] = defaultdict(list)
        for c in annotated.collectives:
            if c.kind is not CollectiveKind.ALL_GATHER or c.wait is None:
                continue
            start, wait = annotated.nodes[c.start].bsym, annotated.nodes[c.wait].bsym
            shard = start.args[0]
            located = self._slot_of_input(shard.name) if isinstance(shard, TensorProxy) else None
            if located is None:
                summary.unbucketed.append((f"all_gather({getattr(shard, 'name', shard)})", "not a parameter of a bucket"))
                continue
            if start.args[3] is not None:
                summary.unbucketed.append((f"all_gather({shard.name})", f"gathers along dim {start.args[3]}, not dim 0"))
                continue
            bucket_id, slot = located
            members[bucket_id].append(_Member(slot, start, wait, source=shard))

        positions = {id(b): i for i, b in enumerate(trace.bound_symbols)}
        for bucket_id, group in members.items():
            bucket = self.buckets[bucket_id]
            slots = tuple(m.slot for m in group)
            with tracectx(trace):
                future = FutureTensorProxy(shape=(bucket.world_size * bucket.plan.shard_numel,), like=group[0].source)
            start = bucket_all_gather.bind(
                bucket_id, self.process_group, [m.source for m in group], slots, output=future
            )
            wait = bucket_all_gather_wait.bind(future, bucket_id, slots, output=tuple(m.wait.output for m in group))
            new_bsyms[min(positions[id(m.start)] for m in group)].append(start)
            new_bsyms[min(positions[id(m.wait)] for m in group)].append(wait)
            removed.update(positions[id(b)] for m in group for b in (m.start, m.wait))
            summary.all_gathers += 1
            logger.debug("bucket %d: one all-gather for %d parameters", bucket_id, len(group))

    def _bucket_reduce_scatters(self, trace, annotated, summary, new_bsyms, removed) -> None:
        groups = self._reduce_scatter_groups(trace, annotated, summary)
        unsynced = get_skip_data_parallel_grad_sync()
        per_parameter = [u for u in summary.unbucketed if u[0].startswith("reduce_scatter")]
        if unsynced and per_parameter:
            # Thunder would hand autograd None for these gradients and they would be lost.
            raise NotImplementedError(
                "thunder_overlap: under no_sync only bucketed gradients can be accumulated, and these "
                f"reduce-scatters could not be bucketed: {per_parameter}"
            )
        positions = {id(b): i for i, b in enumerate(trace.bound_symbols)}
        for bucket_id, group in groups:
            bucket = self.buckets[bucket_id]
            slots = tuple(m.slot for m in group)
            sources = [m.source for m in group]
            outputs = tuple(m.wait.output for m in group)
            last_start = max(positions[id(m.start)] for m in group)
            removed.update(positions[id(b)] for m in group for b in (m.start, m.wait, *m.prologue))
            if unsynced:
                new_bsyms[last_start].append(bucket_accumulate_grads.bind(bucket_id, sources, slots, output=outputs))
                summary.accumulations += 1
                logger.debug("bucket %d: %d gradients summed locally (no_sync)", bucket_id, len(group))
                continue
            with tracectx(trace):
                future = FutureTensorProxy(shape=(bucket.plan.shard_numel,), like=group[0].source)
            start = bucket_reduce_scatter.bind(bucket_id, self.process_group, sources, group[0].divisor, output=future)
            new_bsyms[last_start].append(start)
            wait = bucket_reduce_scatter_wait.bind(future, bucket_id, slots, output=outputs)
            new_bsyms[max(positions[id(m.wait)] for m in group)].append(wait)
            summary.reduce_scatters += 1
            logger.debug("bucket %d: one reduce-scatter for %d gradients", bucket_id, len(group))

    def _reduce_scatter_groups(self, trace, annotated, summary) -> list[tuple[int, list[_Member]]]:
        """The backward's reduce-scatters by bucket, each bucket's in slot order; whatever cannot
        be bucketed goes to ``summary.unbucketed``."""
        ret = trace.bound_symbols[-1]
        returned = ret.args[0] if ret.args and isinstance(ret.args[0], (tuple, list)) else ()
        position_of_grad = {g.name: j for j, g in enumerate(returned) if isinstance(g, TensorProxy)}
        members: dict[int, list[_Member]] = defaultdict(list)
        for c in annotated.collectives:
            if c.kind is not CollectiveKind.REDUCE_SCATTER or c.wait is None:
                continue
            member, problem = self._reduce_scatter_member(annotated, c, position_of_grad)
            if problem is not None:
                summary.unbucketed.append((f"reduce_scatter({annotated.nodes[c.start].inputs[0]})", problem))
                continue
            members[member[0]].append(member[1])
        groups = []
        for bucket_id, group in members.items():
            problem = _incomplete(self.buckets[bucket_id].plan, group)
            if problem is not None:
                summary.unbucketed += [(f"reduce_scatter({m.source.name})", problem) for m in group]
                continue
            groups.append((bucket_id, sorted(group, key=lambda m: m.slot)))
        return groups

    def _reduce_scatter_member(
        self, annotated: AnnotatedTrace, c: Collective, position_of_grad: dict[str, int]
    ) -> tuple[tuple[int, _Member] | None, str | None]:
        """The bucket slot a gradient's reduce-scatter fills and what it absorbs, or why it cannot."""
        start, wait = annotated.nodes[c.start].bsym, annotated.nodes[c.wait].bsym
        position = position_of_grad.get(wait.output.name)
        if position is None or self._forward_inputs is None or position >= len(self._forward_inputs):
            return None, "its result is not returned as a parameter's gradient"
        located = self._slot_of_input(self._forward_inputs[position] or "")
        if located is None:
            return None, "not the gradient of a parameter of a bucket"
        if start.args[4] is not None or "SUM" not in str(start.args[1]):
            return None, f"reduces with {start.args[1]} along dim {start.args[4]}, not a sum along dim 0"
        bucket_id, slot = located
        member = _Member(slot, start, wait, source=start.args[0])
        # Walk from the reduce-scatter's input back through the padding and pre-averaging of its
        # prologue; whatever comes before them (a bias gradient's sum) stays where it is.
        producer = {o.name: annotated.nodes[i].bsym for i in c.prologue for o in annotated.nodes[i].bsym.flat_proxy_outs}
        while member.source.name in producer and _is_absorbable(producer[member.source.name]):
            bsym = producer[member.source.name]
            problem = _absorb(bsym, member, self.process_group.size())
            if problem is not None:
                return None, problem
            member.prologue.append(bsym)
            member.source = next(a for a in bsym.flat_proxy_args if isinstance(a, TensorProxy))
        plan = self.buckets[bucket_id].plan
        if to_torch_dtype(member.source.dtype) != plan.dtype:
            return None, f"gradient dtype {member.source.dtype} differs from the bucket's {plan.dtype}"
        return (bucket_id, member), None


def _forward_flat_args(ret: BoundSymbol) -> list:
    """The forward's inputs in the order the backward returns their gradients."""
    first = ret.args[0] if ret.args else None
    if isinstance(first, tuple) and first and isinstance(first[0], dict):
        first = first[0]
    if isinstance(first, dict) and "flat_args" in first:
        return list(first["flat_args"])
    return []


def _is_absorbable(bsym: BoundSymbol) -> bool:
    name = bsym.sym.name
    return "pad" in name or name in ("true_divide", "div")


def _absorb(bsym: BoundSymbol, member: _Member, world_size: int) -> str | None:
    """Checks that a padding or pre-averaging op is one the bucketed reduce-scatter can do
    itself (``_chunk_cat`` pads rows with zeros; the divisor is applied in place); records the
    divisor."""
    name = bsym.sym.name
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
        regenerated = bsym.sym.id is prims.PrimIDs.DEL or (is_backward and bsym.sym.name == "clear_mutable_collection")
        if i in removed or regenerated:
            continue
        bsyms.append(bsym)
    rebuilt.bound_symbols = bsyms
    rebuilt = del_last_used(rebuilt, clear_mutable_collections=is_backward)
    rebuilt.set_provenance(TraceProvenance("thunder_overlap: bucketed collectives"))
    return rebuilt
