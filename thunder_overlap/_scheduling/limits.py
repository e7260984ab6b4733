"""The limits the scheduler places collectives within, each one small object.

Each answers one question during a walk over the compute ops:

- :class:`PrefetchDistance`: may all-gather ``c`` be issued this far ahead of its first use?
- :class:`AllGatherLimit`: may one more all-gather be in flight (count and bytes), and may it go
  out early or only when later would be too late to hide it?
- :class:`ReduceScatterLimit`: which reduce-scatter wait must be forced before issuing another?
- :class:`MemoryBudget`: does a prefetch fit the predicted memory, and which reduce-scatter wait
  must be forced before the next compute op fits?

A limit whose setting is ``None`` allows everything. Forcing answers name one collective (the
oldest in flight) or ``None``; the scheduler asks again after each wait, since a wait frees bytes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from itertools import accumulate

from thunder_overlap._analysis.classify import AnnotatedTrace, is_expensive
from thunder_overlap._analysis.cost_model import CostModel
from thunder_overlap._scheduling.memory_budget import MemoryProfile
from thunder_overlap.config import ScheduleLimits

__all__ = ["AllGatherLimit", "InFlight", "MemoryBudget", "PrefetchDistance", "ReduceScatterLimit"]


class InFlight:
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


@dataclass(frozen=True)
class PrefetchDistance:
    """An all-gather is issued at most ``max_expensive_ops`` expensive compute ops before its first
    use, unless the compute in between, by the cost model, is too short to hide it: then it goes
    out at the latest point where that compute still covers ``time_margin`` x its time."""

    max_expensive_ops: int | None
    time_margin: float | None
    # Per compute position: expensive ops, and estimated milliseconds, before it.
    expensive_before: list[int]
    ms_before: list[float] | None
    # Estimated milliseconds of each collective (None: the distance is never stretched).
    collective_ms: list[float] | None

    @classmethod
    def estimate(
        cls, annotated: AnnotatedTrace, anchors: list[int], limits: ScheduleLimits, cost_model: CostModel | None
    ) -> PrefetchDistance:
        """The distance of ``limits`` over compute ops ``anchors``; costs are estimated only when
        the limits stretch prefetching by time and a cost model is given."""
        nodes = annotated.nodes
        expensive_before = [0, *accumulate(int(is_expensive(nodes[a].bsym)) for a in anchors)]
        ms_before = collective_ms = None
        if cost_model is not None and limits.prefetch_time_margin is not None:
            ms_before = [0.0, *accumulate(cost_model.compute_ms(nodes[a].bsym) for a in anchors)]
            collective_ms = [cost_model.collective_ms(c) for c in annotated.collectives]
        return cls(limits.max_prefetch_compute_ops, limits.prefetch_time_margin, expensive_before, ms_before, collective_ms)

    def allows(self, c: int, position: int, first_use: int) -> bool:
        """Whether collective ``c``, first read by compute op ``first_use``, may be issued before
        compute op ``position``."""
        if self.max_expensive_ops is None:
            return True
        if self.expensive_before[first_use] - self.expensive_before[position] <= self.max_expensive_ops:
            return True
        # Too far by count: only at the latest moment that still hides it.
        return self.hides_only_if_issued_now(c, position, first_use)

    def hides_only_if_issued_now(self, c: int, position: int, first_use: int, queued: Iterable[int] = ()) -> bool:
        """Whether issued one compute op after ``position``, the compute before its first use
        would no longer cover ``time_margin`` x collective ``c``'s time, so that now is the
        latest moment that does. Collectives ``queued`` ahead of it (in flight on its link) add
        their time: ``c`` moves once they have. False without time estimates."""
        if self.ms_before is None or self.collective_ms is None:
            return False
        compute_ms_if_later = self.ms_before[first_use] - self.ms_before[min(position + 1, first_use)]
        link_ms = self.collective_ms[c] + sum(self.collective_ms[q] for q in queued)
        return compute_ms_if_later < self.time_margin * link_ms


class AllGatherLimit:
    """All-gathers in flight: issued, and their first reader not run yet (a gathered parameter
    occupies memory until then, not merely until its wait). Beyond ``early_bytes`` in flight one
    more goes out only when it must (see :attr:`ScheduleLimits.early_allgather_bytes`)."""

    def __init__(self, max_count: int | None, max_bytes: int | None, early_bytes: int | None = None) -> None:
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.early_bytes = early_bytes
        self.in_flight = InFlight()

    def allows_early(self, nbytes: int) -> bool:
        """Whether one more all-gather of ``nbytes`` may go out as early as the distance allows."""
        if not self.in_flight or self.early_bytes is None:
            return True
        return self.in_flight.total_bytes + nbytes <= self.early_bytes

    def allows(self, nbytes: int) -> bool:
        """Whether one more all-gather of ``nbytes`` may be in flight."""
        if not self.in_flight:  # always allow one, or nothing would ever be prefetched
            return True
        too_many = self.max_count is not None and len(self.in_flight) + 1 > self.max_count
        too_big = self.max_bytes is not None and self.in_flight.total_bytes + nbytes > self.max_bytes
        return not (too_many or too_big)


class ReduceScatterLimit:
    """Reduce-scatters (and any other collective but all-gathers) in flight: issued, not waited
    on. Waiting on one frees its unsharded input, so going over forces the oldest wait."""

    def __init__(self, max_count: int | None, max_bytes: int | None) -> None:
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.in_flight = InFlight()

    def wait_to_make_room(self, nbytes: int) -> int | None:
        """The collective to wait on before ``nbytes`` more may be in flight, if any."""
        if self.max_bytes is None or self.in_flight.total_bytes + nbytes <= self.max_bytes:
            return None
        return self.in_flight.oldest()

    def wait_over_count(self) -> int | None:
        """The collective to wait on while more are in flight than the count limit, if any."""
        if self.max_count is None or len(self.in_flight) <= self.max_count:
            return None
        return self.in_flight.oldest()


class MemoryBudget:
    """The predicted memory of the schedule so far (a :class:`MemoryProfile`) against its budget."""

    def __init__(self, profile: MemoryProfile) -> None:
        self.profile = profile

    def allows_prefetch(self, position: int, first_use: int, nbytes: int) -> bool:
        """Whether ``nbytes`` gathered before compute op ``position`` and held until its first
        use still fit every compute op in between."""
        return self.profile.fits(position, first_use - 1, nbytes)

    def commit_prefetch(self, position: int, first_use: int, nbytes: int) -> None:
        self.profile.commit(position, first_use - 1, nbytes)

    def wait_to_fit_op(self, position: int, reduce_scatters: InFlight) -> int | None:
        """The reduce-scatter to wait on (freeing its unsharded gradient) while compute op
        ``position`` would not fit with every reduce-scatter in flight held, if any."""
        if not reduce_scatters or self.profile.fits(position, position, reduce_scatters.total_bytes):
            return None
        return reduce_scatters.oldest()
