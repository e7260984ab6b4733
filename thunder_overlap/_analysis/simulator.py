"""Two-stream simulation of one rank running a scheduled execution trace.

The compute stream runs the trace's ops in the given order, each for its cost-model time. Each
process group has one communication stream, on its own link (the network
:meth:`CostModel.network_for` gives the group), which runs its collectives in issue order;
groups do not wait for one another (hybrid sharding's all-reduces across nodes run beside the
shard group's reduce-scatters). A collective starts when it is issued (the compute stream
reaches it) and its stream is free, and a wait blocks the compute stream until the collective is
done. What the compute stream spends blocked at a wait is that collective's *exposed* time.
Every collective of the trace is one launch and pays its latency, however close to another it is
issued: back-to-back NCCL launches serialise on the communicator's stream. Only a coalesced
launch (one node for several tensors) shares one. A group whose backend runs
``NetworkProfile.concurrent_launches`` > 1 at once (gloo) has that many lanes on one link: a
launch takes the first free lane and pays its latency once the latency before it has passed,
then transfers when the link is free, in issue order; so one launch's latency can pass during
another's transfer, while latencies and bytes each still pass one launch at a time. (Small
launches gain nothing from this; on gloo with one core per rank they lose, which the model
leaves out: coalescing them is the remedy, and the scheduler does it.) A bucketed collective's
local copies (:meth:`CostModel.local_copy_ms`) run on the compute stream: the lay-out before its
launch, the copy-out after its wait. With ``CostModel.overlap_compute_slowdown`` > 0, compute
runs that much slower while any collective is in flight. Whether a collective is *hidden* is
decided by :class:`thunder_overlap._analysis.overlap.Coverage` from this simulation (see there).

A collective is *potentially hideable* when some compute op is neither its ancestor nor its
descendant in the data-flow graph: only then can any order overlap it. Ancestry is found with one
bitmask per node over collectives (Python ints), so the cost is O(nodes x collectives / 64).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from thunder_overlap._analysis.classify import AnnotatedTrace, CollectiveKind, NodeKind
from thunder_overlap._analysis.cost_model import CostModel
from thunder_overlap._analysis.overlap import Coverage

__all__ = ["CollectiveTiming", "OpTiming", "Simulation", "collective_ancestry", "potentially_hideable", "simulate"]

_KIND_LABELS = {
    CollectiveKind.ALL_GATHER: "all_gather",
    CollectiveKind.REDUCE_SCATTER: "reduce_scatter",
    CollectiveKind.ALL_REDUCE: "all_reduce",
}


@dataclass(frozen=True)
class OpTiming:
    """One node on the compute stream: an issue or a wait takes only its local copies' time
    (and a wait its stall)."""

    node: int
    name: str
    start_ms: float
    end_ms: float


@dataclass(frozen=True)
class CollectiveTiming:
    collective: int
    kind: str
    # Index of the communication stream (one per process group, in order of first use).
    stream: int
    unsharded_bytes: int
    issue_ms: float
    start_ms: float
    end_ms: float
    # When the compute stream reached the wait (the step's end if nothing waits on it).
    wait_ms: float
    # What the compute stream spent blocked at this collective's own wait.
    exposed_ms: float
    potentially_hideable: bool
    # Compute-stream computing time (not stalled) while this collective ran.
    covered_ms: float

    @property
    def duration_ms(self) -> float:
        """Its own time on its stream (queueing before it starts excluded)."""
        return self.end_ms - self.start_ms

    @property
    def coverage(self) -> Coverage:
        return Coverage(duration_ms=self.duration_ms, covered_ms=self.covered_ms)

    @property
    def hidden(self) -> bool:
        """The project's one definition (:mod:`thunder_overlap._analysis.overlap`)."""
        return self.coverage.hidden


@dataclass(frozen=True)
class Simulation:
    ops: list[OpTiming]
    collectives: list[CollectiveTiming]
    step_ms: float
    compute_ms: float
    # Busiest communication stream's total: what no order can beat (see _GroupLink.busy_ms).
    communication_ms: float

    @property
    def bound_ms(self) -> float:
        """No order can beat the busier of the two streams."""
        return max(self.compute_ms, self.communication_ms)

    @property
    def exposed_ms(self) -> float:
        return sum(c.exposed_ms for c in self.collectives)

    @property
    def hideable(self) -> int:
        return sum(c.potentially_hideable for c in self.collectives)

    @property
    def hidden(self) -> int:
        """Potentially hideable collectives that this order hides."""
        return sum(c.potentially_hideable and c.hidden for c in self.collectives)


