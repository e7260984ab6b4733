"""Scheduling: choose where each collective is issued and waited on around fixed-order compute.

Compute ops (``NodeKind.COMPUTE``) are emitted in the order Thunder produced them. Around them:
- all-gathers are issued in order of first use, as early as their inputs and the limits allow,
  so each overlaps the compute before its first use (prefetch). The limits: a prefetch distance
  in expensive compute ops (stretched where the cost model says the compute in between is too
  short to hide the collective), all-gathers and bytes in flight, and a memory budget;
- reduce-scatters (and any other collective) are issued as soon as their input is complete,
  forcing the oldest one's wait first when a reduce-scatter limit would be exceeded, or when the
  predicted memory of the next compute op is over budget. They free memory when waited on, so
  they go out even while an all-gather is held back;
- waits (and the parameter views that follow them) are emitted just before their first use;
- collectives of one process group complete in issue order, so waiting on one first waits on every
  earlier one of its group; this keeps every rank's wait order equal to its issue order.

The memory budget is relative to the just-in-time order (:func:`just_in_time_order`): the
scheduler estimates that order's memory once (:mod:`~thunder_overlap.scheduling.memory_budget`), tracks what
its own decisions add, and checks the final order with the memory estimator; if the model was
optimistic it schedules again with the overshoot held back, and after ``MAX_ATTEMPTS`` returns the
just-in-time order itself.

The result depends only on the trace, the limits and the cost model's estimates, never on hashing
or timing, so every rank computes the same order as long as they agree on the estimates.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from itertools import accumulate

from thunder.core.trace import TraceCtx, TraceProvenance, TraceTag, from_trace
from thunder.executors.passes import del_last_used

from thunder_overlap.analysis.classify import AnnotatedTrace, CollectiveKind, NodeKind, is_expensive
from thunder_overlap.config import JUST_IN_TIME_LIMITS, ScheduleLimits
from thunder_overlap.analysis.cost_model import CostModel
from thunder_overlap.scheduling.memory_budget import MemoryProfile, baseline_profile
from thunder_overlap.analysis.memory_estimate import estimate_memory

__all__ = ["OverlapScheduler", "ScheduleSummary", "apply_order", "just_in_time_order", "stock_order"]

# Schedules tried against the memory budget before settling for the just-in-time order. Each
# retry holds back the previous attempt's overshoot, which the profile under-predicted.
MAX_ATTEMPTS = 3


def stock_order(annotated: AnnotatedTrace) -> list[int]:
    """Thunder's own order (deletions left out): the baseline."""
    return [n.index for n in annotated.nodes]


def just_in_time_order(annotated: AnnotatedTrace) -> list[int]:
    """Each all-gather right before its first use, each reduce-scatter waited right after its
    issue: no overlap and the least memory, the memory budget's baseline."""
    return OverlapScheduler(annotated, JUST_IN_TIME_LIMITS).schedule()


@dataclass
class ScheduleSummary:
    """What the scheduler decided and why, for reports and tests."""

    # Waits emitted before their first use to get under a limit (bytes/count, or the budget).
    forced_waits: int = 0
    forced_waits_for_memory: int = 0
    # Predicted peaks (estimate_memory) of the just-in-time order and of the chosen order.
    baseline_peak_bytes: int | None = None
    budget_bytes: int | None = None
    peak_bytes: int | None = None
    attempts: int = 0
    fell_back_to_just_in_time: bool = False
    # Collectives that each limit kept from being issued earlier.
    held: dict[str, set[int]] = field(default_factory=lambda: {"distance": set(), "bytes": set(), "memory": set()})

    @property
    def held_by_distance(self) -> int:
        return len(self.held["distance"])

    @property
    def held_by_bytes(self) -> int:
        return len(self.held["bytes"])

    @property
    def held_by_memory(self) -> int:
        return len(self.held["memory"])


class _InFlight:
    """Collectives counted against an in-flight limit, oldest first, with their byte total."""

    def __init__(self) -> None:
        self.bytes_by_collective: dict[int, int] = {}  # insertion-ordered: oldest first
        self.total_bytes = 0

    def add(self, c: int, nbytes: int) -> None:
        self.bytes_by_collective[c] = nbytes
        self.total_bytes += nbytes

    def discard(self, c: int) -> None:
        self.total_bytes -= self.bytes_by_collective.pop(c, 0)

    def oldest(self) -> int | None:
        return next(iter(self.bytes_by_collective), None)

    def __len__(self) -> int:
        return len(self.bytes_by_collective)


