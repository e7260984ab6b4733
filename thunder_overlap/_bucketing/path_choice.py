"""The bucket path choice: one step, at the backward's first compile, from the final traces of a
step to the layouts the buckets run with from then on, and the backward as it runs with them.

Three changes, in this order ([Note: bucket paths] in ``docs/design.md`` says why each exists and
why in this order):

1. over a backend that copies a reduce-scatter's input (gloo), lay-outs held to their wait that
   would make the pool hold a buffer the step can spare go from the backend's copy instead
   (``ReducePath.FROM_COPY``); chosen on the backward scheduled without the cap on pool-holding
   reduce-scatters, which is then rescheduled with it, so that the cap counts only the lay-outs
   still held;
2. over a backend that runs a coalesced launch one collective at a time (gloo), buckets whose
   copy-out would do the same gather each parameter in place instead (``GatherPath.IN_PLACE``);
3. reduce-scatters issued when a pool buffer would sit idle to the step's end reduce in place in
   it (``ReducePath.IN_POOL``), where the pool does not grow for it (``OverlapConfig.reduce_in_pool``).

Changes 1 and 2 take the fewest buckets that make the pool as small as changing all candidates
would, and only where the step's predicted peak falls and the simulator predicts the step at most
the change's ``max_slowdown`` slower. Every change is agreed between ranks (it alters what they
launch): ``agree`` keeps the labels every rank chose, and every rank calls it once per enabled
change, whatever it chose.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from thunder.core.trace import TraceCtx

from thunder_overlap._analysis.classify import AnnotatedTrace, classify_trace
from thunder_overlap._analysis.cost_model import CostModel
from thunder_overlap._analysis.layout import BucketLayout, BucketLayouts, GatherPath, ReducePath
from thunder_overlap._analysis.memory_estimate import MemoryEstimate, estimate_memory
from thunder_overlap._analysis.pool_slots import (
    PoolInterval,
    fewest_per_tensor_gathers,
    fewest_reduce_scatters_from_copy,
    plan_shards_in_pool,
)
from thunder_overlap._analysis.simulator import simulate
from thunder_overlap._scheduling.dispatch import ScheduledTrace

__all__ = ["GATHERED_PER_PARAMETER", "REDUCED_FROM_COPY", "REDUCED_IN_POOL", "ChangeOutcome", "PathChoice", "choose_bucket_paths"]

# The changes, by name.
REDUCED_FROM_COPY = "reduced from gloo's copy"
GATHERED_PER_PARAMETER = "gathered per parameter"
REDUCED_IN_POOL = "reduced in the pool"

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Change:
    """A path some buckets can switch to, sparing a pool buffer for some time."""

    name: str
    # Labels of the buckets that may change, from their layouts and the backward's memory estimate.
    candidates: Callable[[BucketLayouts, MemoryEstimate], list[str]]
    # The fewest candidates that give the smallest pool, from the step's pool intervals.
    fewest: Callable[[list[PoolInterval], list[str]], list[str]]
    change: Callable[[BucketLayout], BucketLayout]


_REDUCE_FROM_COPY = _Change(
    REDUCED_FROM_COPY,
    lambda layouts, backward: [
        issue.layout.label
        for issue in backward.reduce_scatter_issues
        if issue.pool_user is not None and issue.layout.backend.copies_reduce_scatter_input and issue.layout.reduce is ReducePath.LAID_OUT
    ],
    fewest_reduce_scatters_from_copy,
    lambda layout: layout.with_paths(reduce=ReducePath.FROM_COPY),
)
_GATHER_PER_PARAMETER = _Change(
    GATHERED_PER_PARAMETER,
    lambda layouts, backward: [layout.label for layout in layouts.values() if layout.gather is GatherPath.COPY_OUT],
    fewest_per_tensor_gathers,
    lambda layout: layout.with_paths(gather=GatherPath.IN_PLACE),
)


@dataclass(frozen=True)
class ChangeOutcome:
    """What one change chose, and the predictions behind it (for the log and the report)."""

    change: str
    labels: tuple[str, ...] = ()
    # The step's predicted peak before and after, and its predicted time (ms), where compared.
    peak_bytes: tuple[int, int] | None = None
    step_ms: tuple[float, float] | None = None
    reason: str = ""


@dataclass
class PathChoice:
    """The buckets' layouts from now on, the backward as it runs with them, the step's memory
    predicted with them, and what each change chose."""

    layouts: dict[object, BucketLayout]
    backward: ScheduledTrace
    forward_memory: MemoryEstimate
    backward_memory: MemoryEstimate
    outcomes: list[ChangeOutcome] = field(default_factory=list)

    @property
    def peak_bytes(self) -> int:
        return max(self.forward_memory.peak_bytes, self.backward_memory.peak_bytes)

    def outcome(self, change: str) -> ChangeOutcome | None:
        """What ``change`` (one of the names above) chose; None where it was not considered."""
        return next((o for o in self.outcomes if o.change == change), None)

    def labels(self, change: str) -> tuple[str, ...]:
        """The buckets ``change`` switched (none where it was not considered)."""
        outcome = self.outcome(change)
        return outcome.labels if outcome is not None else ()


@dataclass(frozen=True)
class _Step:
    """The final traces of one step, and how to judge them."""

    forward: TraceCtx
    backward: TraceCtx
    cost_model: Callable[[AnnotatedTrace], CostModel]
    reduce_in_pool: bool

    def memory(self, layouts: BucketLayouts) -> tuple[MemoryEstimate, MemoryEstimate]:
        forward = estimate_memory(self.forward, layouts=layouts)
        return forward, estimate_memory(self.backward, layouts=layouts, after=forward)

    def peak_bytes(self, layouts: BucketLayouts) -> int:
        """The step's predicted peak, reduce-scatters in the pool where they would go there."""
        if self.reduce_in_pool:
            layouts = _in_pool(layouts, self.memory(layouts)[1])
        return max(m.peak_bytes for m in self.memory(layouts))

    def time_ms(self, layouts: BucketLayouts) -> float:
        """The simulator's forward plus backward, each in its trace's order."""
        total = 0.0
        for trace in (self.forward, self.backward):
            annotated = classify_trace(trace, layouts)
            if annotated.collectives:
                total += simulate(annotated, list(range(len(annotated.nodes))), self.cost_model(annotated)).step_ms
        return total


