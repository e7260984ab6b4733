"""A fixed issue order of the collectives of each process group, for the scheduler to keep.

Ranks pair collectives by issue order, so an order agreed between ranks must survive
rescheduling: with an :class:`IssueOrder` the scheduler may still move a collective relative to
compute (the limits decide), but never ahead of one that precedes it on its process group.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from thunder_overlap._analysis.classify import AnnotatedTrace, NodeKind

__all__ = ["IssueOrder", "IssueOrderCursor", "issue_order_of", "issue_sequence"]


def issue_order_of(annotated: AnnotatedTrace, order: list[int]) -> list[int]:
    """The collectives (indices into ``annotated.collectives``) in the order ``order`` issues
    them, across process groups."""
    return [annotated.nodes[i].collective for i in order if annotated.nodes[i].kind is NodeKind.COLLECTIVE]


def issue_sequence(annotated: AnnotatedTrace, order: list[int]) -> dict[int, list[int]]:
    """Per process group (``Collective.group_key``), the collectives (indices into
    ``annotated.collectives``) in the order ``order`` issues them."""
    sequences: dict[int, list[int]] = {}
    for index in order:
        node = annotated.nodes[index]
        if node.kind is NodeKind.COLLECTIVE:
            sequences.setdefault(annotated.collectives[node.collective].group_key, []).append(node.collective)
    return sequences


@dataclass(frozen=True)
class IssueOrder:
    """Per process group (``Collective.group_key``), the exact order in which its collectives
    (indices into ``annotated.collectives``) must be issued. Every group must be listed whole."""

    sequences: Mapping[int, Sequence[int]]

    def __post_init__(self) -> None:
        # Tuples, so that two orders compare equal whatever sequence type they were given in.
        object.__setattr__(self, "sequences", {key: tuple(s) for key, s in self.sequences.items()})

    @classmethod
    def of_schedule(cls, annotated: AnnotatedTrace, order: list[int]) -> IssueOrder:
        """The issue order that ``order`` follows."""
        return cls(issue_sequence(annotated, order))

    @classmethod
    def of_sequence(cls, annotated: AnnotatedTrace, collectives: list[int]) -> IssueOrder:
        """The issue order of ``collectives`` (indices, across groups), split by process group."""
        sequences: dict[int, list[int]] = {}
        for c in collectives:
            sequences.setdefault(annotated.collectives[c].group_key, []).append(c)
        return cls(sequences)

    def check(self, annotated: AnnotatedTrace) -> None:
        """Raises ValueError unless each group's sequence lists exactly that group's collectives once."""
        expected = issue_sequence(annotated, [c.start for c in annotated.collectives])
        unknown = sorted(self.sequences.keys() - expected.keys())
        if unknown:
            raise ValueError(
                f"issue order names process groups {unknown}, which have no collective in this trace (groups: {sorted(expected)})"
            )
        for key, collectives in expected.items():
            given = self.sequences.get(key)
            if given is None or sorted(given) != collectives:
                raise ValueError(f"issue order for process group {key} must list each of its collectives {collectives} once, got {given}")


class IssueOrderCursor:
    """How far each group's sequence has been issued during one walk."""

    def __init__(self, issue_order: IssueOrder, annotated: AnnotatedTrace) -> None:
        self.issue_order = issue_order
        self._group_of = [c.group_key for c in annotated.collectives]
        self._rank = {c: rank for sequence in issue_order.sequences.values() for rank, c in enumerate(sequence)}
        self._issued_count = dict.fromkeys(issue_order.sequences, 0)

    def sequence_of(self, c: int) -> Sequence[int]:
        return self.issue_order.sequences[self._group_of[c]]

    def blocked(self, c: int) -> bool:
        """Whether some collective before ``c`` in its group's sequence is not issued yet."""
        return self._rank[c] > self._issued_count[self._group_of[c]]

    def unissued_predecessors(self, c: int) -> Sequence[int]:
        """The collectives to issue, in this order, before ``c``."""
        return self.sequence_of(c)[self._issued_count[self._group_of[c]] : self._rank[c]]

    def record_issue(self, c: int) -> None:
        group = self._group_of[c]
        assert self._rank[c] == self._issued_count[group], f"collective {c} issued out of the issue order"
        self._issued_count[group] += 1
