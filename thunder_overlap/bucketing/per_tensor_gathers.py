"""Buckets gathered per parameter where their copy-out would cost the pool a buffer the step can spare.

Over a backend that runs a coalesced launch one collective at a time (gloo), a bucket of several
parameters gathers its flat shard rank-major into one pool buffer and copies the parameters out
into a second: one launch, paid for with a copy and a buffer. The pool keeps every buffer for the
whole step, so where those copy-outs make more buffers busy at once than the schedule otherwise
needs, each costs its bytes at the step's peak, wherever the peak is: ZeRO2's last block, whose
rank-major buffer would sit idle from the end of the forward to the end of the step, is the
usual case. As on NCCL, such a bucket can instead gather each parameter straight into its place
(``BucketLayout.per_tensor_gather``): no copy and no second buffer, one launch latency per
parameter (on loopback gloo, 12 gathers of a block's parameters took 1.4x one of the block).

Reduce-scatters stay laid out: sent per gradient, each is a gloo reduce-scatter, an all-reduce of
a copy of its input with its fixed cost (12 of a block's gradients took 5.4x the laid-out buffer's
all-reduce on loopback, and collectives run per tensor made the slow-link step 8.8% slower),
and the gradients and gloo's copies are then held until the wait.

:func:`choose_per_tensor_gathers` chooses from the final forward and backward traces, at the
backward's first compile: the fewest buckets whose gathering in place leaves the pool as small as
gathering all in place would (:func:`~thunder_overlap.analysis.pool_slots.fewest_per_tensor_gathers`),
taken only if the memory estimate of the step (reduce-scatters in the pool included) peaks lower
and the simulator, charging each parameter's launch, predicts the step at most
``OverlapConfig.per_tensor_gather_max_slowdown`` slower. Ranks agree on the choice (it changes
the collectives they launch) and keep it through retraces.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch.distributed as dist
from thunder.core.trace import TraceCtx

from thunder_overlap.analysis.classify import AnnotatedTrace, classify_trace
from thunder_overlap.analysis.cost_model import CostModel
from thunder_overlap.analysis.memory_estimate import MemoryEstimate, estimate_memory
from thunder_overlap.analysis.pool_slots import BucketLayout, fewest_per_tensor_gathers
from thunder_overlap.analysis.simulator import simulate
from thunder_overlap.bucketing.buffers import lookup_bucket
from thunder_overlap.bucketing.reduce_in_pool import shards_in_pool
from thunder_overlap.scheduling.rank_agreement import agreed_subset

__all__ = ["PerTensorGatherChoice", "choose_per_tensor_gathers", "gather_per_tensor"]

logger = logging.getLogger(__name__)


@dataclass
class PerTensorGatherChoice:
    """What :func:`choose_per_tensor_gathers` found: the buckets, and the predictions behind them."""

    # Labels of the buckets to gather in place.
    labels: list[str]
    # The buckets of the traces, by label.
    bucket_ids: dict[str, int]
    # Predicted step peak as laid out, and with those buckets gathered in place.
    peak_bytes: tuple[int, int] | None = None
    # Predicted step time as laid out, and with them (None where not simulated).
    step_ms: tuple[float, float] | None = None
    # Why these buckets, or why none, for the log.
    reason: str = ""


def _bucket_ids(trace: TraceCtx) -> set[int]:
    """Ids of the buckets whose all-gathers ``trace`` issues, alone or in a coalesced launch."""
    ids = set()
    for bsym in trace.bound_symbols:
        if bsym.sym.name == "bucket_all_gather":
            ids.add(bsym.args[0])
        elif bsym.sym.name == "coalesced_bucket_all_gather":
            ids.update(bucket_id for bucket_id, _, _ in bsym.args[1])
    return ids


def _gathered_in_place(layouts: dict[int, BucketLayout], labels: list[str]) -> dict[int, BucketLayout]:
    return {i: replace(layout, per_tensor_gather=True) if layout.label in labels else layout for i, layout in layouts.items()}


def _estimate_step(forward: TraceCtx, backward: TraceCtx, layouts: dict[int, BucketLayout]) -> tuple[MemoryEstimate, MemoryEstimate]:
    forward_memory = estimate_memory(forward, buckets=layouts.get)
    return forward_memory, estimate_memory(backward, after=forward_memory, buckets=layouts.get)


def _step_peak_bytes(forward: TraceCtx, backward: TraceCtx, layouts: dict[int, BucketLayout], reduce_in_pool: bool) -> int:
    """The step's predicted peak with these layouts, reduce-scatters in the pool where they
    would go there (``OverlapConfig.reduce_in_pool``, chosen after this)."""
    forward_memory, backward_memory = _estimate_step(forward, backward, layouts)
    if reduce_in_pool:
        in_pool = shards_in_pool(backward_memory)
        if in_pool:
            layouts = {**layouts, **{i.bucket_id: replace(layouts[i.bucket_id], reduces_in_pool=True) for i in in_pool}}
            forward_memory, backward_memory = _estimate_step(forward, backward, layouts)
    return max(forward_memory.peak_bytes, backward_memory.peak_bytes)


def _predicted_step_ms(forward: TraceCtx, backward: TraceCtx, cost_model: Callable[[AnnotatedTrace], CostModel]) -> float:
    """The simulator's forward plus backward, each in its trace's order (it reads the live
    buckets' layouts for their launches and copies)."""
    total = 0.0
    for trace in (forward, backward):
        annotated = classify_trace(trace)
        if annotated.collectives:
            total += simulate(annotated, list(range(len(annotated.nodes))), cost_model(annotated)).step_ms
    return total


def choose_per_tensor_gathers(
    forward: TraceCtx,
    backward: TraceCtx,
    cost_model: Callable[[AnnotatedTrace], CostModel],
    *,
    max_slowdown: float,
    reduce_in_pool: bool,
) -> PerTensorGatherChoice:
    """The buckets of ``forward`` and ``backward`` (final traces of one step) to gather in place
    (see the module docstring); ``cost_model`` gives each pass's cost model. The live buckets
    keep their layouts."""
    buckets = {bucket_id: lookup_bucket(bucket_id) for bucket_id in _bucket_ids(forward) | _bucket_ids(backward)}
    layouts = {bucket_id: bucket.layout for bucket_id, bucket in buckets.items()}
    ids = {layout.label: bucket_id for bucket_id, layout in layouts.items()}
    if len(ids) != len(layouts):
        raise RuntimeError(f"thunder_overlap bucketing: bucket labels are not unique: {sorted(b.label for b in layouts.values())}")
    candidates = [layout.label for layout in layouts.values() if layout.copies_out]
    if not candidates:
        return PerTensorGatherChoice([], ids, reason="no bucket copies out")
    _, backward_memory = _estimate_step(forward, backward, layouts)
    labels = fewest_per_tensor_gathers(backward_memory.pool_intervals, candidates)
    if not labels:
        return PerTensorGatherChoice([], ids, reason="gathered in place, no bucket would shrink the pool")
    before = _step_peak_bytes(forward, backward, layouts, reduce_in_pool)
    after = _step_peak_bytes(forward, backward, _gathered_in_place(layouts, labels), reduce_in_pool)
    if after >= before:
        return PerTensorGatherChoice([], ids, (before, after), reason="gathered in place, the step would not peak lower")
    as_laid_out = _predicted_step_ms(forward, backward, cost_model)
    try:
        for bucket_id, layout in _gathered_in_place(layouts, labels).items():
            buckets[bucket_id].layout = layout
        in_place = _predicted_step_ms(forward, backward, cost_model)
    finally:
        for bucket_id, layout in layouts.items():
            buckets[bucket_id].layout = layout
    step_ms = (as_laid_out, in_place)
    if in_place > as_laid_out * (1 + max_slowdown):
        reason = f"gathered in place, the step would be {in_place / as_laid_out - 1:.1%} slower"
        return PerTensorGatherChoice([], ids, (before, after), step_ms, reason)
    return PerTensorGatherChoice(labels, ids, (before, after), step_ms, "gathered in place, the step peaks lower")


def gather_per_tensor(choice: PerTensorGatherChoice, group: dist.ProcessGroup | None, *, exchange: bool) -> list[str]:
    """Switches the live buckets chosen by every rank of ``group`` (agreed when ``exchange``: every
    rank must call this) to gather in place; returns their labels."""
    labels = agreed_subset(choice.labels, group) if exchange else list(choice.labels)
    for label in labels:
        bucket = lookup_bucket(choice.bucket_ids[label])
        bucket.layout = replace(bucket.layout, per_tensor_gather=True)
    if labels:
        logger.info("thunder_overlap: buckets gathered per parameter (%s): %s", choice.reason, labels)
    return labels
