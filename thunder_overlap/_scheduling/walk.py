"""One scheduling walk: compute in Thunder's order, collectives and waits placed around it.

Before each compute op the walk forces the reduce-scatter waits the memory budget asks for;
after it, it issues what is ready: all-gathers in order of first use while every limit allows
(the first one that does not stops the queue), then every ready reduce-scatter, forcing older
reduce-scatter waits when the in-flight limits ask for it (all reduce-scatter bytes, and those
that keep a bucket pool buffer busy). Waits are emitted when a reader needs
them (:class:`~thunder_overlap._scheduling.order_builder.OrderBuilder`).
"""

from __future__ import annotations

import heapq
import logging
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Literal

from thunder_overlap._analysis.classify import AnnotatedTrace, CollectiveKind, NodeKind
from thunder_overlap._scheduling.issue_order import IssueOrder, IssueOrderCursor
from thunder_overlap._scheduling.limits import AllGatherLimit, MemoryBudget, PrefetchDistance, ReduceScatterLimit, ScheduleLimits
from thunder_overlap._scheduling.order_builder import OrderBuilder
from thunder_overlap._scheduling.summary import ScheduleSummary

__all__ = ["ScheduleWalk"]

logger = logging.getLogger(__name__)


class _ReadyQueue:
    """Ready collectives other than all-gathers, earliest in the trace first. Those behind an
    unissued predecessor in the issue order are set aside until something else is issued."""

    def __init__(self, annotated: AnnotatedTrace) -> None:
        self._start = [c.start for c in annotated.collectives]
        self._heap: list[tuple[int, int]] = []
        self._set_aside: list[int] = []

    def push(self, c: int) -> None:
        heapq.heappush(self._heap, (self._start[c], c))

    def pop(self) -> int | None:
        return heapq.heappop(self._heap)[1] if self._heap else None

    def set_aside(self, c: int) -> None:
        self._set_aside.append(c)

    def requeue_set_aside(self) -> None:
        for c in self._set_aside:
            self.push(c)
        self._set_aside.clear()