class OverlapScheduler:
    """List scheduler over one annotated execution trace.

    Phases, each a method: :meth:`find_first_uses` (which compute op needs each collective
    first), :meth:`estimate_costs` (compute time before each compute op, time of each
    collective), :meth:`estimate_baseline_memory` (the just-in-time order's memory profile), then
    :meth:`schedule` (walk compute in order, placing collectives and waits around it); what was
    decided is left in :attr:`summary`. Each walk is incremental, O(nodes log nodes).
    """

    def __init__(self, annotated: AnnotatedTrace, limits: ScheduleLimits, cost_model: CostModel | None = None) -> None:
        self.annotated = annotated
        self.limits = limits
        self.cost_model = cost_model
        self.nodes = annotated.nodes
        self.anchors = [n.index for n in self.nodes if n.kind is NodeKind.COMPUTE]
        # Per compute position: expensive ops and estimated milliseconds before it.
        self._expensive_before = [0, *accumulate(int(is_expensive(self.nodes[a].bsym)) for a in self.anchors)]
        self._ms_before: list[float] | None = None
        self._collective_ms: list[float] | None = None
        self._first_use: list[int] = []
        self.summary = ScheduleSummary()
        # The execution trace of the returned order when the budget check built it already.
        self.checked_trace: TraceCtx | None = None

    # ----------------------------------------------------------------------------------------
    # Phase 1: first uses

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

    # ----------------------------------------------------------------------------------------
    # Phase 2: estimates

    def estimate_costs(self) -> None:
        """Milliseconds of compute before each compute position and of each collective (only
        when the limits stretch prefetching by time and a cost model is given)."""
        if self.cost_model is None or self.limits.prefetch_time_margin is None:
            return
        self._ms_before = [0.0, *accumulate(self.cost_model.compute_ms(self.nodes[a].bsym) for a in self.anchors)]
        self._collective_ms = [self.cost_model.collective_ms(c) for c in self.annotated.collectives]

    def estimate_baseline_memory(self) -> tuple[list[int], int]:
        """The just-in-time order's live bytes per compute segment, and its peak."""
        trace = apply_order(self.annotated, just_in_time_order(self.annotated), provenance="thunder_overlap: just-in-time baseline")
        estimate = estimate_memory(trace)
        return baseline_profile(self.annotated, trace, estimate), estimate.peak_bytes

    # ----------------------------------------------------------------------------------------
    # Phase 3: schedule

    def schedule(self) -> list[int]:
        """Node indices of the annotated trace in execution order."""
        self._first_use = self.find_first_uses()
        self.estimate_costs()
        rule = self.limits.memory_budget
        if rule is None:
            return self._walk(None)
        baseline, baseline_peak = self.estimate_baseline_memory()
        budget = rule.budget(baseline_peak)
        self.summary.baseline_peak_bytes, self.summary.budget_bytes = baseline_peak, budget
        held_back = 0
        for attempt in range(1, MAX_ATTEMPTS + 1):
            self.summary.attempts = attempt
            order = self._walk(MemoryProfile(baseline, budget - held_back))
            trace = apply_order(self.annotated, order, provenance="thunder_overlap: memory_aware schedule")
            peak = estimate_memory(trace).peak_bytes
            if peak <= budget:
                self.summary.peak_bytes = peak
                self.checked_trace = trace
                return order
            held_back += peak - budget
        self.summary.fell_back_to_just_in_time = True
        self.summary.peak_bytes = baseline_peak
        return just_in_time_order(self.annotated)

    def _walk(self, memory: MemoryProfile | None) -> list[int]:
        """One pass over the compute ops, placing every collective and wait."""
        collectives = self.annotated.collectives
        first_use = self._first_use
        self._memory = memory
        self._position = 0  # the compute op emitted next
        self._order: list[int] = []
        self._emitted: set[int] = set()
        self._issued: set[int] = set()
        # Per process group, issued collectives not yet waited on, in issue order.
        self._unwaited_by_group: dict[int, deque[int]] = {}
        self._allgathers_in_flight = _InFlight()
        self._others_in_flight = _InFlight()
        # Readiness: how many producers outside its prologue each collective still waits for.
        self._missing_inputs = [0] * len(collectives)
        self._collectives_reading: dict[int, list[int]] = {}
        for c in range(len(collectives)):
            for p in self._group_inputs(c):
                self._missing_inputs[c] += 1
                self._collectives_reading.setdefault(p, []).append(c)
        self._ready_eager: list[int] = []  # heap of ready non-all-gather collectives by start
        # A gathered parameter occupies memory from its issue until its first reader runs, so it
        # counts against the prefetch limits until then (not merely until its wait, which a
        # forced wait of a later collective on the same group can bring forward).
        used_at: dict[int, list[int]] = {}
        for c, coll in enumerate(collectives):
            if coll.kind is CollectiveKind.ALL_GATHER:
                used_at.setdefault(first_use[c], []).append(c)
        prefetch_queue = deque(
            sorted(
                (c for c, coll in enumerate(collectives) if coll.kind is CollectiveKind.ALL_GATHER),
                key=lambda c: (first_use[c], collectives[c].start),
            )
        )
        for c, coll in enumerate(collectives):
            if coll.kind is not CollectiveKind.ALL_GATHER and self._missing_inputs[c] == 0:
                heapq.heappush(self._ready_eager, (coll.start, c))

        for node in self.nodes:
            if node.kind is NodeKind.HEADER:
                self._emit(node.index)
        self._issue_ready(prefetch_queue)
        for position, anchor in enumerate(self.anchors):
            self._fit_memory_of_next_op()
            self._emit(anchor)
            self._position = position + 1
            for c in used_at.get(position, ()):
                self._allgathers_in_flight.discard(c)
            self._issue_ready(prefetch_queue)

        # Whatever the return needs, and waits nobody reads, go last, in issue order.
        for unwaited in self._unwaited_by_group.values():
            while unwaited:
                self._emit_wait_of(unwaited[0])
        for node in self.nodes:
            self._emit(node.index)
        assert len(self._order) == len(self.nodes)
        return self._order

    def _issue_ready(self, prefetch_queue: deque[int]) -> None:
        # All-gathers first: they are on the critical path, and a process group runs its
        # collectives in issue order, so a reduce-scatter issued first would delay them.
        while prefetch_queue:
            c = prefetch_queue[0]
            if c in self._issued:  # a wait needed it before its turn
                prefetch_queue.popleft()
                continue
            if self._missing_inputs[c] or not self._allgather_fits(c):
                break
            self._issue(prefetch_queue.popleft())
        # Off the critical path, and freeing memory once waited on: issue whatever is ready.
        while self._ready_eager:
            _, c = heapq.heappop(self._ready_eager)
            if c in self._issued:
                continue
            self._make_room_for(c)
            self._issue(c)
            self._enforce_reduce_scatter_count()

    # ----------------------------------------------------------------------------------------
    # Limits

    def _allgather_fits(self, c: int) -> bool:
        """Whether all-gather ``c`` may be issued now, before compute op ``self._position``."""
        limits = self.limits
        coll = self.annotated.collectives[c]
        first_use = self._first_use[c]
        if not self._within_distance(c, first_use):
            self.summary.held["distance"].add(c)
            return False
        in_flight = self._allgathers_in_flight
        if in_flight:  # always allow one, or nothing would ever be prefetched
            too_many = limits.max_allgathers is not None and len(in_flight) + 1 > limits.max_allgathers
            too_big = limits.max_allgather_bytes is not None and in_flight.total_bytes + coll.unsharded_bytes > limits.max_allgather_bytes
            if too_many or too_big:
                self.summary.held["bytes"].add(c)
                return False
        if self._memory is not None and not self._memory.fits(self._position, first_use - 1, coll.unsharded_bytes):
            self.summary.held["memory"].add(c)
            return False
        return True

    def _within_distance(self, c: int, first_use: int) -> bool:
        distance = self.limits.max_prefetch_compute_ops
        if distance is None:
            return True
        if self._expensive_before[first_use] - self._expensive_before[self._position] <= distance:
            return True
        # Too far by count, but issued one compute op later, would the compute before its first
        # use still cover it with the margin? If not, now is the latest moment that does.
        if self._ms_before is None or self._collective_ms is None:
            return False
        compute_ms_if_later = self._ms_before[first_use] - self._ms_before[min(self._position + 1, first_use)]
        return compute_ms_if_later < self.limits.prefetch_time_margin * self._collective_ms[c]

    def _make_room_for(self, c: int) -> None:
        """Forces the oldest reduce-scatter waits until ``c`` fits the byte limit."""
        limit = self.limits.max_reduce_scatter_bytes
        if limit is None:
            return
        nbytes = self.annotated.collectives[c].unsharded_bytes
        while self._others_in_flight and self._others_in_flight.total_bytes + nbytes > limit:
            self._force_wait_of(self._others_in_flight.oldest())

    def _enforce_reduce_scatter_count(self) -> None:
        limit = self.limits.max_reduce_scatters
        while limit is not None and len(self._others_in_flight) > limit:
            self._force_wait_of(self._others_in_flight.oldest())

    def _fit_memory_of_next_op(self) -> None:
        """Forces the oldest reduce-scatter waits (each frees an unsharded gradient) until the
        next compute op's predicted memory is within the budget."""
        memory = self._memory
        if memory is None:
            return
        while self._others_in_flight and not memory.fits(self._position, self._position, self._others_in_flight.total_bytes):
            self._force_wait_of(self._others_in_flight.oldest())
            self.summary.forced_waits_for_memory += 1

    def _force_wait_of(self, c: int) -> None:
        self.summary.forced_waits += 1
        self._emit_wait_of(c)

    # ----------------------------------------------------------------------------------------
    # Emission

    def _group_inputs(self, c: int) -> set[int]:
        """Producers outside collective ``c``'s prologue that it reads."""
        coll = self.annotated.collectives[c]
        members = {coll.start, *coll.prologue}
        producers = set()
        for m in members:
            for name in self.nodes[m].inputs:
                p = self.annotated.producer.get(name)
                if p is not None and p not in members:
                    producers.add(p)
        return producers

    def _issue(self, c: int) -> None:
        coll = self.annotated.collectives[c]
        for p in coll.prologue:
            self._emit(p)
        self._emit(coll.start)

    def _emit_wait_of(self, c: int) -> None:
        wait = self.annotated.collectives[c].wait
        if wait is not None:
            self._emit(wait)
        else:  # a collective nobody waits on leaves the books in its group's order
            self._before_wait(c)
            self._retire(c)

    def _emit(self, index: int) -> None:
        if index in self._emitted:
            return
        node = self.nodes[index]
        if node.kind is NodeKind.WAIT:
            self._before_wait(node.collective)
        for name in node.inputs:
            p = self.annotated.producer.get(name)
            if p is not None and p != index and p not in self._emitted:
                if self.nodes[p].kind is NodeKind.COMPUTE:
                    raise AssertionError(f"scheduler would reorder compute: {self.nodes[p].name} for {node.name}")
                self._emit(p)
        if index in self._emitted:  # emitted while resolving a dependency cycle through a group
            return
        self._emitted.add(index)
        self._order.append(index)
        for c in self._collectives_reading.get(index, ()):
            self._missing_inputs[c] -= 1
            coll = self.annotated.collectives[c]
            if self._missing_inputs[c] == 0 and coll.kind is not CollectiveKind.ALL_GATHER:
                heapq.heappush(self._ready_eager, (coll.start, c))
        if node.kind is NodeKind.COLLECTIVE:
            self._record_issue(node.collective)
        elif node.kind is NodeKind.WAIT:
            self._retire(node.collective)

    def _record_issue(self, c: int) -> None:
        coll = self.annotated.collectives[c]
        self._issued.add(c)
        self._unwaited_by_group.setdefault(coll.group_key, deque()).append(c)
        if coll.kind is CollectiveKind.ALL_GATHER:
            self._allgathers_in_flight.add(c, coll.unsharded_bytes)
            if self._memory is not None:
                self._memory.commit(self._position, self._first_use[c] - 1, coll.unsharded_bytes)
        else:
            self._others_in_flight.add(c, coll.unsharded_bytes)

    def _retire(self, c: int) -> None:
        unwaited = self._unwaited_by_group[self.annotated.collectives[c].group_key]
        assert unwaited[0] == c, "waits must follow issue order within a process group"
        unwaited.popleft()
        if self._first_use[c] == len(self.anchors):  # only the return reads it
            self._allgathers_in_flight.discard(c)
        self._others_in_flight.discard(c)

    def _before_wait(self, c: int) -> None:
        """Issues ``c`` if needed, then waits on every collective issued before it on its group:
        they complete first anyway, and waiting in issue order keeps all ranks in step."""
        if c not in self._issued:
            self._issue(c)
        unwaited = self._unwaited_by_group[self.annotated.collectives[c].group_key]
        while unwaited and unwaited[0] != c:
            self._emit_wait_of(unwaited[0])


def apply_order(annotated: AnnotatedTrace, order: list[int], *, provenance: str) -> TraceCtx:
    """Builds the execution trace in the scheduled order, with deletions regenerated."""
    trace = annotated.trace
    is_backward = TraceTag.BACKWARD in trace.tags
    new_trace = from_trace(trace)
    new_trace.bound_symbols = [annotated.nodes[i].bsym for i in order]
    new_trace = del_last_used(new_trace, clear_mutable_collections=is_backward)
    new_trace.set_provenance(TraceProvenance(provenance))
    return new_trace
