"""The bucket pool's slot plan: which unsharded buffers a schedule needs, from its live intervals.

A bucketed collective runs on flat buffers from one pool (:class:`~thunder_overlap._bucketing.buffers.BufferPool`):
an all-gather output from its issue until its future dies (until the last view of a parameter
dies, where the parameters are views of it: :attr:`BucketLayout.copies_out`), the
parameter-major copy-out from the wait until the last view of a parameter dies, and a
reduce-scatter's laid-out gradients from the issue until the future dies (unless the bucket
sends its gradients where they are: :meth:`BucketLayout.sends_gradients`; for the launch only
where the backend copies them: :attr:`BucketLayout.reduce_scatter_from_copy`), or, where it
reduces in place in the pool (:attr:`BucketLayout.reduces_in_pool`), until the gradient shard
that is a row of it dies, at the end of the step. The pool hands a
buffer out again once it is idle, to any use of the same size and dtype, and never frees one;
so it holds, per (numel, dtype), as many buffers as the schedule has intervals of that size
alive at once.

:func:`plan_slots` colours the intervals the way the pool reuses (in order of start, the first
idle buffer of the same size): on intervals this is optimal, so the plan has exactly the maximum
overlap of each size class, the schedule's real concurrency. The memory estimator records the
intervals (:func:`~thunder_overlap._analysis.memory_estimate.estimate_memory`) and counts the
planned slots as persistent, as the runtime holds them. :func:`plan_shards_in_pool` picks the
reduce-scatters that can reduce in place in a buffer the plan leaves idle to the step's end, and
:func:`fewest_per_tensor_gathers` the buckets that, gathered per parameter into their place
rather than copied out (:func:`intervals_gathered_in_place`), make the pool smallest;
:func:`fewest_reduce_scatters_from_copy` those whose reduce-scatters, handed to the backend's
copy of their input rather than reduced in the pool buffer (:func:`intervals_reduced_from_copy`),
do.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

__all__ = [
    "BucketLayout",
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
class BucketLayout:
    """What the memory estimator needs of one bucket to follow its pool buffers."""

    label: str
    # Elements of one unsharded buffer: world size x the flat shard, padding included.
    unsharded_numel: int
    dtype: str
    itemsize: int
    tensors: int
    world_size: int
    # Whether the backend runs a coalesced launch of several collectives as one (NCCL's group
    # calls; gloo runs them one after another, each paying its latency). Then a bucket of
    # several tensors gathers each parameter straight into its place in the buffer (no
    # copy-out) and reduce-scatters each unpadded gradient where it is (no lay-out); otherwise
    # it gathers rank-major and copies out, and lays its gradients out into one buffer.
    launches_coalesced_as_one: bool = False
    # Whether the backend copies a reduce-scatter's whole input into a buffer of its own, which
    # its Work holds until the wait: gloo does (measured with LiveMemoryTracker), NCCL does not.
    reduce_scatter_copies_input: bool = False
    # Whether the reduce-scatter runs in place in a pool buffer and this rank's row of it is the
    # gradient shard, held until the gradient is let go (after the step, normally): chosen by
    # :func:`plan_shards_in_pool` for buckets whose reduce-scatter comes when a buffer would
    # otherwise sit idle to the end of the step. The gradients are laid out into it (one copy),
    # so they are free as soon as the collective is launched rather than after its wait.
    reduces_in_pool: bool = False
    # Chosen per bucket where the backend runs a coalesced launch one collective at a time
    # (gloo): gather each parameter into its place, as on NCCL, paying a launch per parameter
    # instead of a copy-out and its buffer. Chosen by
    # :mod:`~thunder_overlap._bucketing.per_tensor_gathers` only where
    # that buffer would make the pool larger than the smallest pool the schedule allows.
    per_tensor_gather: bool = False
    # Where the backend copies a reduce-scatter's input at the launch (gloo): the laid-out
    # gradients go to that copy, so the pool buffer is busy for the launch only and the copy,
    # outside the pool, is held until the wait; otherwise the bucket all-reduces its pool buffer
    # in place (no copy), busy until the wait. Chosen by
    # :mod:`~thunder_overlap._bucketing.reduce_from_copy` only
    # where holding the buffer to the wait would make the pool larger than the step needs.
    reduce_scatter_from_copy: bool = False

    def __post_init__(self) -> None:
        # On a backend that reads the input while the collective runs (NCCL), handing the
        # buffer back to the pool at the launch would let the next use overwrite it in flight.
        if self.reduce_scatter_from_copy and not self.reduce_scatter_copies_input:
            raise ValueError(f"bucket {self.label!r}: reduce_scatter_from_copy needs a backend that copies a reduce-scatter's input")
        if self.reduce_scatter_from_copy and self.reduces_in_pool:
            raise ValueError(f"bucket {self.label!r}: a reduce-scatter runs in the pool or from the backend's copy, not both")

    def as_on_nccl(self) -> BucketLayout:
        """This bucket as it runs on NCCL whatever the backend: coalesced launches as one, and no
        copy of a reduce-scatter's input (over gloo this runs NCCL's paths for real)."""
        return replace(self, launches_coalesced_as_one=True, reduce_scatter_copies_input=False, reduce_scatter_from_copy=False)

    @property
    def copies_out(self) -> bool:
        """Whether the wait lays the gather out parameter by parameter into a second buffer.
        With one tensor, or one rank, the parameters are views of the gather output; where a
        coalesced launch runs as one, each parameter is gathered into its place (see
        :attr:`gathers_in_place`)."""
        return self.tensors > 1 and self.world_size > 1 and not (self.launches_coalesced_as_one or self.per_tensor_gather)

    @property
    def gathers_in_place(self) -> bool:
        """Whether the all-gather is one coalesced launch of an all-gather per parameter, each
        into the parameter's own place in the buffer: the buffer is then parameter-major as it
        arrives, with no copy-out and no second buffer."""
        return self.tensors > 1 and self.world_size > 1 and (self.launches_coalesced_as_one or self.per_tensor_gather)

    def sends_gradients(self, gradient_numels: list[int]) -> bool:
        """Whether the reduce-scatter reads the gradients where they are (one collective per
        gradient, in one launch) rather than from a pool buffer they are laid out into: when no
        gradient needs padding (they add up to the unsharded buffer) and they are one, or the
        backend runs a launch of several as one."""
        unpadded = sum(gradient_numels) == self.unsharded_numel
        return not self.reduces_in_pool and unpadded and (self.tensors == 1 or self.launches_coalesced_as_one)

    def reduce_scatter_holds_pool_buffer(self, gradient_numels: list[int], *, coalesced: bool = False) -> bool:
        """Whether the reduce-scatter keeps a pool buffer busy from its launch to its wait: its
        gradients laid out into it and all-reduced in place there (not sent where they are, not
        handed to the backend's copy at the launch, which a coalesced launch does not do, and not
        reduced in place for good, which holds the buffer to the step's end whatever the wait)."""
        if self.reduces_in_pool or self.sends_gradients(gradient_numels):
            return False
        return coalesced or not self.reduce_scatter_from_copy

    def gather_launches(self) -> int:
        """Launches the backend pays a latency for to gather the bucket: one per parameter where
        it gathers in place on a backend that runs a coalesced launch one collective at a time."""
        return self.tensors if self.gathers_in_place and not self.launches_coalesced_as_one else 1

    @property
    def nbytes(self) -> int:
        return self.unsharded_numel * self.itemsize


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

    bucket_id: int
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