class ScheduleWalk:
    """One pass over the compute ops of ``annotated``, placing every collective and wait."""

    def __init__(
        self,
        annotated: AnnotatedTrace,
        first_use: list[int],
        limits: ScheduleLimits,
        distance: PrefetchDistance,
        memory: MemoryBudget | None,
        summary: ScheduleSummary,
        issue_order: IssueOrder | None,
    ) -> None:
        self.annotated = annotated
        self.anchors = [n.index for n in annotated.nodes if n.kind is NodeKind.COMPUTE]
        self.first_use = first_use
        self.distance = distance
        self.memory = memory
        self.summary = summary
        self.allgathers = AllGatherLimit(limits.max_allgathers, limits.max_allgather_bytes, limits.early_allgather_bytes)
        self.reduce_scatters = _ReduceScatterLimits(annotated, limits)
        self.issue_order = IssueOrderCursor(issue_order, annotated) if issue_order is not None else None
        self.position = 0  # the compute op emitted next
        # Waits this walk forced before their first use (the summary takes the kept walk's).
        self.forced_waits = self.forced_waits_for_memory = 0
        self._ready = _ReadyQueue(annotated)
        self.builder = OrderBuilder(annotated, self, self.issue_order)
        self.chained = _ChainedWaits(annotated, limits.chained_wait_compute_ops)

    def run(self) -> list[int]:
        """Node indices of the annotated trace in execution order."""
        prefetch_queue, used_at = _prefetch_queue(self.annotated, self.first_use)
        for c in range(len(self.annotated.collectives)):
            if self.builder.missing_inputs[c] == 0:
                self.became_ready(c)
        for node in self.annotated.nodes:
            if node.kind is NodeKind.HEADER:
                self.builder.emit(node.index)
        self._issue_ready(prefetch_queue)
        for position, anchor in enumerate(self.anchors):
            self._fit_memory_of_next_op()
            self.builder.emit(anchor)
            self.position = position + 1
            for c in used_at.get(position, ()):
                self.allgathers.in_flight.discard(c)
            for c in self.chained.due(self.position, self.distance.expensive_before):
                logger.debug("wait on collective %d before compute op %d: a collective reads its result", c, self.position)
                self.builder.wait_on(c)
            self._issue_ready(prefetch_queue)

        # Whatever the return needs, and waits nobody reads, go last, in issue order.
        self.builder.wait_on_all()
        for node in self.annotated.nodes:
            self.builder.emit(node.index)
        assert len(self.builder.order) == len(self.annotated.nodes)
        return self.builder.order

    # ----------------------------------------------------------------------------------------
    # Issuing

    def _issue_ready(self, prefetch_queue: deque[int]) -> None:
        # All-gathers first: they are on the critical path, and a process group runs its
        # collectives in issue order, so a reduce-scatter issued first would delay them.
        while prefetch_queue:
            c = prefetch_queue[0]
            if c in self.builder.issued:  # a wait needed it before its turn
                prefetch_queue.popleft()
                continue
            if self.builder.missing_inputs[c] or self._hold_allgather(c):
                break
            logger.debug("prefetch all-gather %d before compute op %d (first use %d)", c, self.position, self.first_use[c])
            self.builder.issue(prefetch_queue.popleft())
        # Off the critical path, and freeing memory once waited on: issue whatever is ready.
        self._ready.requeue_set_aside()
        while (c := self._ready.pop()) is not None:
            if c in self.builder.issued:
                continue
            if self.issue_order is not None and self.issue_order.blocked(c):
                self._record_hold("issue_order", c)
                self._ready.set_aside(c)
                continue
            coll = self.annotated.collectives[c]
            self._force_waits(partial(self.reduce_scatters.all.wait_to_make_room, coll.unsharded_bytes), "reduce-scatter bytes")
            if coll.pool_bytes_to_wait:
                self._force_waits(partial(self.reduce_scatters.pool.wait_to_make_room, coll.pool_bytes_to_wait), "pool buffers")
            logger.debug("issue %s %d as soon as ready, before compute op %d", coll.kind.value, c, self.position)
            self.builder.issue(c)
            self._force_waits(self.reduce_scatters.all.wait_over_count, "reduce-scatter count")
            self._ready.requeue_set_aside()  # what c was blocking may go now

    def _hold_allgather(self, c: int) -> bool:
        """Whether a limit holds all-gather ``c`` back before compute op ``self.position``."""
        nbytes = self.annotated.collectives[c].unsharded_bytes
        first_use = self.first_use[c]
        if not self.distance.allows(c, self.position, first_use):
            return self._record_hold("distance", c)
        if not self.allgathers.allows(nbytes):
            return self._record_hold("in_flight", c)
        if not self.allgathers.allows_early(nbytes) and not self._must_issue_now(c, first_use):
            return self._record_hold("in_flight", c)
        if self.memory is not None and not self.memory.allows_prefetch(self.position, first_use, nbytes):
            return self._record_hold("memory", c)
        if self.issue_order is not None and self.issue_order.blocked(c):
            return self._record_hold("issue_order", c)
        return False

    def _must_issue_now(self, c: int, first_use: int) -> bool:
        """Whether all-gather ``c`` must go out now to be hidden: the compute before its first use
        covers it, and the collectives in flight ahead of it on the link, only if issued now."""
        queued = [*self.allgathers.in_flight.bytes_by_collective, *self.reduce_scatters.all.in_flight.bytes_by_collective]
        return self.distance.hides_only_if_issued_now(c, self.position, first_use, queued)

    def _record_hold(self, limit: Literal["distance", "in_flight", "memory", "issue_order"], c: int) -> bool:
        held = getattr(self.summary.held, limit)
        if c not in held:
            held.add(c)
            logger.debug("%s held back collective %d before compute op %d", limit, c, self.position)
        return True

    # ----------------------------------------------------------------------------------------
    # Forced waits

    def _fit_memory_of_next_op(self) -> None:
        """Forces the oldest reduce-scatter waits (each frees an unsharded gradient) until the
        next compute op's predicted memory is within the budget."""
        if self.memory is not None:
            in_flight = self.reduce_scatters.all.in_flight
            forced = self._force_waits(lambda: self.memory.wait_to_fit_op(self.position, in_flight), "memory")
            self.forced_waits_for_memory += forced

    def _force_waits(self, next_wait: Callable[[], int | None], reason: str) -> int:
        """Waits on ``next_wait()`` until it answers None; how many waits that took."""
        forced = 0
        while (c := next_wait()) is not None:
            logger.debug("forced wait on collective %d before compute op %d (%s)", c, self.position, reason)
            self.forced_waits += 1
            self.builder.wait_on(c)
            forced += 1
        return forced

    # ----------------------------------------------------------------------------------------
    # OrderEvents

    def issued(self, c: int) -> None:
        coll = self.annotated.collectives[c]
        if coll.kind is CollectiveKind.ALL_GATHER:
            self.allgathers.in_flight.add(c, coll.unsharded_bytes)
            if self.memory is not None:
                self.memory.commit_prefetch(self.position, self.first_use[c], coll.unsharded_bytes)
        else:
            self.reduce_scatters.add(c, coll)
        self.chained.issued(c, self.position)

    def retired(self, c: int) -> None:
        self.chained.retired(c)
        if self.first_use[c] == len(self.anchors):  # only the return reads it
            self.allgathers.in_flight.discard(c)
        self.reduce_scatters.discard(c)

    def became_ready(self, c: int) -> None:
        if self.annotated.collectives[c].kind is not CollectiveKind.ALL_GATHER:
            self._ready.push(c)


