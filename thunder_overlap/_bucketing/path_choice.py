"""Choosing, from the final traces of a step, the buckets that switch to a path that spares a pool buffer.

Over gloo some of a bucket's paths cost the pool a buffer that the step does not need: a copy-out
(:mod:`~thunder_overlap._bucketing.per_tensor_gathers`), a lay-out held until the reduce-scatter's
wait (:mod:`~thunder_overlap._bucketing.reduce_from_copy`). Each has an alternative that frees
that buffer sooner for some cost in time. :func:`choose_buckets` makes the choice the same way
for both, at the backward's first compile:

1. the candidates: the buckets whose layout allows the change;
2. the fewest of them that make the pool as small as changing all would
   (:func:`~thunder_overlap._analysis.pool_slots.fewest_for_smallest_pool`, on the live intervals
   of the memory estimate);
3. taken only if the estimate of the step (reduce-scatters in the pool included, as
   ``OverlapConfig.reduce_in_pool`` will place them) then peaks lower, and the simulator predicts
   the step at most ``max_slowdown`` slower.

:func:`apply_choice` switches the live buckets that every rank chose (the change alters what
they launch), and they keep their layouts through retraces.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch.distributed as dist
from thunder.core.trace import TraceCtx

from thunder_overlap._analysis.classify import AnnotatedTrace, classify_trace
from thunder_overlap._analysis.cost_model import CostModel
from thunder_overlap._analysis.memory_estimate import MemoryEstimate, estimate_memory
from thunder_overlap._analysis.pool_slots import BucketLayout, PoolInterval
from thunder_overlap._analysis.simulator import simulate
from thunder_overlap._bucketing.buffers import lookup_bucket
from thunder_overlap._bucketing.reduce_in_pool import shards_in_pool
from thunder_overlap._scheduling.rank_agreement import agreed_subset

__all__ = ["BucketChange", "BucketPathChoice", "Layouts", "apply_choice", "choose_buckets"]

logger = logging.getLogger(__name__)

# The buckets' layouts, by bucket id.
Layouts = dict[int, BucketLayout]


@dataclass(frozen=True)
class BucketChange:
    """One path a bucket can switch to, as :func:`choose_buckets` needs it."""

    # What the change is, for reasons and logs ("gathered per parameter").
    name: str
    # Labels of the buckets that may change, from their layouts and the step's memory estimate.
    candidates: Callable[[Layouts, MemoryEstimate], list[str]]
    # The fewest candidates that give the smallest pool, from the estimate's pool intervals.
    fewest: Callable[[list[PoolInterval], list[str]], list[str]]
    # A layout with the change made.
    change: Callable[[BucketLayout], BucketLayout]


@dataclass
class BucketPathChoice:
    """What :func:`choose_buckets` found: the buckets, and the predictions behind them."""

    # Labels of the buckets to change.
    labels: list[str]
    # The buckets of the traces, by label.
    bucket_ids: dict[str, int]
    # Predicted step peak as they are, and with those buckets changed.
    peak_bytes: tuple[int, int] | None = None
    # Predicted step time as they are, and with them changed (None where not simulated).
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


def _changed(layouts: Layouts, labels: list[str], change: BucketChange) -> Layouts:
    return {i: change.change(layout) if layout.label in labels else layout for i, layout in layouts.items()}


def _estimate_step(forward: TraceCtx, backward: TraceCtx, layouts: Layouts) -> tuple[MemoryEstimate, MemoryEstimate]:
    """The memory estimates of ``forward`` then ``backward`` with the buckets' ``layouts``."""
    forward_memory = estimate_memory(forward, buckets=layouts.get)
    return forward_memory, estimate_memory(backward, after=forward_memory, buckets=layouts.get)


def _step_peak_bytes(forward: TraceCtx, backward: TraceCtx, layouts: Layouts, reduce_in_pool: bool) -> int:
    """The step's predicted peak with these layouts, reduce-scatters in the pool where they
    would go there (``OverlapConfig.reduce_in_pool``, chosen after this)."""
    forward_memory, backward_memory = _estimate_step(forward, backward, layouts)
    if reduce_in_pool:
        in_pool = shards_in_pool(backward_memory)
        if in_pool:
            in_place = {i.bucket_id: replace(layouts[i.bucket_id], reduces_in_pool=True, reduce_scatter_from_copy=False) for i in in_pool}
            forward_memory, backward_memory = _estimate_step(forward, backward, {**layouts, **in_place})
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


def choose_buckets(
    forward: TraceCtx,
    backward: TraceCtx,
    change: BucketChange,
    cost_model: Callable[[AnnotatedTrace], CostModel],
    *,
    max_slowdown: float,
    reduce_in_pool: bool,
) -> BucketPathChoice:
    """The buckets of ``forward`` and ``backward`` (final traces of one step) to switch to
    ``change`` (see the module docstring); ``cost_model`` gives each pass's cost model. The live
    buckets keep their layouts."""
    buckets = {bucket_id: lookup_bucket(bucket_id) for bucket_id in _bucket_ids(forward) | _bucket_ids(backward)}
    layouts = {bucket_id: bucket.layout for bucket_id, bucket in buckets.items()}
    ids = {layout.label: bucket_id for bucket_id, layout in layouts.items()}
    if len(ids) != len(layouts):
        raise RuntimeError(f"thunder_overlap bucketing: bucket labels are not unique: {sorted(b.label for b in layouts.values())}")
    _, backward_memory = _estimate_step(forward, backward, layouts)
    candidates = change.candidates(layouts, backward_memory)
    if not candidates:
        return BucketPathChoice([], ids, reason=f"{change.name}: no bucket can be")
    labels = change.fewest(backward_memory.pool_intervals, candidates)
    if not labels:
        return BucketPathChoice([], ids, reason=f"{change.name}, no bucket would shrink the pool")
    before = _step_peak_bytes(forward, backward, layouts, reduce_in_pool)
    after = _step_peak_bytes(forward, backward, _changed(layouts, labels, change), reduce_in_pool)
    if after >= before:
        return BucketPathChoice([], ids, (before, after), reason=f"{change.name}, the step would not peak lower")
    as_they_are = _predicted_step_ms(forward, backward, cost_model)
    # The simulator and the copy costs read the live buckets' layouts: switch them for the run.
    try:
        for bucket_id, layout in _changed(layouts, labels, change).items():
            buckets[bucket_id].layout = layout
        changed = _predicted_step_ms(forward, backward, cost_model)
    finally:
        for bucket_id, layout in layouts.items():
            buckets[bucket_id].layout = layout
    step_ms = (as_they_are, changed)
    if changed > as_they_are * (1 + max_slowdown):
        reason = f"{change.name}, the step would be {changed / as_they_are - 1:.1%} slower"
        return BucketPathChoice([], ids, (before, after), step_ms, reason)
    return BucketPathChoice(labels, ids, (before, after), step_ms, f"{change.name}, the step peaks lower")


def apply_choice(choice: BucketPathChoice, change: BucketChange, group: dist.ProcessGroup | None, *, exchange: bool) -> list[str]:
    """Switches the live buckets chosen by every rank of ``group`` (agreed when ``exchange``:
    every rank must call this) to ``change``; returns their labels."""
    labels = agreed_subset(choice.labels, group) if exchange else list(choice.labels)
    for label in labels:
        bucket = lookup_bucket(choice.bucket_ids[label])
        bucket.layout = change.change(bucket.layout)
    if labels:
        logger.info("thunder_overlap: buckets %s (%s): %s", change.name, choice.reason, labels)
    return labels
