"""The scheduler's view of memory: predicted live bytes at each compute op, against a budget.

Compute ops keep their order, so memory can be tracked per *segment*: segment ``k`` is compute
op ``k`` (its anchor) with the collectives, waits and deletions placed just before it. The
just-in-time order (each all-gather issued right before its first use, each reduce-scatter waited
right after its issue) is estimated once with :func:`~thunder_overlap._analysis.memory_estimate.estimate_memory`;
its largest live bytes per segment is the *baseline profile*. Every decision of the scheduler
then adds to it:

- an all-gather issued ``d`` segments before its first use holds its output over those ``d``
  segments (:meth:`MemoryProfile.commit`);
- a reduce-scatter in flight holds its unsharded input until it is waited on (the scheduler
  adds the bytes in flight when it checks a segment).

Range updates and range maxima use a lazy segment tree, so each decision costs O(log segments).
The profile is a model: the scheduler checks its final order with the estimator itself.
"""

from __future__ import annotations

from thunder.core.trace import TraceCtx

from thunder_overlap._analysis.classify import AnnotatedTrace, NodeKind
from thunder_overlap._analysis.memory_estimate import MemoryEstimate

__all__ = ["MemoryProfile", "baseline_profile"]


def baseline_profile(annotated: AnnotatedTrace, trace: TraceCtx, estimate: MemoryEstimate) -> list[int]:
    """Largest live bytes of each segment of ``trace`` (``annotated``'s nodes in some order,
    deletions included), one entry per compute op plus one for what follows the last."""
    anchors = {id(n.bsym) for n in annotated.nodes if n.kind is NodeKind.COMPUTE}
    profile = [0]
    for bsym, peak in zip(trace.bound_symbols, estimate.peak_during, strict=True):
        profile[-1] = max(profile[-1], peak)
        if id(bsym) in anchors:
            profile.append(0)
    profile[-1] = max(profile[-1], estimate.live_after[-1] if estimate.live_after else 0)
    return profile


class MemoryProfile:
    """Baseline bytes per segment plus what the schedule has committed, with range queries."""

    def __init__(self, baseline: list[int], budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.size = len(baseline)
        width = 1
        while width < self.size:
            width *= 2
        self._width = width
        self._max = [0] * (2 * width)
        self._pending = [0] * (2 * width)
        for i, value in enumerate(baseline):
            self._max[width + i] = value
        for i in range(width - 1, 0, -1):
            self._max[i] = max(self._max[2 * i], self._max[2 * i + 1])

    def peak(self, first: int, last: int) -> int:
        """Largest predicted bytes over segments ``first..last`` (inclusive)."""
        if first > last:
            return 0
        return self._query(1, 0, self._width - 1, first, last)

    def fits(self, first: int, last: int, extra_bytes: int) -> bool:
        """Whether holding ``extra_bytes`` more over ``first..last`` stays within the budget.
        An empty range always fits: nothing is held early."""
        if first > last:
            return True
        return self.peak(first, last) + extra_bytes <= self.budget_bytes

    def commit(self, first: int, last: int, extra_bytes: int) -> None:
        if first <= last:
            self._add(1, 0, self._width - 1, first, last, extra_bytes)

    def _add(self, node: int, lo: int, hi: int, first: int, last: int, value: int) -> None:
        if last < lo or hi < first:
            return
        if first <= lo and hi <= last:
            self._max[node] += value
            self._pending[node] += value
            return
        mid = (lo + hi) // 2
        self._add(2 * node, lo, mid, first, last, value)
        self._add(2 * node + 1, mid + 1, hi, first, last, value)
        self._max[node] = max(self._max[2 * node], self._max[2 * node + 1]) + self._pending[node]

    def _query(self, node: int, lo: int, hi: int, first: int, last: int) -> int:
        if last < lo or hi < first:
            return -(1 << 62)
        if first <= lo and hi <= last:
            return self._max[node]
        mid = (lo + hi) // 2
        inner = max(self._query(2 * node, lo, mid, first, last), self._query(2 * node + 1, mid + 1, hi, first, last))
        return inner + self._pending[node]