class _ReduceScatterLimits:
    """The reduce-scatters (and any collective but all-gathers) in flight: all of them, and those
    that hold a bucket pool buffer to their wait, where the trace gathers too ([Note: pool
    reduce-scatter cap])."""

    def __init__(self, annotated: AnnotatedTrace, limits: ScheduleLimits) -> None:
        self.all = ReduceScatterLimit(limits.max_reduce_scatters, limits.max_reduce_scatter_bytes)
        gathers = any(c.kind is CollectiveKind.ALL_GATHER for c in annotated.collectives)
        self.pool = ReduceScatterLimit(None, limits.max_pool_reduce_scatter_bytes if gathers else None)

    def add(self, c: int, coll) -> None:
        self.all.in_flight.add(c, coll.unsharded_bytes)
        if coll.pool_bytes_to_wait:
            self.pool.in_flight.add(c, coll.pool_bytes_to_wait)

    def discard(self, c: int) -> None:
        self.all.in_flight.discard(c)
        self.pool.in_flight.discard(c)


def _prefetch_queue(annotated: AnnotatedTrace, first_use: list[int]) -> tuple[deque[int], dict[int, list[int]]]:
    """The all-gathers in order of first use, and by compute position the all-gathers it reads
    first (they stop counting as in flight there)."""
    collectives = annotated.collectives
    allgathers = [c for c, coll in enumerate(collectives) if coll.kind is CollectiveKind.ALL_GATHER]
    used_at: dict[int, list[int]] = {}
    for c in allgathers:
        used_at.setdefault(first_use[c], []).append(c)
    return deque(sorted(allgathers, key=lambda c: (first_use[c], collectives[c].start))), used_at


class _ChainedWaits:
    """Collectives whose result another collective reads (a reduce-scatter read by hybrid
    sharding's all-reduce), waited on once they have had their compute, so that the reader can
    be issued then rather than at its first use by compute ([Note: chained waits])."""

    def __init__(self, annotated: AnnotatedTrace, after_compute_ops: int | None) -> None:
        self.after = after_compute_ops
        self.feeds_collective = _feeds_collective(annotated)
        self.in_flight: dict[int, int] = {}  # collective -> the compute position it was issued before

    def issued(self, c: int, position: int) -> None:
        if c in self.feeds_collective:
            self.in_flight[c] = position

    def retired(self, c: int) -> None:
        self.in_flight.pop(c, None)

    def due(self, position: int, expensive_before: list[int]) -> list[int]:
        """Those to wait on before compute op ``position``: once ``after`` expensive ops have run
        since their issue, or once none is left (what follows is the last compute to hide behind)."""
        if self.after is None:
            return []
        none_left = expensive_before[-1] == expensive_before[position]
        ran = expensive_before[position]
        return [c for c, issued_at in self.in_flight.items() if none_left or ran - expensive_before[issued_at] >= self.after]


def _feeds_collective(annotated: AnnotatedTrace) -> set[int]:
    """Collectives whose wait's outputs another collective (or its prologue) reads."""
    nodes, fed = annotated.nodes, set()
    for c, coll in enumerate(annotated.collectives):
        if coll.wait is None:
            continue
        for name in nodes[coll.wait].outputs:
            for reader in annotated.consumers.get(name, ()):
                if nodes[reader].kind in (NodeKind.COLLECTIVE, NodeKind.PROLOGUE) and nodes[reader].collective != c:
                    fed.add(c)
    return fed