def _in_pool(layouts: BucketLayouts, backward: MemoryEstimate) -> dict[object, BucketLayout]:
    chosen = {issue.bucket for issue in plan_shards_in_pool(backward.pool_intervals, backward.reduce_scatter_issues, backward.timeline_end)}
    return {bucket: layout.with_paths(reduce=ReducePath.IN_POOL) if bucket in chosen else layout for bucket, layout in layouts.items()}


def _changed(layouts: BucketLayouts, labels, change: _Change) -> dict[object, BucketLayout]:
    return {bucket: change.change(layout) if layout.label in labels else layout for bucket, layout in layouts.items()}


def _choose(step: _Step, layouts: BucketLayouts, change: _Change, max_slowdown: float) -> ChangeOutcome:
    """The buckets to switch to ``change`` (see the module docstring), without agreement."""
    backward = step.memory(layouts)[1]
    candidates = change.candidates(layouts, backward)
    labels = change.fewest(backward.pool_intervals, candidates) if candidates else []
    if not labels:
        return ChangeOutcome(change.name, reason="no bucket would shrink the pool")
    changed = _changed(layouts, labels, change)
    peaks = (step.peak_bytes(layouts), step.peak_bytes(changed))
    if peaks[1] >= peaks[0]:
        return ChangeOutcome(change.name, peak_bytes=peaks, reason="the step would not peak lower")
    times = (step.time_ms(layouts), step.time_ms(changed))
    if times[1] > times[0] * (1 + max_slowdown):
        return ChangeOutcome(change.name, peak_bytes=peaks, step_ms=times, reason=f"the step would be {times[1] / times[0] - 1:.1%} slower")
    return ChangeOutcome(change.name, tuple(labels), peaks, times, "the step peaks lower")


def choose_bucket_paths(
    forward: TraceCtx,
    backward: ScheduledTrace,
    layouts: BucketLayouts,
    *,
    max_slowdowns: tuple[float | None, float | None],
    reduce_in_pool: bool,
    cost_model: Callable[[AnnotatedTrace], CostModel],
    agree: Callable[[list[str]], list[str]],
    reschedule: Callable[[BucketLayouts], ScheduledTrace] | None,
) -> PathChoice:
    """Chooses the buckets' paths from the final ``forward`` trace and the ``backward`` as
    scheduled (see the module docstring). ``max_slowdowns``: those of reduce-from-copy and of
    per-parameter gathers (None: never). ``reschedule`` schedules the backward again with given
    layouts, in the agreed issue order and with the pool reduce-scatter cap; None where
    ``backward`` was scheduled with it already (no backend path choice)."""
    layouts = dict(layouts)
    outcomes = []
    for change, max_slowdown in zip((_REDUCE_FROM_COPY, _GATHER_PER_PARAMETER), max_slowdowns, strict=True):
        if max_slowdown is not None:
            outcome = _choose(_Step(forward, backward.trace, cost_model, reduce_in_pool), layouts, change, max_slowdown)
            agreed = tuple(agree(list(outcome.labels)))  # every rank exchanges, whatever it chose
            outcomes.append(ChangeOutcome(outcome.change, agreed, outcome.peak_bytes, outcome.step_ms, outcome.reason))
            layouts = _changed(layouts, agreed, change)
        if change is _REDUCE_FROM_COPY and reschedule is not None:
            backward = reschedule(layouts)
    step = _Step(forward, backward.trace, cost_model, reduce_in_pool)
    forward_memory, backward_memory = step.memory(layouts)
    if reduce_in_pool:
        in_pool = _in_pool(layouts, backward_memory)
        labels = agree([layout.label for bucket, layout in in_pool.items() if layout != layouts[bucket]])
        outcomes.append(ChangeOutcome(REDUCED_IN_POOL, tuple(labels), reason="a pool buffer idle to the step's end"))
        if labels:
            layouts = {bucket: in_pool[bucket] if layout.label in labels else layout for bucket, layout in layouts.items()}
            forward_memory, backward_memory = step.memory(layouts)
    for outcome in outcomes:
        if outcome.labels:
            logger.info("thunder_overlap: buckets %s (%s): %s", outcome.change, outcome.reason, list(outcome.labels))
    return PathChoice(layouts, backward, forward_memory, backward_memory, outcomes)
