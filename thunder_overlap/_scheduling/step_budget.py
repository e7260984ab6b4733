"""A forward may use the memory its backward needs anyway ([Note: the step's budget] in
docs/design.md).

The budget bounds each pass's predicted peak by its just-in-time order's plus the slack. Thunder
compiles a forward before its backward, so the forward is first scheduled against its own. Where
the backward's just-in-time order peaks higher than that budget, memory up to the backward's peak
is memory the step needs anyway: a forward whose order its own budget changed (a prefetch held
back, a wait forced, a retry, the fall-back) is scheduled again with that peak as its budget, and
kept where it is faster and the backward's just-in-time order needs no more after it (the pool
buffers a forward adds are held through the backward), so that the step's peak does not grow.
"""

from __future__ import annotations

from collections.abc import Callable

from thunder_overlap._analysis.classify import AnnotatedTrace, classify_trace
from thunder_overlap._analysis.cost_model import CostModel
from thunder_overlap._analysis.memory_estimate import MemoryEstimate
from thunder_overlap._analysis.simulator import simulate
from thunder_overlap._scheduling.dispatch import ScheduledTrace, schedule_trace
from thunder_overlap._scheduling.limits import JUST_IN_TIME_LIMITS
from thunder_overlap._scheduling.scheduler import OverlapScheduler
from thunder_overlap.config import OverlapConfig

__all__ = ["forward_within_step_budget", "schedule_step"]


def schedule_step(
    forward: AnnotatedTrace | None,
    backward: AnnotatedTrace | None,
    config: OverlapConfig,
    *,
    largest_block_bytes: int | None,
    cost_model: Callable[[AnnotatedTrace], CostModel],
    basis_floor_bytes: int | None = None,
) -> tuple[ScheduledTrace | None, ScheduledTrace | None]:
    """A forward and its backward (None: not scheduled) scheduled by ``config`` as a compile
    schedules them: the forward, in the memory its backward needs anyway where a budget applies
    and that pays, then the backward after it. ``cost_model`` gives each pass's;
    ``basis_floor_bytes``: see :func:`schedule_trace`."""

    def schedule(trace: AnnotatedTrace, after: ScheduledTrace | None = None, step_peak_bytes: int | None = None) -> ScheduledTrace:
        return schedule_trace(
            trace,
            config,
            largest_block_bytes=largest_block_bytes,
            cost_model=cost_model(trace),
            memory_after=after.memory if after is not None else None,
            budget_after=after.budget_basis if after is not None else None,
            step_peak_bytes=step_peak_bytes,
            basis_floor_bytes=basis_floor_bytes,
        )

    scheduled_forward = schedule(forward) if forward is not None else None
    if backward is None:
        return scheduled_forward, None
    if scheduled_forward is not None:

        def reschedule(step_peak_bytes: int) -> ScheduledTrace:
            return schedule(forward, step_peak_bytes=step_peak_bytes)

        widened = forward_within_step_budget(scheduled_forward, backward, reschedule, cost_model(forward))
        scheduled_forward = widened or scheduled_forward
    return scheduled_forward, schedule(backward, scheduled_forward)


def forward_within_step_budget(
    forward: ScheduledTrace, backward: AnnotatedTrace, reschedule: Callable[[int], ScheduledTrace], cost_model: CostModel
) -> ScheduledTrace | None:
    """``forward`` scheduled again by ``reschedule(step_peak_bytes)`` with ``backward``'s
    just-in-time peak (after the forward's just-in-time order) as its budget, where its own
    budget bound (``ScheduleSummary.budget_bound``) and is lower; None where there is nothing to
    gain, the result is not predicted faster, or ``backward``'s just-in-time order would need more
    memory after it than after ``forward``."""
    summary, basis = forward.summary, forward.budget_basis
    if summary is None or summary.budget_bytes is None or basis is None or forward.memory is None:
        return None
    if not summary.budget_bound:
        return None
    step_peak = _just_in_time_memory(backward, after=basis).peak_bytes
    if step_peak <= summary.budget_bytes:
        return None
    widened = reschedule(step_peak)
    if widened.memory is None:
        return None
    backward_needs = _just_in_time_memory(backward, after=forward.memory).peak_bytes
    if _just_in_time_memory(backward, after=widened.memory).peak_bytes > backward_needs:
        return None
    if _step_ms(widened, cost_model) >= _step_ms(forward, cost_model):
        return None
    return widened


def _just_in_time_memory(backward: AnnotatedTrace, *, after: MemoryEstimate) -> MemoryEstimate:
    """``backward``'s just-in-time order's estimate after a forward whose estimate is ``after``."""
    return OverlapScheduler(backward, JUST_IN_TIME_LIMITS, memory_after=after).estimate_baseline_memory()[1]


def _step_ms(scheduled: ScheduledTrace, cost_model: CostModel) -> float:
    """The scheduled trace simulated as it runs (a coalesced launch is one collective)."""
    final = classify_trace(scheduled.trace, scheduled.annotated.layouts)
    return simulate(final, list(range(len(final.nodes))), cost_model).step_ms
