"""Scheduling: choose where each collective is issued and waited on around fixed-order compute.

Compute ops (``NodeKind.COMPUTE``) are emitted in the order Thunder produced them. Around them:
- all-gathers are issued in order of first use, as early as their inputs and the limits allow,
  so each overlaps the compute before its first use (prefetch). The limits
  (:mod:`~thunder_overlap._scheduling.limits`): a prefetch distance in expensive compute ops
  (stretched where the cost model says the compute in between is too short to hide the
  collective), all-gathers and bytes in flight, and a memory budget;
- reduce-scatters (and any other collective) are issued as soon as their input is complete,
  forcing the oldest one's wait first when a reduce-scatter limit would be exceeded, or when the
  predicted memory of the next compute op is over budget. They free memory when waited on, so
  they go out even while an all-gather is held back;
- waits (and the parameter views that follow them) are emitted just before their first use;
- collectives of one process group complete in issue order, so waiting on one first waits on every
  earlier one of its group; this keeps every rank's wait order equal to its issue order;
- with an :class:`~thunder_overlap._scheduling.issue_order.IssueOrder`, no collective is issued
  before its predecessors on its process group.

The memory budget is relative to the just-in-time order (:func:`just_in_time_order`): the
scheduler estimates that order's memory once (:mod:`~thunder_overlap._scheduling.memory_budget`), tracks what
its own decisions add, and checks the final order with the memory estimator; if the model was
optimistic it schedules again with the overshoot held back ([Note: pool growth] in
docs/design.md), then once with one all-gather in flight, and only if that too is over the budget
returns the just-in-time order itself.

The result depends only on the trace, the limits and the cost model's estimates, never on hashing
or timing, so every rank computes the same order as long as they agree on the estimates.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from thunder.core.trace import TraceCtx

from thunder_overlap._analysis.classify import AnnotatedTrace, NodeKind
from thunder_overlap._analysis.cost_model import CostModel
from thunder_overlap._analysis.memory_estimate import MemoryEstimate, estimate_memory
from thunder_overlap._analysis.simulator import simulate
from thunder_overlap._scheduling.issue_order import IssueOrder
from thunder_overlap._scheduling.limits import JUST_IN_TIME_LIMITS, MemoryBudget, PrefetchDistance, ScheduleLimits
from thunder_overlap._scheduling.memory_budget import MemoryProfile, baseline_profile
from thunder_overlap._scheduling.orders import apply_order, stock_order
from thunder_overlap._scheduling.summary import ScheduleSummary
from thunder_overlap._scheduling.walk import ScheduleWalk

__all__ = ["OverlapScheduler", "ScheduleSummary", "apply_order", "just_in_time_order", "stock_order"]

logger = logging.getLogger(__name__)

# Schedules tried against the memory budget before settling for the just-in-time order. Each
# retry holds back the previous attempt's overshoot, which the profile under-predicted.
MAX_ATTEMPTS = 3


def just_in_time_order(annotated: AnnotatedTrace, issue_order: IssueOrder | None = None) -> list[int]:
    """Each all-gather right before its first use, each reduce-scatter waited right after its
    issue: no overlap and the least memory, the memory budget's baseline."""
    return OverlapScheduler(annotated, JUST_IN_TIME_LIMITS, issue_order=issue_order).schedule()


