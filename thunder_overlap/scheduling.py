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

import heapq
from collections import deque

from thunder.core.trace import TraceCtx, TraceProvenance, TraceTag, from_trace
from thunder.executors.passes import del_last_used

from thunder_overlap.classify import AnnotatedTrace, CollectiveKind, NodeKind
from thunder_overlap.config import ScheduleLimits

__all__ = ["OverlapScheduler", "stock_order", "apply_order"]


def stock_order(annotated: AnnotatedTrace) -> list[int]:
    """Thunder's own order (deletions left out): the baseline."""
    return [n.index for n in annotated.nodes]


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

    Phases: :meth:`find_first_uses` (which compute op needs each collective first), then
    :meth:`schedule` (walk compute in order, placing collectives and waits around it). Every
    step is incremental, so scheduling time grows linearly with the trace.
    """

    def __init__(self, annotated: AnnotatedTrace, limits: ScheduleLimits) -> None:
        self.annotated = annotated
        self.limits = limits
        self.nodes = annotated.nodes
        self.anchors = [n.index for n in self.nodes if n.kind is NodeKind.COMPUTE]
        self._order: list[int] = []
        self._emitted: set[int] = set()
        self._issued: set[int] = set()
        # Per process group, issued collectives not yet waited on, in issue order.
        self._unwaited_by_group: dict[int, deque[int]] = {}
        self._allgathers_in_flight = _InFlight()
        self._others_in_flight = _InFlight()
        # Readiness: how many producers outside its prologue each collective still waits for.
        self._missing_inputs = [0] * len(annotated.collectives)
        self._collectives_reading: dict[int, list[int]] = {}
        for c in range(len(annotated.collectives)):
            for p in self._group_inputs(c):
                self._missing_inputs[c] += 1
                self._collectives_reading.setdefault(p, []).append(c)
        self._ready_eager: list[int] = []  # heap of ready non-all-gather collectives by start
        self._first_use: list[int] = []

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

    def schedule(self) -> list[int]:
        """Node indices of the annotated trace in execution order."""
        collectives = self.annotated.collectives
        first_use = self._first_use = self.find_first_uses()
        # A gathered parameter occupies memory from its issue until its first reader runs, so it
        # counts against the prefetch limit until then (not merely until its wait, which a
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
            self._emit(anchor)
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
        while self._ready_eager:
            _, c = heapq.heappop(self._ready_eager)
            if c in self._issued:
                continue
            self._make_room_for(c)
            self._issue(c)

    # ----------------------------------------------------------------------------------------
    # Limits

    def _allgather_fits(self, c: int) -> bool:
        in_flight = self._allgathers_in_flight
        if not in_flight:
            return True  # always allow one, or nothing would ever be prefetched
        if self.limits.max_allgathers is not None and len(in_flight) + 1 > self.limits.max_allgathers:
            return False
        limit = self.limits.max_allgather_bytes
        return limit is None or in_flight.total_bytes + self.annotated.collectives[c].unsharded_bytes <= limit

    def _make_room_for(self, c: int) -> None:
        """Forces the oldest reduce-scatter waits until ``c`` fits the byte limit."""
        limit = self.limits.max_reduce_scatter_bytes
        if limit is None:
            return
        nbytes = self.annotated.collectives[c].unsharded_bytes
        while self._others_in_flight and self._others_in_flight.total_bytes + nbytes > limit:
            self._emit_wait_of(self._others_in_flight.oldest())

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
