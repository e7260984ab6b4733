"""The bucket pool's slot plan: which unsharded buffers a schedule needs, from its live intervals.

A bucketed collective runs on flat buffers from one pool (``_bucketing/buffers.py``), each busy
for an interval of the step's timeline that its path sets (:mod:`~thunder_overlap._analysis.layout`):
an all-gather's output until the last view of it dies, a copy-out from the wait until the last
parameter view dies, a lay-out until the reduce-scatter's wait (for the launch only where it goes
from the backend's copy, to the step's end where it reduces in the pool). The pool hands a buffer
out again once it is idle, to any use of the same size and dtype, and never frees one; so it
holds, per (numel, dtype), as many buffers as the schedule has intervals of that size alive at once.

:func:`plan_slots` colours the intervals the way the pool reuses (in order of start, the first
idle buffer of the same size): on intervals this is optimal, so the plan has exactly the maximum
overlap of each size class. The memory estimator records the intervals and counts the planned
slots as persistent, as the runtime holds them. The rest serves the bucket path choice
(``_bucketing/path_choice.py``): :func:`plan_shards_in_pool` picks the reduce-scatters that can
reduce in a buffer the plan leaves idle to the step's end, and :func:`fewest_for_smallest_pool`
the fewest buckets whose change of path makes the pool smallest.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from thunder_overlap._analysis.layout import BucketLayout

__all__ = [
    "PoolInterval",
    "PoolSlot",
    "ReduceScatterIssue",
    "SlotPlan",
    "describe_slots",
    "fewest_for_smallest_pool",
    "fewest_per_tensor_gathers",
    "fewest_reduce_scatters_from_copy",
    "intervals_gathered_in_place",
    "intervals_reduced_from_copy",
    "max_overlap",
    "plan_shards_in_pool",
    "plan_slots",
]


@dataclass(frozen=True)
class PoolInterval:
    """One use of a pool buffer, on a step's timeline of bound symbols (the forward's, then the
    backward's): busy from ``start`` up to, not including, ``end``."""

    user: str  # "<bucket> all-gather", "<bucket> copy-out" or "<bucket> reduce-scatter"
    numel: int
    dtype: str
    itemsize: int
    start: int
    end: int

    def __post_init__(self) -> None:
        if self.end < self.start:
            raise ValueError(f"pool interval {self.user!r} ends ({self.end}) before it starts ({self.start})")


@dataclass(frozen=True)
class PoolSlot:
    """One buffer of a bucket pool, planned or grown by the runtime: its size and the uses it
    serves, in order ("<bucket> all-gather", "<bucket> copy-out", "<bucket> reduce-scatter")."""

    numel: int
    dtype: str
    nbytes: int
    users: tuple[str, ...]


def describe_slots(title: str, slots: Iterable[PoolSlot]) -> str:
    """A table of ``slots``, one line each, under ``title`` (followed by the count and bytes)."""
    slots = list(slots)
    mib = 1 << 20
    lines = [f"{title}: {len(slots)} buffers, {sum(s.nbytes for s in slots) / mib:.3f} MiB"]
    for i, slot in enumerate(slots):
        lines.append(f"  slot {i}: {slot.nbytes / mib:8.3f} MiB {slot.dtype.removeprefix('torch.')}: {', '.join(slot.users)}")
    return "\n".join(lines)


@dataclass(frozen=True)
class SlotPlan:
    """The buffers a schedule's bucket pool needs (:func:`plan_slots`)."""

    slots: tuple[PoolSlot, ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.slots)

    def counts(self) -> dict[tuple[int, str], int]:
        """Buffers per (numel, dtype)."""
        counts: dict[tuple[int, str], int] = defaultdict(int)
        for s in self.slots:
            counts[(s.numel, s.dtype)] += 1
        return dict(counts)

    def __str__(self) -> str:
        return describe_slots("planned bucket pool", self.slots)


def plan_slots(intervals: Iterable[PoolInterval]) -> SlotPlan:
    """Assigns every interval a buffer, first fit by exact size and dtype in order of start.

    An interval may take a buffer whose last use ended at or before its start. Intervals that
    start together are placed in the order given (the order the runtime acquires them); empty
    ones hold nothing."""
    ordered = sorted(((i, v) for i, v in enumerate(intervals) if v.end > v.start), key=lambda item: (item[1].start, item[0]))
    free_at: list[int] = []  # per slot, when its last use ends
    keys: list[tuple[int, str]] = []
    users: list[list[str]] = []
    itemsizes: list[int] = []
    for _, interval in ordered:
        key = (interval.numel, interval.dtype)
        slot = next((i for i, k in enumerate(keys) if k == key and free_at[i] <= interval.start), None)
        if slot is None:
            keys.append(key)
            free_at.append(interval.end)
            users.append([])
            itemsizes.append(interval.itemsize)
            slot = len(keys) - 1
        free_at[slot] = interval.end
        if interval.user not in users[slot]:
            users[slot].append(interval.user)
    return SlotPlan(
        tuple(PoolSlot(numel, dtype, numel * size, tuple(u)) for (numel, dtype), size, u in zip(keys, itemsizes, users, strict=True))
    )


def max_overlap(intervals: Iterable[PoolInterval]) -> dict[tuple[int, str], int]:
    """The most intervals of each (numel, dtype) alive at one time: the fewest buffers any pool
    needs for them (a sweep over starts and ends; an end frees before a start at the same time)."""
    events: dict[tuple[int, str], list[tuple[int, int]]] = defaultdict(list)
    for interval in intervals:
        if interval.end > interval.start:
            key = (interval.numel, interval.dtype)
            events[key] += [(interval.start, 1), (interval.end, -1)]
    most: dict[tuple[int, str], int] = {}
    for key, points in events.items():
        alive = best = 0
        for _, change in sorted(points, key=lambda p: (p[0], p[1])):
            alive += change
            best = max(best, alive)
        most[key] = best
    return most


