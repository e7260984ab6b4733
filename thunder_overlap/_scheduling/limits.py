"""The limits the scheduler places collectives within: :class:`ScheduleLimits` as resolved from
the configuration (:func:`resolve_limits`), then one small object per limit.

Each object answers one question during a walk over the compute ops:

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

import sys
from collections.abc import Iterable
from dataclasses import dataclass, replace
from itertools import accumulate

from thunder_overlap._analysis.classify import AnnotatedTrace, is_expensive
from thunder_overlap._analysis.cost_model import CostModel
from thunder_overlap._scheduling.memory_budget import MemoryProfile
from thunder_overlap.config import OverlapConfig

__all__ = [
    "JUST_IN_TIME_LIMITS",
    "AllGatherLimit",
    "InFlight",
    "MemoryBudget",
    "MemoryBudgetRule",
    "PrefetchDistance",
    "ReduceScatterLimit",
    "ScheduleLimits",
    "resolve_limits",
]


@dataclass(frozen=True)
class MemoryBudgetRule:
    """Predicted peak may exceed the just-in-time order's by max(slack_bytes, slack_ratio x peak),
    and not ``absolute_bytes`` (the user's per-rank budget) where the just-in-time order is under it."""

    slack_bytes: int
    slack_ratio: float
    absolute_bytes: int | None = None

    def budget(self, baseline_peak_bytes: int) -> int:
        relative = baseline_peak_bytes + max(self.slack_bytes, int(self.slack_ratio * baseline_peak_bytes))
        if self.absolute_bytes is None:
            return relative
        # Over the absolute budget even without prefetching: no prefetch at all is the best there
        # is (sharding "auto" refuses such a budget before scheduling).
        return min(relative, max(self.absolute_bytes, baseline_peak_bytes))


@dataclass(frozen=True)
class ScheduleLimits:
    """Concrete limits the scheduler enforces (None: unlimited)."""

    max_allgathers: int | None = None
    max_allgather_bytes: int | None = None
    # All-gather bytes in flight up to which one more goes out as early as the distance allows;
    # beyond them (within max_allgather_bytes) only once issuing later would leave too little
    # compute to hide it (PrefetchDistance.hides_only_if_issued_now). None: as early as allowed.
    early_allgather_bytes: int | None = None
    max_reduce_scatter_bytes: int | None = None
    # Of those, the bytes that keep a bucket pool buffer busy until the wait (Collective.pool_bytes_to_wait).
    max_pool_reduce_scatter_bytes: int | None = None
    # Most reduce-scatters in flight (0: wait right after issuing).
    max_reduce_scatters: int | None = None
    # Expensive compute ops between a collective's issue and its first use (0: just in time).
    max_prefetch_compute_ops: int | None = None
    # Stretch the distance until compute covers this many times the collective's time.
    prefetch_time_margin: float | None = None
    memory_budget: MemoryBudgetRule | None = None
    # Expensive compute ops after which a reduce-scatter that feeds another collective is
    # waited on (None: at its first use, as any other).
    chained_wait_compute_ops: int | None = None


# Each all-gather right before its first use, each reduce-scatter waited right after its issue.
JUST_IN_TIME_LIMITS = ScheduleLimits(max_prefetch_compute_ops=0, max_reduce_scatters=0)


def _units(count: float, unit_bytes: int) -> int:
    """``count`` units in bytes; a count too large to be a byte count is no limit in effect."""
    return int(min(count * unit_bytes, sys.maxsize))


def resolve_limits(
    config: OverlapConfig, largest_block_bytes: int | None, *, runs_buckets: bool = False, caps_pool_reduce_scatters: bool = True
) -> ScheduleLimits:
    """The limits ``config.policy`` applies, given the unit of prefetching (the largest block or
    bucket; None for a model without repeated blocks) and whether the collectives move buckets.
    ``caps_pool_reduce_scatters=False`` lifts the cap on reduce-scatters that hold a pool buffer
    to their wait (the schedule the bucket path choice reads: [Note: pool reduce-scatter cap])."""
    if not config.policy.limits_in_flight:
        return ScheduleLimits()
    if not config.policy.prefetches:
        return JUST_IN_TIME_LIMITS
    tuning = config.tuning
    unit = largest_block_bytes or None
    block_limit = _units(config.prefetch_blocks, unit) if unit else None
    eager_limit = pool_limit = None
    if runs_buckets and unit and tuning.bucket_eager_prefetch_blocks is not None:
        eager_limit = min(block_limit, _units(tuning.bucket_eager_prefetch_blocks, unit))
    if runs_buckets and unit and caps_pool_reduce_scatters and tuning.bucket_reduce_scatter_blocks is not None:
        pool_limit = _units(tuning.bucket_reduce_scatter_blocks, unit)
    allgather_bytes, allgathers, early_bytes = config.max_in_flight_allgather_bytes, tuning.max_in_flight_allgathers, None
    if allgather_bytes is None and allgathers is None:
        allgather_bytes, early_bytes = block_limit, eager_limit
        allgathers = tuning.fallback_in_flight_allgathers if block_limit is None else None
    limits = ScheduleLimits(
        max_allgathers=allgathers,
        max_allgather_bytes=allgather_bytes,
        early_allgather_bytes=early_bytes,
        max_reduce_scatter_bytes=tuning.max_in_flight_reduce_scatter_bytes or block_limit,
        max_pool_reduce_scatter_bytes=pool_limit,
        chained_wait_compute_ops=tuning.chained_wait_compute_ops,
    )
    if not config.policy.reads_memory:
        return limits
    return replace(
        limits,
        max_prefetch_compute_ops=tuning.max_prefetch_compute_ops,
        prefetch_time_margin=tuning.prefetch_time_margin,
        memory_budget=MemoryBudgetRule(config.memory_slack_bytes, float(config.memory_slack_ratio), config.memory_budget_bytes),
    )


class InFlight:
    """Collectives counted against an in-flight limit, oldest first, with their byte total."""

    def __init__(self) -> None:
        self.bytes_by_collective: dict[int, int] = {}  # insertion-ordered: oldest first
        self.total_bytes = 0
        self.peak_bytes = 0  # the most ever in flight at once

    def add(self, c: int, nbytes: int) -> None:
        self.bytes_by_collective[c] = nbytes
        self.total_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.total_bytes)

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