def collective_ancestry(annotated: AnnotatedTrace) -> tuple[list[int], list[int]]:
    """Per node, two bitmasks over collectives: the collectives whose issue it feeds (it is an
    ancestor of the issue, or the issue itself), and those whose wait it depends on (a
    descendant of the wait, or the wait itself)."""
    nodes = annotated.nodes
    start_bit = {c.start: 1 << i for i, c in enumerate(annotated.collectives)}
    wait_bit = {c.wait: 1 << i for i, c in enumerate(annotated.collectives) if c.wait is not None}
    # Descendants of waits, forward through producers.
    below = [0] * len(nodes)
    for node in nodes:
        mask = wait_bit.get(node.index, 0)
        for name in node.inputs:
            p = annotated.producer.get(name)
            if p is not None and p != node.index:
                mask |= below[p]
        below[node.index] = mask
    # Ancestors of issues, backward through consumers.
    above = [0] * len(nodes)
    for node in reversed(nodes):
        mask = start_bit.get(node.index, 0)
        for name in node.outputs:
            for c in annotated.consumers.get(name, ()):
                if c != node.index:
                    mask |= above[c]
        above[node.index] = mask
    return above, below


def potentially_hideable(annotated: AnnotatedTrace) -> list[bool]:
    """For each collective: does some compute op neither feed its issue nor depend on its wait?"""
    count = len(annotated.collectives)
    everything = (1 << count) - 1
    above, below = collective_ancestry(annotated)
    unrelated_somewhere = 0
    for node in annotated.nodes:
        if node.kind is NodeKind.COMPUTE:
            unrelated_somewhere |= everything & ~(above[node.index] | below[node.index])
    return [bool(unrelated_somewhere >> i & 1) for i in range(count)]