@dataclass(frozen=True)
class ReduceScatterIssue:
    """A bucket's lone reduce-scatter on the step's timeline: where it is issued, and the user
    name of the pool interval its lay-out holds (None: it sends its gradients where they are)."""

    # The bucket object the trace names (the key of its layout).
    bucket: object
    layout: BucketLayout
    start: int
    pool_user: str | None


def plan_shards_in_pool(
    intervals: Iterable[PoolInterval], issues: Iterable[ReduceScatterIssue], step_end: int
) -> list[ReduceScatterIssue]:
    """The reduce-scatters that can run in place in a pool buffer at no cost in buffers.

    Such a reduce-scatter holds a buffer from its issue to the end of the step, since its
    gradient shard is a row of it. In order of issue, each is tried on the intervals planned so
    far (its own lay-out interval, if any, replaced by that longer one) and kept only if no
    size class then needs more buffers than before: the pool does not grow, the reduce-scatter
    takes a buffer that would otherwise sit idle (in ZeRO2, the gather of the block whose
    backward just ended), and the gradient shard it would have allocated is saved.
    """
    planned = list(intervals)
    buffers = max_overlap(planned)
    chosen = []
    for issue in sorted(issues, key=lambda i: i.start):
        layout = issue.layout
        user = f"{layout.label} reduce-scatter in place"
        in_place = PoolInterval(user, layout.unsharded_numel, layout.dtype, layout.itemsize, issue.start, step_end)
        trial = [v for v in planned if (v.user, v.start) != (issue.pool_user, issue.start)] + [in_place]
        key = (layout.unsharded_numel, layout.dtype)
        if max_overlap(trial).get(key, 0) <= buffers.get(key, 0):
            planned = trial
            chosen.append(issue)
    return chosen


def intervals_gathered_in_place(intervals: Iterable[PoolInterval], gathered_in_place: Iterable[str]) -> list[PoolInterval]:
    """The pool uses of a step whose buckets labelled ``gathered_in_place`` gather each parameter
    into its place, from its uses as laid out: such a bucket keeps its gathered buffer for as long
    as its copy-out was kept, so each copy-out merges into the gather it was copied from (the one
    busy when it starts)."""
    labels = set(gathered_in_place)
    merged = [v for v in intervals if not (v.user.endswith(" copy-out") and v.user.removesuffix(" copy-out") in labels)]
    for copy_out in intervals:
        label = copy_out.user.removesuffix(" copy-out")
        if not copy_out.user.endswith(" copy-out") or label not in labels:
            continue
        gathers = [i for i, v in enumerate(merged) if v.user == f"{label} all-gather" and v.start <= copy_out.start < v.end]
        if not gathers:
            raise ValueError(f"no all-gather of {label!r} is busy when its copy-out starts ({copy_out.start})")
        source = max(gathers, key=lambda i: merged[i].start)  # the latest: the one just waited on
        merged[source] = replace(merged[source], end=max(merged[source].end, copy_out.end))
    return merged


def _pool_bytes(intervals: list[PoolInterval]) -> int:
    itemsizes = {(v.numel, v.dtype): v.itemsize for v in intervals}
    return sum(count * numel * itemsizes[(numel, dtype)] for (numel, dtype), count in max_overlap(intervals).items())


def intervals_reduced_from_copy(intervals: Iterable[PoolInterval], reduced_from_copy: Iterable[str]) -> list[PoolInterval]:
    """The pool uses of a step whose buckets labelled ``reduced_from_copy`` hand their laid-out
    gradients to the backend's copy at the launch: each such lay-out is busy for its launch only."""
    labels = {f"{label} reduce-scatter" for label in reduced_from_copy}
    return [replace(v, end=min(v.end, v.start + 1)) if v.user in labels else v for v in intervals]


def fewest_per_tensor_gathers(intervals: Iterable[PoolInterval], candidates: Iterable[str]) -> list[str]:
    """The fewest of the buckets labelled ``candidates`` whose gathering in place leaves the pool
    as small as gathering all of them in place would (see :func:`fewest_for_smallest_pool`)."""
    return fewest_for_smallest_pool(intervals, candidates, intervals_gathered_in_place)


def fewest_reduce_scatters_from_copy(intervals: Iterable[PoolInterval], candidates: Iterable[str]) -> list[str]:
    """The fewest of the buckets labelled ``candidates`` whose reduce-scatters, from the backend's
    copy, leave the pool as small as all of them would (see :func:`fewest_for_smallest_pool`)."""
    return fewest_for_smallest_pool(intervals, candidates, intervals_reduced_from_copy)


def fewest_for_smallest_pool(
    intervals: Iterable[PoolInterval],
    candidates: Iterable[str],
    changed: Callable[[list[PoolInterval], list[str]], list[PoolInterval]],
) -> list[str]:
    """The fewest of the buckets labelled ``candidates`` whose change (``changed`` gives the
    step's intervals with the buckets it is given changed) leaves the pool as small as changing
    all of them would.

    The change must only shorten or merge intervals, never add to the pool, so that all
    candidates give the smallest pool; from there each is dropped in turn, in order, if the pool
    needs no more bytes without it. Dropping any of those left would need more (the pool only
    grows as fewer are changed)."""
    intervals = list(intervals)
    chosen = list(dict.fromkeys(candidates))
    smallest = _pool_bytes(changed(intervals, chosen))
    for label in list(chosen):
        trial = [c for c in chosen if c != label]
        if _pool_bytes(changed(intervals, trial)) <= smallest:
            chosen = trial
    return chosen
