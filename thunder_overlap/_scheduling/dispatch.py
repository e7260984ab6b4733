"""One entry point from an execution trace to its scheduled trace, for the schedule transform
and the policy comparison alike: classify, pick stock order or the scheduler by policy, resolve
the limits from the model's block size, schedule, coalesce launches, and build the final trace."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from thunder.core.trace import TraceCtx

from thunder_overlap._analysis.classify import AnnotatedTrace, classify_trace
from thunder_overlap._analysis.cost_model import CostModel, default_cost_model
from thunder_overlap._analysis.memory_estimate import MemoryEstimate, estimate_memory
from thunder_overlap._analysis.passes import Pass
from thunder_overlap._scheduling.issue_order import IssueOrder
from thunder_overlap._scheduling.launches import LaunchGroup, apply_launches, candidate_runs, plan_launches
from thunder_overlap._scheduling.limits import resolve_limits
from thunder_overlap._scheduling.orders import apply_order, stock_order
from thunder_overlap._scheduling.scheduler import OverlapScheduler
from thunder_overlap._scheduling.summary import ScheduleSummary
from thunder_overlap.config import OverlapConfig

__all__ = ["ScheduledTrace", "schedule_trace"]

logger = logging.getLogger(__name__)


# A cost model, or a function building one for the trace: called only when a decision reads
# estimates (the limits stretch prefetching by time, or some collectives could be coalesced).
# None: default_cost_model where one is needed.
CostModelSource = CostModel | Callable[[AnnotatedTrace], CostModel | None] | None


@dataclass(frozen=True)
class ScheduledTrace:
    trace: TraceCtx  # the execution trace in ``order``, deletions regenerated
    annotated: AnnotatedTrace
    order: list[int]  # node indices of ``annotated``
    summary: ScheduleSummary | None  # None where nothing was scheduled: the stock policy, or no collectives
    # Collectives of ``order`` that ``trace`` launches together (coalesced).
    launches: tuple[LaunchGroup, ...] = ()
    # ``trace``'s memory estimate where the memory budget was checked (else None): a backward's
    # schedule counts its inputs with its forward's (``memory_after``).
    memory: MemoryEstimate | None = None
    # The just-in-time order's estimate the budget was relative to (else None): a backward's
    # budget is relative to its forward's (``budget_after``).
    budget_basis: MemoryEstimate | None = None


def schedule_trace(
    trace: TraceCtx | AnnotatedTrace,
    config: OverlapConfig,
    *,
    largest_block_bytes: int | None,
    cost_model: CostModelSource = None,
    issue_order: IssueOrder | None = None,
    launches: list[list[int]] | None = None,
    memory_after: MemoryEstimate | None = None,
    budget_after: MemoryEstimate | None = None,
    step_peak_bytes: int | None = None,
    basis_floor_bytes: int | None = None,
    caps_pool_reduce_scatters: bool = True,
) -> ScheduledTrace:
    """Schedules ``trace`` by ``config.policy``; limits are resolved from ``largest_block_bytes``
    (None when the model has no repeated blocks). With ``issue_order``, every process group issues
    its collectives in that order (the stock policy must already do so, or ValueError). With
    ``launches`` (collective indices, each list in issue order) exactly those are coalesced, as
    agreed between ranks; otherwise, where ``config.coalesces``, the cost model decides.
    ``memory_after``: the memory estimate of the trace that produced this one's inputs (for a
    backward, its forward's :attr:`ScheduledTrace.memory`), so that the budget counts persistent
    and shared inputs as the report does; ``budget_after``: its forward's
    :attr:`ScheduledTrace.budget_basis`, so that the budget is the just-in-time step's;
    ``step_peak_bytes``: for a forward, its backward's just-in-time peak, its budget where higher
    than its own ([Note: the step's budget]); ``basis_floor_bytes``: the least just-in-time peak
    the budget is relative to (plain ZeRO3's where it keeps what is free: [Note: ZeRO3 keeps what is free]).
    ``caps_pool_reduce_scatters``: see :func:`resolve_limits`."""
    annotated = trace if isinstance(trace, AnnotatedTrace) else classify_trace(trace)
    if not annotated.collectives:
        return ScheduledTrace(annotated.trace, annotated, stock_order(annotated), None)
    if config.policy.keeps_thunder_order:
        order = stock_order(annotated)
        if issue_order is not None and IssueOrder.of_schedule(annotated, order) != issue_order:
            raise ValueError("the stock policy keeps Thunder's order, which does not follow the given issue order")
        return ScheduledTrace(apply_order(annotated, order, provenance=_provenance(config)), annotated, order, None)
    runs_buckets = annotated.runs_buckets
    limits = resolve_limits(config, largest_block_bytes, runs_buckets=runs_buckets, caps_pool_reduce_scatters=caps_pool_reduce_scatters)
    estimates = _CostModelOnDemand(annotated, cost_model)
    # Prefetching stretches by time only with a given cost model; coalescing falls back to the default.
    stretches = limits.prefetch_time_margin is not None and cost_model is not None
    scheduler = OverlapScheduler(
        annotated,
        limits,
        estimates.get() if stretches else None,
        issue_order=issue_order,
        memory_after=memory_after,
        budget_after=budget_after,
        step_peak_bytes=step_peak_bytes,
        basis_floor_bytes=basis_floor_bytes,
    )
    order = scheduler.schedule()
    if launches is not None:
        planned = [LaunchGroup(tuple(members)) for members in launches]
    elif config.coalesces and candidate_runs(annotated, order):
        planned = plan_launches(annotated, order, estimates.get())
    else:
        planned = []
    scheduled, memory, planned = _coalesce(
        annotated, order, planned, scheduler, agreed=launches is not None, memory_after=memory_after, provenance=_provenance(config)
    )
    if scheduled is None and scheduler.checked_trace is not None:
        scheduled, memory = scheduler.checked_trace, scheduler.checked_memory
    elif scheduled is None:
        scheduled = apply_order(annotated, order, provenance=_provenance(config))
        if limits.memory_budget is not None:  # fell back to the just-in-time order
            memory = estimate_memory(scheduled, layouts=annotated.layouts, after=memory_after)
    summary = scheduler.summary.describe()
    logger.info("%s %s schedule of %d collectives: %s", Pass.of(annotated.trace), config.policy, len(annotated.collectives), summary)
    return ScheduledTrace(scheduled, annotated, order, scheduler.summary, tuple(planned), memory, scheduler.budget_basis)


def _provenance(config: OverlapConfig) -> str:
    return f"thunder_overlap: {config.policy} schedule"


def _coalesce(
    annotated: AnnotatedTrace,
    order: list[int],
    planned: list[LaunchGroup],
    scheduler: OverlapScheduler,
    *,
    agreed: bool,
    memory_after: MemoryEstimate | None,
    provenance: str,
) -> tuple[TraceCtx | None, MemoryEstimate | None, list[LaunchGroup]]:
    """The trace of ``order`` with ``planned`` launched together and its memory (where the budget
    was checked), or (None, None, []) where there is nothing to coalesce or coalescing would break
    the budget. Launches ``agreed`` between ranks are kept whatever this rank predicts (all ranks
    must launch the same)."""
    if not planned:
        return None, None, []
    scheduled = apply_launches(annotated, order, planned, provenance=provenance)
    summary, memory = scheduler.summary, None
    if summary.budget_bytes is not None:
        # A launch waits for all its members at the first one's wait, so later members' outputs
        # live longer: the budget is checked again.
        memory = estimate_memory(scheduled, layouts=annotated.layouts, after=memory_after)
        if memory.peak_bytes > summary.budget_bytes and not agreed:
            logger.debug("coalesced launches would peak at %d B, over the budget of %d B", memory.peak_bytes, summary.budget_bytes)
            return None, None, []
        summary.peak_bytes = memory.peak_bytes
    summary.coalesced_launches = len(planned)
    summary.coalesced_collectives = sum(len(g.members) for g in planned)
    return scheduled, memory, planned


class _CostModelOnDemand:
    """The cost model, built (when given as a function, or defaulted) at most once, when first needed."""

    def __init__(self, annotated: AnnotatedTrace, source: CostModelSource) -> None:
        self._annotated, self._source, self._built = annotated, source, None

    def get(self) -> CostModel | None:
        if isinstance(self._source, CostModel):
            return self._source
        if self._built is None:
            self._built = self._source(self._annotated) if callable(self._source) else default_cost_model(self._annotated)
        return self._built