class OverlapScheduler:
    """List scheduler over one annotated execution trace.

    Phases, each a method: :meth:`find_first_uses` (which compute op needs each collective
    first), :meth:`estimate_costs` (the prefetch distance, from compute and collective times),
    :meth:`estimate_baseline_memory` (the just-in-time order's memory profile), then
    :meth:`schedule` (walks over compute in order, :class:`~thunder_overlap._scheduling.walk.ScheduleWalk`,
    until one fits the memory budget); what was decided is left in :attr:`summary`. Each walk is
    incremental, O(nodes log nodes).
    """

    def __init__(
        self,
        annotated: AnnotatedTrace,
        limits: ScheduleLimits,
        cost_model: CostModel | None = None,
        *,
        issue_order: IssueOrder | None = None,
        memory_after: MemoryEstimate | None = None,
        budget_after: MemoryEstimate | None = None,
        step_peak_bytes: int | None = None,
        basis_floor_bytes: int | None = None,
    ) -> None:
        if issue_order is not None:
            issue_order.check(annotated)
        self.annotated = annotated
        self.limits = limits
        self.cost_model = cost_model
        self.issue_order = issue_order
        # The estimate of the trace that produced this one's inputs (a backward's forward): which
        # inputs are persistent and which share storage, as the report counts them.
        self.memory_after = memory_after
        # That trace's just-in-time order's estimate (its ``budget_basis``): the budget is the
        # just-in-time step's, so what an earlier pass added (a pool grown in the forward) is
        # spent from the same slack, not granted again ([Note: pool growth]).
        self.budget_after = budget_after
        # For a forward: its backward's just-in-time peak, which is its budget where higher than
        # its own ([Note: the step's budget]).
        self.step_peak_bytes = step_peak_bytes
        # The least just-in-time peak the budget is relative to: plain ZeRO3's with nothing kept,
        # where it keeps what is free ([Note: ZeRO3 keeps what is free]).
        self.basis_floor_bytes = basis_floor_bytes
        # The just-in-time order's estimate, after ``budget_after``: what the budget is relative to.
        self.budget_basis: MemoryEstimate | None = None
        self.nodes = annotated.nodes
        self.anchors = [n.index for n in self.nodes if n.kind is NodeKind.COMPUTE]
        self.summary = ScheduleSummary()
        # The execution trace of the returned order and its memory estimate, when the budget
        # check built them already.
        self.checked_trace: TraceCtx | None = None
        self.checked_memory: MemoryEstimate | None = None

    def find_first_uses(self) -> list[int]:
        """For each collective, the position in ``self.anchors`` of the first compute op that
        reads its result (through its wait and epilogue ops); ``len(anchors)`` if only the
        return does."""
        first_use = [len(self.anchors)] * len(self.annotated.collectives)
        seen: set[int] = set()
        readers = [*self.anchors, *(n.index for n in self.nodes if n.kind is NodeKind.RETURN)]
        for position, reader in enumerate(readers):
            stack = [reader]
            while stack:
                node = self.nodes[stack.pop()]
                for name in node.inputs:
                    p = self.annotated.producer.get(name)
                    if p is None or p in seen or self.nodes[p].kind not in (NodeKind.WAIT, NodeKind.EPILOGUE):
                        continue
                    seen.add(p)
                    if self.nodes[p].kind is NodeKind.WAIT:
                        c = self.nodes[p].collective
                        first_use[c] = min(first_use[c], position)
                    stack.append(p)
        return first_use

    def estimate_costs(self) -> PrefetchDistance:
        """The prefetch distance, with compute and collective times when the limits stretch it by time."""
        return PrefetchDistance.estimate(self.annotated, self.anchors, self.limits, self.cost_model)

    def estimate_baseline_memory(self) -> tuple[list[int], MemoryEstimate]:
        """The just-in-time order's live bytes per compute segment, and its memory estimate."""
        order = just_in_time_order(self.annotated, self.issue_order)
        trace = apply_order(self.annotated, order, provenance="thunder_overlap: just-in-time baseline")
        estimate = estimate_memory(trace, layouts=self.annotated.layouts, after=self.memory_after)
        return baseline_profile(self.annotated, trace, estimate), estimate

    def schedule(self) -> list[int]:
        """Node indices of the annotated trace in execution order."""
        first_use = self.find_first_uses()
        distance = self.estimate_costs()

        def walk(limits: ScheduleLimits, memory: MemoryBudget | None) -> ScheduleWalk:
            walk = ScheduleWalk(self.annotated, first_use, limits, distance, memory, self.summary, self.issue_order)
            walk.run()
            return walk

        kept = walk(self.limits, None) if self.limits.memory_budget is None else self._schedule_within_budget(walk)
        if kept is None:  # the just-in-time order: every wait at its first use
            order = just_in_time_order(self.annotated, self.issue_order)
        else:
            order = kept.builder.order
            self.summary.forced_waits, self.summary.forced_waits_for_memory = kept.forced_waits, kept.forced_waits_for_memory
        logger.debug(
            "scheduled %d collectives around %d compute ops: %s",
            len(self.annotated.collectives),
            len(self.anchors),
            self.summary.describe(),
        )
        return order

    def _schedule_within_budget(self, walk: Callable[[ScheduleLimits, MemoryBudget | None], ScheduleWalk]) -> ScheduleWalk | None:
        """Walks until the estimator confirms an order within the budget, holding back each
        attempt's overshoot in the next; then one all-gather in flight; None (the just-in-time
        order) if that too is over the budget or predicted slower."""
        baseline, baseline_memory = self.estimate_baseline_memory()
        self.budget_basis = baseline_memory
        if self.budget_after is not None:
            self.budget_basis = estimate_memory(baseline_memory.trace, layouts=self.annotated.layouts, after=self.budget_after)
        budget = self.limits.memory_budget.budget(max(self.budget_basis.peak_bytes, self.basis_floor_bytes or 0))
        if (self.step_peak_bytes or 0) > budget:  # [Note: the step's budget]
            budget = self.summary.step_peak_bytes = self.step_peak_bytes
        self.summary.baseline_peak_bytes, self.summary.budget_bytes = self.budget_basis.peak_bytes, budget
        limits, held_back = self.limits, 0
        for attempt in range(1, MAX_ATTEMPTS + 1):
            self.summary.attempts = attempt
            walked = walk(limits, MemoryBudget(MemoryProfile(baseline, budget - held_back)))
            memory = self._check(walked.builder.order)
            if memory.peak_bytes <= budget:
                return walked
            # [Note: pool growth]: what the bucket pool grew by is held back from the all-gathers
            # in flight, the rest from the memory profile.
            overshoot = memory.peak_bytes - budget
            from_pool = min(overshoot, max(memory.pool.nbytes - baseline_memory.pool.nbytes, 0))
            if from_pool:
                cap = walked.allgathers.in_flight.peak_bytes - from_pool
                limits = replace(limits, max_allgather_bytes=min(cap, limits.max_allgather_bytes or cap))
            logger.debug(
                "attempt %d: predicted peak %d B over the budget of %d B; holding back the overshoot (%d B of it the pool's)",
                attempt,
                memory.peak_bytes,
                budget,
                from_pool,
            )
            held_back += overshoot - from_pool
        just_in_time = just_in_time_order(self.annotated, self.issue_order)
        # [Note: pool growth]: one all-gather in flight, where the retries ran out before reaching it.
        self.summary.attempts += 1
        one_ahead = replace(limits, max_allgathers=1, max_allgather_bytes=None, early_allgather_bytes=None)
        walked = walk(one_ahead, MemoryBudget(MemoryProfile(baseline, budget - held_back)))
        if self._check(walked.builder.order).peak_bytes <= budget and not self._slower(walked.builder.order, than=just_in_time):
            return walked
        self.summary.fell_back_to_just_in_time = True
        self.summary.peak_bytes = baseline_memory.peak_bytes
        self.checked_trace = self.checked_memory = None
        return None

    def _check(self, order: list[int]) -> MemoryEstimate:
        """Applies ``order`` and estimates its memory; the last order checked is the one kept
        (``checked_trace``, ``checked_memory``, the summary's peak) unless the caller falls back."""
        self.checked_trace = apply_order(self.annotated, order, provenance="thunder_overlap: memory_aware schedule")
        self.checked_memory = estimate_memory(self.checked_trace, layouts=self.annotated.layouts, after=self.memory_after)
        self.summary.peak_bytes = self.checked_memory.peak_bytes
        return self.checked_memory

    def _slower(self, order: list[int], *, than: list[int]) -> bool:
        """Whether the cost model predicts ``order`` slower than order ``than`` (never, without one)."""
        if self.cost_model is None:
            return False
        return simulate(self.annotated, order, self.cost_model).step_ms > simulate(self.annotated, than, self.cost_model).step_ms
