"""Scheduling: choose where each collective is issued and waited on around fixed-order compute.

Compute ops (``NodeKind.COMPUTE``) are emitted in the order Thunder produced them. Around them:
- all-gathers are issued in order of first use, as early as the in-flight limits allow, so each
  overlaps the compute before its first use (prefetch);
- reduce-scatters (and any other collective) are issued as soon as their input is complete,
  forcing the oldest one's wait first when the reduce-scatter byte limit would be exceeded;
- waits (and the parameter views that follow them) are emitted just before their first use;
- collectives of one process group complete in issue order, so waiting on one first waits on every
  earlier one of its group; this keeps every rank's wait order equal to its issue order.

The result depends only on the trace and the limits, never on hashing or timing, so every rank
computes the same order.
"""

from __future__ import annotations

from dataclasses import dataclass

from thunder.core.trace import TraceCtx, TraceProvenance, TraceTag, from_trace
from thunder.executors.passes import del_last_used

from thunder_overlap.classify import AnnotatedTrace, CollectiveKind, NodeKind
from thunder_overlap.config import ScheduleLimits

__all__ = ["Schedule", "OverlapScheduler", "stock_order", "apply_order"]


@dataclass(frozen=True)
class Schedule:
    """A scheduling decision: the node order and what the limits forced."""

    order: list[int]
    # Waits emitted before their first use because a limit was reached.
    forced_waits: int
    # Largest all-gather output bytes issued but not yet waited on, at any point.
    peak_allgather_bytes_in_flight: int


def stock_order(annotated: AnnotatedTrace) -> Schedule:
    """Thunder's own order (deletions left out): the baseline."""
    order = [n.index for n in annotated.nodes]
    return Schedule(order=order, forced_waits=0, peak_allgather_bytes_in_flight=0)


class OverlapScheduler:
    """List scheduler over one annotated execution trace.

    Phases: :meth:`find_first_uses` (which compute op needs each collective first), then
    :meth:`schedule` (walk compute in order, placing collectives and waits around it).
    """

    def __init__(self, annotated: AnnotatedTrace, limits: ScheduleLimits) -> None:
        self.annotated = annotated
        self.limits = limits
        self.nodes = annotated.nodes
        self.anchors = [n.index for n in self.nodes if n.kind is NodeKind.COMPUTE]
        self._order: list[int] = []
        self._emitted: set[int] = set()
        self._issued: list[int] = []  # collective indices in issue order
        self._waited: set[int] = set()
        self._forced_waits = 0
        self._peak_allgather_bytes = 0
        self._external_inputs = [self._group_inputs(c) for c in range(len(annotated.collectives))]

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
    # Phase 2: schedule

    def schedule(self) -> Schedule:
        collectives = self.annotated.collectives
        first_use = self.find_first_uses()
        prefetch_queue = sorted(
            (c for c, coll in enumerate(collectives) if coll.kind is CollectiveKind.ALL_GATHER),
            key=lambda c: (first_use[c], collectives[c].start),
        )
        eager_queue = [c for c, coll in enumerate(collectives) if coll.kind is not CollectiveKind.ALL_GATHER]

        for node in self.nodes:
            if node.kind is NodeKind.HEADER:
                self._emit(node.index)
        self._issue_ready(prefetch_queue, eager_queue)
        for anchor in self.anchors:
            self._emit(anchor)
            self._issue_ready(prefetch_queue, eager_queue)

        # Whatever the return needs, and waits nobody reads, go last, in issue order.
        for c in list(self._issued):
            if collectives[c].wait is not None:
                self._emit(collectives[c].wait)
        for node in self.nodes:
            self._emit(node.index)
        assert len(self._order) == len(self.nodes)
        return Schedule(
            order=self._order,
            forced_waits=self._forced_waits,
            peak_allgather_bytes_in_flight=self._peak_allgather_bytes,
        )

    def _issue_ready(self, prefetch_queue: list[int], eager_queue: list[int]) -> None:
        # All-gathers first: they are on the critical path, and a process group runs its
        # collectives in issue order, so a reduce-scatter issued first would delay them.
        while prefetch_queue and self._is_ready(prefetch_queue[0]) and self._allgather_fits(prefetch_queue[0]):
            self._issue(prefetch_queue.pop(0))
        for c in [c for c in eager_queue if self._is_ready(c)]:
            eager_queue.remove(c)
            self._make_room_for_reduce_scatter(c)
            self._issue(c)

    # ----------------------------------------------------------------------------------------
    # Limits

    def _in_flight(self, kind_is_allgather: bool) -> list[int]:
        colls = self.annotated.collectives
        return [
            c
            for c in self._issued
            if c not in self._waited and (colls[c].kind is CollectiveKind.ALL_GATHER) == kind_is_allgather
        ]

    def _allgather_fits(self, c: int) -> bool:
        in_flight = self._in_flight(kind_is_allgather=True)
        if not in_flight:
            return True  # always allow one, or nothing would ever be prefetched
        if self.limits.max_allgathers is not None and len(in_flight) + 1 > self.limits.max_allgathers:
            return False
        if self.limits.max_allgather_bytes is not None:
            colls = self.annotated.collectives
            in_flight_bytes = sum(colls[i].unsharded_bytes for i in in_flight)
            if in_flight_bytes + colls[c].unsharded_bytes > self.limits.max_allgather_bytes:
                return False
        return True

    def _make_room_for_reduce_scatter(self, c: int) -> None:
        limit = self.limits.max_reduce_scatter_bytes
        if limit is None:
            return
        colls = self.annotated.collectives
        while True:
            in_flight = self._in_flight(kind_is_allgather=False)
            if not in_flight or sum(colls[i].unsharded_bytes for i in in_flight) + colls[c].unsharded_bytes <= limit:
                return
            oldest = in_flight[0]
            if colls[oldest].wait is None:
                return
            self._forced_waits += 1
            self._emit(colls[oldest].wait)

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

    def _is_ready(self, c: int) -> bool:
        return all(p in self._emitted for p in self._external_inputs[c])

    def _issue(self, c: int) -> None:
        coll = self.annotated.collectives[c]
        for p in coll.prologue:
            self._emit(p)
        self._emit(coll.start)

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
        if node.kind is NodeKind.COLLECTIVE:
            self._issued.append(node.collective)
            self._record_in_flight()
        elif node.kind is NodeKind.WAIT:
            self._waited.add(node.collective)

    def _before_wait(self, c: int) -> None:
        colls = self.annotated.collectives
        if c not in self._issued:
            self._issue(c)
        for earlier in self._issued[: self._issued.index(c)]:
            if earlier not in self._waited and colls[earlier].group_key == colls[c].group_key:
                if colls[earlier].wait is not None:
                    self._emit(colls[earlier].wait)

    def _record_in_flight(self) -> None:
        colls = self.annotated.collectives
        in_flight = sum(colls[c].unsharded_bytes for c in self._in_flight(kind_is_allgather=True))
        self._peak_allgather_bytes = max(self._peak_allgather_bytes, in_flight)


def apply_order(annotated: AnnotatedTrace, schedule: Schedule, *, provenance: str) -> TraceCtx:
    """Builds the execution trace in the scheduled order, with deletions regenerated."""
    trace = annotated.trace
    is_backward = TraceTag.BACKWARD in trace.tags
    new_trace = from_trace(trace)
    new_trace.bound_symbols = [annotated.nodes[i].bsym for i in schedule.order]
    new_trace = del_last_used(new_trace, clear_mutable_collections=is_backward)
    new_trace.set_provenance(TraceProvenance(provenance))
    return new_trace
