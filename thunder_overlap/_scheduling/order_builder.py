"""The order under construction during one scheduling walk.

:class:`OrderBuilder` appends nodes after everything they read, issues a collective with its
prologue (after its predecessors when an :class:`~thunder_overlap._scheduling.issue_order.IssueOrder`
is kept), and waits on the collectives of one process group in issue order: they complete in
that order anyway, and waiting in issue order keeps every rank's waits in step. It decides
nothing; it tells the walk what happened through :class:`OrderEvents`.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Protocol

from thunder_overlap._analysis.classify import AnnotatedTrace, NodeKind
from thunder_overlap._scheduling.issue_order import IssueOrderCursor

__all__ = ["OrderBuilder", "OrderEvents"]

logger = logging.getLogger(__name__)


class OrderEvents(Protocol):
    def issued(self, c: int) -> None: ...

    def retired(self, c: int) -> None:
        """Collective ``c`` was waited on (or, with no wait, left its group's books)."""

    def became_ready(self, c: int) -> None:
        """Every input of collective ``c`` outside its prologue is now in the order."""


class OrderBuilder:
    """Node indices in execution order, with the bookkeeping that keeps it valid."""

    def __init__(self, annotated: AnnotatedTrace, events: OrderEvents, issue_order: IssueOrderCursor | None) -> None:
        self.annotated = annotated
        self.nodes = annotated.nodes
        self.order: list[int] = []
        self.emitted: set[int] = set()
        self.issued: set[int] = set()
        # Per process group, issued collectives not yet waited on, in issue order.
        self.unwaited_by_group: dict[int, deque[int]] = {}
        self.issue_order = issue_order
        self._events = events
        # Readiness: how many producers outside its prologue each collective still waits for.
        self.missing_inputs = [0] * len(annotated.collectives)
        self._collectives_reading: dict[int, list[int]] = {}
        for c in range(len(annotated.collectives)):
            for p in self._outside_inputs(c):
                self.missing_inputs[c] += 1
                self._collectives_reading.setdefault(p, []).append(c)

    def issue(self, c: int) -> None:
        coll = self.annotated.collectives[c]
        for p in coll.prologue:
            self.emit(p)
        self.emit(coll.start)

    def wait_on(self, c: int) -> None:
        wait = self.annotated.collectives[c].wait
        if wait is not None:
            self.emit(wait)
        else:  # a collective nobody waits on leaves the books in its group's order
            self._before_wait(c)
            self._retire(c)

    def wait_on_all(self) -> None:
        """Waits on every issued collective, group by group, in issue order."""
        for unwaited in self.unwaited_by_group.values():
            while unwaited:
                self.wait_on(unwaited[0])

    def emit(self, index: int) -> None:
        if index in self.emitted:
            return
        node = self.nodes[index]
        if node.kind is NodeKind.WAIT:
            self._before_wait(node.collective)
        elif node.kind is NodeKind.COLLECTIVE and self.issue_order is not None:
            self._issue_predecessors(node.collective)
        for name in node.inputs:
            p = self.annotated.producer.get(name)
            if p is not None and p != index and p not in self.emitted:
                if self.nodes[p].kind is NodeKind.COMPUTE:
                    raise AssertionError(f"scheduler would reorder compute: {self.nodes[p].name} for {node.name}")
                self.emit(p)
        if index in self.emitted:  # emitted while resolving a dependency cycle through a group
            return
        self.emitted.add(index)
        self.order.append(index)
        for c in self._collectives_reading.get(index, ()):
            self.missing_inputs[c] -= 1
            if self.missing_inputs[c] == 0:
                self._events.became_ready(c)
        if node.kind is NodeKind.COLLECTIVE:
            self._record_issue(node.collective)
        elif node.kind is NodeKind.WAIT:
            self._retire(node.collective)

    def _outside_inputs(self, c: int) -> set[int]:
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

    def _record_issue(self, c: int) -> None:
        self.issued.add(c)
        self.unwaited_by_group.setdefault(self.annotated.collectives[c].group_key, deque()).append(c)
        if self.issue_order is not None:
            self.issue_order.record_issue(c)
        self._events.issued(c)

    def _retire(self, c: int) -> None:
        unwaited = self.unwaited_by_group[self.annotated.collectives[c].group_key]
        assert unwaited[0] == c, "waits must follow issue order within a process group"
        unwaited.popleft()
        self._events.retired(c)

    def _before_wait(self, c: int) -> None:
        """Issues ``c`` if needed, then waits on every collective issued before it on its group."""
        if c not in self.issued:
            self.issue(c)
        unwaited = self.unwaited_by_group[self.annotated.collectives[c].group_key]
        while unwaited and unwaited[0] != c:
            self.wait_on(unwaited[0])

    def _issue_predecessors(self, c: int) -> None:
        """Issues what precedes ``c`` in the issue order; each must be ready, or the order cannot be kept."""
        for p in self.issue_order.unissued_predecessors(c):
            if p in self.issued:  # issued already while resolving an earlier one's inputs
                continue
            unrun = self._unrun_compute_needed_by(p)
            if unrun is not None:
                raise ValueError(
                    f"issue order {list(self.issue_order.sequence_of(c))} cannot be kept: collective {c} "
                    f"({self._describe(c)}) needs collective {p} ({self._describe(p)}) issued first, which reads the "
                    f"output of {self.nodes[unrun].name} (trace position {unrun}), which has not run"
                )
            logger.debug("issue collective %d before collective %d, which follows it in the issue order", p, c)
            self.issue(p)

    def _describe(self, c: int) -> str:
        start = self.nodes[self.annotated.collectives[c].start]
        return f"{start.name} at trace position {start.index}"

    def _unrun_compute_needed_by(self, c: int) -> int | None:
        """A compute op not yet in the order that collective ``c`` reads, directly or through
        other not yet emitted non-compute nodes; None if there is none."""
        coll = self.annotated.collectives[c]
        stack, seen = [coll.start, *coll.prologue], set()
        while stack:
            for name in self.nodes[stack.pop()].inputs:
                p = self.annotated.producer.get(name)
                if p is None or p in self.emitted or p in seen:
                    continue
                if self.nodes[p].kind is NodeKind.COMPUTE:
                    return p
                seen.add(p)
                stack.append(p)
        return None
