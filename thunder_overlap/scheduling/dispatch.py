"""One entry point from an execution trace to its scheduled trace, for the schedule transform
and the policy comparison alike: classify, pick stock order or the scheduler by policy, resolve
the limits from the model's block size, schedule, and build the final trace."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from thunder.core.trace import TraceCtx, TraceTag

from thunder_overlap.analysis.classify import AnnotatedTrace, classify_trace
from thunder_overlap.analysis.cost_model import CostModel
from thunder_overlap.config import OverlapConfig
from thunder_overlap.scheduling.issue_order import IssueOrder
from thunder_overlap.scheduling.orders import apply_order, stock_order
from thunder_overlap.scheduling.scheduler import OverlapScheduler
from thunder_overlap.scheduling.summary import ScheduleSummary

__all__ = ["ScheduledTrace", "schedule_trace"]

logger = logging.getLogger(__name__)

# A cost model, or a function building one for the trace: called only when the limits stretch
# prefetching by time, the only decision that reads estimates.
CostModelSource = CostModel | Callable[[AnnotatedTrace], CostModel | None] | None


@dataclass(frozen=True)
class ScheduledTrace:
    trace: TraceCtx  # the execution trace in ``order``, deletions regenerated
    annotated: AnnotatedTrace
    order: list[int]  # node indices of ``annotated``
    summary: ScheduleSummary | None  # None where nothing was scheduled: the stock policy, or no collectives


def schedule_trace(
    trace: TraceCtx | AnnotatedTrace,
    config: OverlapConfig,
    *,
    largest_block_bytes: int | None,
    cost_model: CostModelSource = None,
    issue_order: IssueOrder | None = None,
) -> ScheduledTrace:
    """Schedules ``trace`` by ``config.policy``; limits are resolved from ``largest_block_bytes``
    (None when the model has no repeated blocks). With ``issue_order``, every process group issues
    its collectives in that order (the stock policy must already do so, or ValueError)."""
    annotated = trace if isinstance(trace, AnnotatedTrace) else classify_trace(trace)
    if not annotated.collectives:
        return ScheduledTrace(annotated.trace, annotated, stock_order(annotated), None)
    provenance = f"thunder_overlap: {config.policy} schedule"
    if config.policy == "stock":
        order = stock_order(annotated)
        if issue_order is not None and IssueOrder.of_schedule(annotated, order) != issue_order:
            raise ValueError("the stock policy keeps Thunder's order, which does not follow the given issue order")
        return ScheduledTrace(apply_order(annotated, order, provenance=provenance), annotated, order, None)
    limits = config.limits(largest_block_bytes)
    if callable(cost_model):
        cost_model = cost_model(annotated) if limits.prefetch_time_margin is not None else None
    scheduler = OverlapScheduler(annotated, limits, cost_model, issue_order=issue_order)
    order = scheduler.schedule()
    scheduled = scheduler.checked_trace
    if scheduled is None:
        scheduled = apply_order(annotated, order, provenance=provenance)
    pass_name = "backward" if TraceTag.BACKWARD in annotated.trace.tags else "forward"
    logger.info("%s %s schedule of %d collectives: %s", pass_name, config.policy, len(annotated.collectives), scheduler.summary.describe())
    return ScheduledTrace(scheduled, annotated, order, scheduler.summary)