class _ComputeIntervals:
    """When the compute stream computed (consecutive, non-overlapping intervals), and how much
    of any span it spent computing, in O(log ops)."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.done_before: list[float] = []  # computing time before each interval

    def add(self, start: float, end: float) -> None:
        if end > start:
            self.done_before.append(self.done_before[-1] + self.ends[-1] - self.starts[-1] if self.starts else 0.0)
            self.starts.append(start)
            self.ends.append(end)

    def done_by(self, t: float) -> float:
        i = bisect.bisect_right(self.starts, t) - 1
        return 0.0 if i < 0 else self.done_before[i] + min(t, self.ends[i]) - self.starts[i]

    def between(self, start: float, end: float) -> float:
        return self.done_by(end) - self.done_by(start)


def _slowed_end(start: float, duration: float, busy: list[tuple[float, float]], slowdown: float) -> float:
    """When a compute op of ``duration`` that starts at ``start`` ends, running ``1 + slowdown``
    times slower inside the (start-ordered, possibly overlapping) ``busy`` intervals."""
    now, remaining = start, duration
    for busy_start, busy_end in busy:
        if busy_end <= now:
            continue
        if busy_start > now:  # full speed until the next collective starts
            if remaining <= busy_start - now:
                return now + remaining
            remaining -= busy_start - now
            now = busy_start
        if remaining * (1 + slowdown) <= busy_end - now:
            return now + remaining * (1 + slowdown)
        remaining -= (busy_end - now) / (1 + slowdown)
        now = busy_end
    return now + remaining


class _GroupLink:
    """One process group's communication: ``lanes`` launches in progress at once on one link.

    A launch pays its latency, then moves its bytes. Latencies pass one at a time (they are the
    rank's and the link's round trips, which concurrent launches share), and so do transfers
    (the link's bandwidth); what concurrency buys is one launch's latency passing while another
    transfers. With one lane that is the serial stream of a NCCL communicator.
    """

    def __init__(self, lanes: int) -> None:
        self.lane_free = [0.0] * lanes
        self.latency_free = 0.0
        self.link_free = 0.0
        self.latency_total = 0.0
        self.transfer_total = 0.0
        self.latency_min = self.transfer_min = float("inf")

    def run(self, issued_ms: float, latency_ms: float, transfer_ms: float) -> tuple[float, float]:
        """(start, end) of a launch issued at ``issued_ms``. ``end - start`` is its own time on
        the link: from when it started or the launch before it left the link, whichever is
        later. With one lane that is its latency and transfer; with more, the latency it paid
        while another launch transferred is not its own."""
        lane = min(range(len(self.lane_free)), key=self.lane_free.__getitem__)
        start = max(issued_ms, self.lane_free[lane], self.latency_free)
        self.latency_free = start + latency_ms
        end = max(self.latency_free, self.link_free) + transfer_ms
        own_start = max(start, self.link_free)
        self.lane_free[lane] = self.link_free = end
        self.latency_total += latency_ms
        self.transfer_total += transfer_ms
        self.latency_min = min(self.latency_min, latency_ms)
        self.transfer_min = min(self.transfer_min, transfer_ms)
        return own_start, end

    def busy_ms(self) -> float:
        """A lower bound on this group's communication under any order: latencies pass one at
        a time and so do transfers, each after at least one of the other kind, and the lanes
        share every launch's whole time. With one lane that is the sum of the launches' times."""
        if self.latency_min == float("inf"):
            return 0.0
        lanes = len(self.lane_free)
        return max(
            self.transfer_total + self.latency_min,
            self.latency_total + self.transfer_min,
            (self.latency_total + self.transfer_total) / lanes,
        )


class _Streams:
    """The compute stream and the groups' links while an order is run."""

    def __init__(self, annotated: AnnotatedTrace, cost_model: CostModel) -> None:
        self.annotated, self.cost_model = annotated, cost_model
        self.now = 0.0
        self.compute_total = 0.0
        self.computing = _ComputeIntervals()
        self.streams: dict[int, int] = {}  # group key -> link
        self.links: list[_GroupLink] = []
        self.issued: dict[int, tuple[int, float, float, float]] = {}  # collective -> (stream, issue, start, end)
        self.waited: dict[int, tuple[float, float]] = {}  # collective -> (reached wait, exposed)
        self.busy: list[tuple[float, float]] = []  # every collective's (start, end), in start order
        self.ops: list[OpTiming] = []

    def compute(self, duration: float) -> None:
        """Runs ``duration`` of work on the compute stream from ``now``."""
        slowdown = self.cost_model.overlap_compute_slowdown
        end = _slowed_end(self.now, duration, self.busy, slowdown) if slowdown else self.now + duration
        self.computing.add(self.now, end)
        self.compute_total += duration
        self.now = end

    def issue(self, index: int, node) -> None:
        issued_from = self.now
        cost_model = self.cost_model
        self.compute(cost_model.local_copy_ms(node.bsym, self.annotated.layouts))  # the launch waits for its input's lay-out
        coll = self.annotated.collectives[node.collective]
        stream = self.streams.setdefault(coll.group_key, len(self.streams))
        if stream == len(self.links):
            self.links.append(_GroupLink(cost_model.network_for(coll).concurrent_launches))
        latency = cost_model.collective_latency_ms(coll)
        start, end = self.links[stream].run(self.now, latency, cost_model.collective_ms(coll) - latency)
        self.issued[node.collective] = (stream, self.now, start, end)
        if cost_model.overlap_compute_slowdown:
            self.busy.insert(bisect.bisect(self.busy, (start, end)), (start, end))
        self.ops.append(OpTiming(index, node.name, issued_from, self.now))

    def wait(self, index: int, node) -> None:
        reached = self.now
        exposed = max(0.0, self.issued[node.collective][3] - self.now)
        self.waited[node.collective] = (self.now, exposed)
        self.now += exposed
        issue = self.annotated.nodes[self.annotated.collectives[node.collective].start].bsym
        self.compute(self.cost_model.local_copy_ms(node.bsym, self.annotated.layouts, issue))  # the copy-out reads the result
        self.ops.append(OpTiming(index, node.name, reached, self.now))

    def op(self, index: int, node) -> None:
        start = self.now
        self.compute(self.cost_model.compute_ms(node.bsym))
        self.ops.append(OpTiming(index, node.name, start, self.now))


def simulate(annotated: AnnotatedTrace, order: list[int], cost_model: CostModel) -> Simulation:
    """Runs ``order`` (node indices of ``annotated``) on one compute and per-group comm streams."""
    nodes = annotated.nodes
    if sorted(order) != list(range(len(nodes))):
        raise ValueError(f"order must be a permutation of the {len(nodes)} node indices of the annotated trace")
    run = _Streams(annotated, cost_model)
    for index in order:
        node = nodes[index]
        if node.kind is NodeKind.COLLECTIVE:
            run.issue(index, node)
        elif node.kind is NodeKind.WAIT:
            run.wait(index, node)
        else:
            run.op(index, node)
    hideable = potentially_hideable(annotated)
    timings = []
    for c, coll in enumerate(annotated.collectives):
        stream, issue, start, end = run.issued[c]
        reached, exposed = run.waited.get(c, (run.now, max(0.0, end - run.now)))
        timings.append(
            CollectiveTiming(
                c, _KIND_LABELS[coll.kind], stream, coll.unsharded_bytes, issue, start, end, reached, exposed, hideable[c],
                run.computing.between(start, end),
            )
        )  # fmt: skip
    step = max([run.now, *(link.link_free for link in run.links)])
    bound = max((link.busy_ms() for link in run.links), default=0.0)
    return Simulation(run.ops, timings, step, run.compute_total, bound)
