"""Two-stream simulator on hand-built annotated traces whose timings are worked out by hand."""

from __future__ import annotations

import itertools
from dataclasses import replace
from types import SimpleNamespace

import pytest

from thunder_overlap._analysis.bounds import dependence_bound_ms
from thunder_overlap._analysis.classify import (
    AnnotatedTrace,
    Collective,
    CollectiveKind,
    NodeKind,
    TraceNode,
)
from thunder_overlap._analysis.cost_model import CostModel, DeviceProfile, NetworkProfile
from thunder_overlap._analysis.simulator import potentially_hideable, simulate

# On 2 ranks with no latency and 1 GB/s, a collective of 4 MB takes 1/2 * 4 MB / 1 GB/s = 2 ms.
NETWORK = NetworkProfile("test", latency_s=0.0, bus_bandwidth=1e9)
TWO_MS_OF_BYTES = 4_000_000
COMPUTE_MS = {"a": 3.0, "b": 1.0, "c": 2.0}


class _Group:
    def size(self) -> int:
        return 2


def _cost_model(overlap_compute_slowdown: float = 0.0) -> CostModel:
    device = DeviceProfile("test", 1e12, 1e12, 1e9)
    return CostModel(
        device, NETWORK, user_estimate=lambda bsym: COMPUTE_MS.get(bsym.sym.name, 0.0), overlap_compute_slowdown=overlap_compute_slowdown
    )


def _node(index, kind, name, inputs=(), outputs=(), collective=None) -> TraceNode:
    bsym = SimpleNamespace(sym=SimpleNamespace(name=name, id=name))  # the simulator only needs its name and id
    return TraceNode(index, bsym, kind, tuple(inputs), tuple(outputs), collective)


def _trace(nodes, collectives, layouts=None) -> AnnotatedTrace:
    producer, consumers = {}, {}
    for n in nodes:
        for name in n.inputs:
            consumers.setdefault(name, []).append(n.index)
        for name in n.outputs:
            producer.setdefault(name, n.index)
    if layouts is None:
        return AnnotatedTrace(None, nodes, collectives, producer, consumers)
    return AnnotatedTrace(None, nodes, collectives, producer, consumers, layouts)


def _one_gather(compute_reads_gathered: bool = False) -> AnnotatedTrace:
    """header; all-gather of w; a (3 ms, independent or not); wait; b (1 ms, reads the
    gathered w); return."""
    group = _Group()
    nodes = [
        _node(0, NodeKind.HEADER, "unpack_trivial", outputs=["x", "w"]),
        _node(1, NodeKind.COLLECTIVE, "all_gather", inputs=["w"], outputs=["fw"], collective=0),
        _node(2, NodeKind.WAIT, "wait", inputs=["fw"], outputs=["gw"], collective=0),
        _node(3, NodeKind.COMPUTE, "a", inputs=["gw" if compute_reads_gathered else "x"], outputs=["y"]),
        _node(4, NodeKind.COMPUTE, "b", inputs=["y", "gw"], outputs=["z"]),
        _node(5, NodeKind.RETURN, "python_return", inputs=["z"]),
    ]
    return _trace(nodes, [Collective(CollectiveKind.ALL_GATHER, 1, 2, group, TWO_MS_OF_BYTES)])


def test_wait_after_independent_compute_hides_the_collective():
    # issue at 0, gather runs 0-2 ms, a runs 0-3 ms, the wait at 3 ms finds it done, b 3-4 ms.
    sim = simulate(_one_gather(), [0, 1, 3, 2, 4, 5], _cost_model())
    (gather,) = sim.collectives
    assert (gather.start_ms, gather.end_ms, gather.exposed_ms) == (0.0, 2.0, 0.0)
    assert sim.step_ms == pytest.approx(4.0)
    assert sim.bound_ms == pytest.approx(4.0)  # max(compute 4, communication 2)
    assert (sim.hideable, sim.hidden) == (1, 1)


def test_wait_before_compute_exposes_the_whole_collective():
    # The wait at 0 ms blocks until 2 ms; a runs 2-5, b 5-6.
    sim = simulate(_one_gather(), [0, 1, 2, 3, 4, 5], _cost_model())
    assert sim.collectives[0].exposed_ms == pytest.approx(2.0)
    assert sim.exposed_ms == pytest.approx(2.0)
    assert sim.step_ms == pytest.approx(6.0)
    assert (sim.hideable, sim.hidden) == (1, 0)


def test_collective_every_compute_op_depends_on_is_not_hideable():
    assert potentially_hideable(_one_gather(compute_reads_gathered=True)) == [False]
    assert potentially_hideable(_one_gather()) == [True]


def test_collectives_of_one_group_queue_on_its_stream():
    # Two 2 ms gathers issued at 0 run 0-2 and 2-4 ms (one stream). c runs 0-2 ms; the first
    # wait then finds its gather done, the second stalls 2-4 ms; a runs 4-7 ms.
    group = _Group()
    nodes = [
        _node(0, NodeKind.HEADER, "unpack_trivial", outputs=["x", "w1", "w2"]),
        _node(1, NodeKind.COLLECTIVE, "all_gather", inputs=["w1"], outputs=["f1"], collective=0),
        _node(2, NodeKind.COLLECTIVE, "all_gather", inputs=["w2"], outputs=["f2"], collective=1),
        _node(3, NodeKind.COMPUTE, "c", inputs=["x"], outputs=["y"]),
        _node(4, NodeKind.WAIT, "wait", inputs=["f1"], outputs=["g1"], collective=0),
        _node(5, NodeKind.WAIT, "wait", inputs=["f2"], outputs=["g2"], collective=1),
        _node(6, NodeKind.COMPUTE, "a", inputs=["y", "g1", "g2"], outputs=["z"]),
        _node(7, NodeKind.RETURN, "python_return", inputs=["z"]),
    ]
    collectives = [
        Collective(CollectiveKind.ALL_GATHER, 1, 4, group, TWO_MS_OF_BYTES),
        Collective(CollectiveKind.ALL_GATHER, 2, 5, group, TWO_MS_OF_BYTES),
    ]
    sim = simulate(_trace(nodes, collectives), list(range(8)), _cost_model())
    first, second = sim.collectives
    assert (first.start_ms, first.end_ms, first.exposed_ms) == (0.0, 2.0, 0.0)
    assert (second.start_ms, second.end_ms) == (2.0, 4.0)
    assert second.exposed_ms == pytest.approx(2.0)  # waited at 2 ms (after c), done at 4 ms
    assert sim.step_ms == pytest.approx(7.0)  # c 0-2, stall 2-4, a 4-7
    assert sim.communication_ms == pytest.approx(4.0)
    assert sim.bound_ms == pytest.approx(5.0)
    assert (sim.hideable, sim.hidden) == (2, 1)


def _two_gathers_then_wait() -> AnnotatedTrace:
    """Two gathers issued at 0, both waited on at once, then a (3 ms)."""
    group = _Group()
    nodes = [
        _node(0, NodeKind.HEADER, "unpack_trivial", outputs=["x", "w1", "w2"]),
        _node(1, NodeKind.COLLECTIVE, "all_gather", inputs=["w1"], outputs=["f1"], collective=0),
        _node(2, NodeKind.COLLECTIVE, "all_gather", inputs=["w2"], outputs=["f2"], collective=1),
        _node(3, NodeKind.WAIT, "wait", inputs=["f1"], outputs=["g1"], collective=0),
        _node(4, NodeKind.WAIT, "wait", inputs=["f2"], outputs=["g2"], collective=1),
        _node(5, NodeKind.COMPUTE, "a", inputs=["x", "g1", "g2"], outputs=["z"]),
        _node(6, NodeKind.RETURN, "python_return", inputs=["z"]),
    ]
    collectives = [
        Collective(CollectiveKind.ALL_GATHER, 1, 3, group, TWO_MS_OF_BYTES),
        Collective(CollectiveKind.ALL_GATHER, 2, 4, group, TWO_MS_OF_BYTES),
    ]
    return _trace(nodes, collectives)


@pytest.mark.parametrize(
    ("lanes", "latency_ms", "ends", "communication_ms"),
    [
        # One launch at a time: 1 + 2 ms each, back to back.
        (1, 1.0, (3.0, 6.0), 6.0),
        # Two at once: the second's latency (0-1 ms) passes during the first's transfer (1-3 ms),
        # and the link carries its bytes after the first's (3-5 ms).
        (2, 1.0, (3.0, 5.0), 5.0),
        # Latencies pass one at a time: the second's (3-6 ms) outlasts the first's transfer
        # (3-5 ms) by 1 ms, which is its own; its bytes then cross 6-8 ms.
        (2, 3.0, (5.0, 8.0), 8.0),
    ],
)
def test_concurrent_launches_hide_a_latency_behind_another_transfer(lanes, latency_ms, ends, communication_ms):
    network = NetworkProfile("lanes", latency_s=latency_ms * 1e-3, bus_bandwidth=1e9, concurrent_launches=lanes)
    cost = CostModel(DeviceProfile("test", 1e12, 1e12, 1e9), network, user_estimate=lambda bsym: COMPUTE_MS.get(bsym.sym.name, 0.0))
    sim = simulate(_two_gathers_then_wait(), list(range(7)), cost)
    assert tuple(c.end_ms for c in sim.collectives) == pytest.approx(ends)
    assert sim.step_ms == pytest.approx(ends[1] + 3.0)
    # The second gather's own time on the link starts when the first leaves it.
    assert sim.collectives[1].start_ms == pytest.approx(ends[0])
    # No order beats every byte after one latency, every latency before one transfer, nor the
    # lanes' share of every launch's time.
    bound = max(latency_ms + 2 * 2.0, 2 * latency_ms + 2.0, 2 * (latency_ms + 2.0) / lanes)
    assert sim.communication_ms == pytest.approx(bound)
    assert sim.communication_ms == pytest.approx(communication_ms)


def test_compute_beside_a_collective_runs_slower_by_the_overlap_slowdown():
    # The gather runs 0-2 ms; a (3 ms of work) runs at half speed inside it: 1 ms of work by
    # 2 ms, the other 2 ms at full speed: a ends at 4 ms, b (after the gather) 4-5 ms.
    sim = simulate(_one_gather(), [0, 1, 3, 2, 4, 5], _cost_model(overlap_compute_slowdown=1.0))
    assert [(op.start_ms, op.end_ms) for op in sim.ops if op.name in COMPUTE_MS] == [(0.0, 4.0), (4.0, 5.0)]
    assert sim.step_ms == pytest.approx(5.0) and sim.compute_ms == pytest.approx(4.0)
    # Exposed waits do not overlap compute: nothing changes for the serial order.
    serial = simulate(_one_gather(), [0, 1, 2, 3, 4, 5], _cost_model(overlap_compute_slowdown=1.0))
    assert serial.step_ms == pytest.approx(6.0)
    with pytest.raises(ValueError, match="overlap_compute_slowdown must be >= 0.*-0.1"):
        _cost_model(overlap_compute_slowdown=-0.1)


def test_order_must_be_a_permutation():
    with pytest.raises(ValueError, match="permutation"):
        simulate(_one_gather(), [0, 1, 2], _cost_model())


# ---------------------------------------------------------------------------------------------
# The one definition of hidden (thunder_overlap._analysis.overlap): the rank computes for as long
# as the collective runs.


def _gathers_then_mask(second_group: _Group | None = None) -> AnnotatedTrace:
    """Thunder's forward in small: two gathers issued up front (2 ms each, or 4 ms for the first
    when it has a group of its own), b (1 ms, the attention mask) before both waits, then a
    (3 ms, needs neither) and c (reads both)."""
    first, second = _Group(), second_group
    first_bytes = TWO_MS_OF_BYTES if second is None else 2 * TWO_MS_OF_BYTES
    nodes = [
        _node(0, NodeKind.HEADER, "unpack_trivial", outputs=["x", "w1", "w2"]),
        _node(1, NodeKind.COLLECTIVE, "all_gather", inputs=["w1"], outputs=["f1"], collective=0),
        _node(2, NodeKind.COLLECTIVE, "all_gather", inputs=["w2"], outputs=["f2"], collective=1),
        _node(3, NodeKind.COMPUTE, "b", inputs=["x"], outputs=["mask"]),
        _node(4, NodeKind.WAIT, "wait", inputs=["f1"], outputs=["g1"], collective=0),
        _node(5, NodeKind.WAIT, "wait", inputs=["f2"], outputs=["g2"], collective=1),
        _node(6, NodeKind.COMPUTE, "a", inputs=["mask"], outputs=["y"]),
        _node(7, NodeKind.COMPUTE, "c", inputs=["y", "g1", "g2"], outputs=["z"]),
        _node(8, NodeKind.RETURN, "python_return", inputs=["z"]),
    ]
    collectives = [
        Collective(CollectiveKind.ALL_GATHER, 1, 4, first, first_bytes),
        Collective(CollectiveKind.ALL_GATHER, 2, 5, second or first, TWO_MS_OF_BYTES),
    ]
    return _trace(nodes, collectives)


def test_thunder_order_hides_nothing_that_a_small_op_before_the_waits_cannot_cover():
    # Gathers run 0-2 and 2-4 ms on one stream; b runs 0-1 ms, then the rank stalls at the
    # waits until 4 ms: neither is hidden, though a compute op sits between each issue and wait.
    sim = simulate(_gathers_then_mask(), list(range(9)), _cost_model())
    assert [c.covered_ms for c in sim.collectives] == [1.0, 0.0]
    assert [c.coverage.uncovered_ms for c in sim.collectives] == [1.0, 2.0]
    assert (sim.hideable, sim.hidden) == (2, 0)
    # The same ops with a moved ahead of the waits: b and a run 0-4 ms, beside both gathers.
    overlapped = simulate(_gathers_then_mask(), [0, 1, 2, 3, 6, 4, 5, 7, 8], _cost_model())
    assert [c.covered_ms for c in overlapped.collectives] == [2.0, 2.0]
    assert (overlapped.hideable, overlapped.hidden) == (2, 2)
    assert overlapped.exposed_ms == 0.0


def test_a_collective_done_while_the_rank_stalls_on_another_is_not_hidden():
    # Two groups: the 4 ms gather on one stream, the 2 ms one on another, both from 0 ms. The
    # rank stalls at the first wait from 1 to 4 ms; the second gather ended at 2 ms, so its own
    # wait costs nothing, but only b's 1 ms of compute ran beside it.
    sim = simulate(_gathers_then_mask(second_group=_Group()), list(range(9)), _cost_model())
    first, second = sim.collectives
    assert first.stream != second.stream
    assert (first.exposed_ms, second.exposed_ms) == (3.0, 0.0)
    assert (first.covered_ms, second.covered_ms) == (1.0, 1.0)
    assert not first.hidden and not second.hidden


def test_hidden_allows_one_percent_of_the_duration_uncovered():
    from thunder_overlap._analysis.overlap import HIDDEN_UNCOVERED_FRACTION, Coverage

    assert Coverage(duration_ms=2.0, covered_ms=2.0 - HIDDEN_UNCOVERED_FRACTION).hidden  # half of 1% uncovered
    assert not Coverage(duration_ms=2.0, covered_ms=1.9).hidden
    assert Coverage(duration_ms=0.0, covered_ms=0.0).hidden  # nothing to hide (a group of one rank)


# ---------------------------------------------------------------------------------------------
# Bucket copies run on the compute stream at the launch and at the wait.


def _bucket_round_trip() -> AnnotatedTrace:
    """A bucket of two bf16 weights (200,000 unsharded elements each, 800 kB gathered on 2
    ranks): all-gather issue, a (3 ms), wait with copy-out, b (1 ms), then the gradients'
    reduce-scatter (pre-averaged, no process group in the symbol: laid out as the gradients)
    and its wait."""
    from thunder.core import devices, dtypes
    from thunder.core.proxies import FutureTensorProxy, TensorProxy
    from thunder.core.trace import TraceCtx, tracectx

    from thunder_overlap._analysis.layout import BucketLayout
    from thunder_overlap._backends import GLOO
    from thunder_overlap._ops import (
        bucket_all_gather,
        bucket_all_gather_wait,
        bucket_reduce_scatter,
        bucket_reduce_scatter_wait,
    )

    def proxy(*shape, future=False):
        kind = FutureTensorProxy if future else TensorProxy
        return kind(shape=shape, dtype=dtypes.bfloat16, device=devices.cpu)

    with tracectx(TraceCtx()):
        gathered, reduced = proxy(400_000, future=True), proxy(200_000, future=True)
        weights, grads = [proxy(1000, 200), proxy(1000, 200)], [proxy(1000, 200), proxy(1000, 200)]
        shards = [proxy(500, 200), proxy(500, 200)]
        start_gather = bucket_all_gather.bind("b", None, shards, (0, 1), output=gathered)
        wait_gather = bucket_all_gather_wait.bind(gathered, "b", (0, 1), output=tuple(weights))
        start_scatter = bucket_reduce_scatter.bind("b", None, grads, 2.0, output=reduced)
        wait_scatter = bucket_reduce_scatter_wait.bind(reduced, "b", (0, 1), output=tuple(shards))
    # Over gloo: copied out, and the gradients laid out.
    layout = BucketLayout.default(
        "b", unsharded_numel=400_000, dtype="torch.bfloat16", itemsize=2, tensors=2, world_size=2, backend=GLOO, padded=False
    )
    group = _Group()
    nodes = [
        _node(0, NodeKind.HEADER, "unpack_trivial", outputs=["x", "s"]),
        TraceNode(1, start_gather, NodeKind.COLLECTIVE, ("s",), ("fg",), 0),
        _node(2, NodeKind.COMPUTE, "a", inputs=["x"], outputs=["y"]),
        TraceNode(3, wait_gather, NodeKind.WAIT, ("fg",), ("w",), 0),
        _node(4, NodeKind.COMPUTE, "b", inputs=["y", "w"], outputs=["g"]),
        TraceNode(5, start_scatter, NodeKind.COLLECTIVE, ("g",), ("fr",), 1),
        TraceNode(6, wait_scatter, NodeKind.WAIT, ("fr",), ("r",), 1),
        _node(7, NodeKind.RETURN, "python_return", inputs=["r"]),
    ]
    collectives = [
        Collective(CollectiveKind.ALL_GATHER, 1, 3, group, 800_000),
        Collective(CollectiveKind.REDUCE_SCATTER, 5, 6, group, 800_000),
    ]
    return _trace(nodes, collectives, {"b": layout})


def test_bucket_copies_take_their_bytes_over_memory_bandwidth_on_the_compute_stream():
    from thunder_overlap._analysis.local_copies import local_copy_bytes

    trace = _bucket_round_trip()
    cost_model = _cost_model()  # 1 GB/s of memory at 80% efficiency: 1.25 ms per MB
    bandwidth = cost_model.device.memory_bandwidth * cost_model.device.bandwidth_efficiency
    copy_out_ms = local_copy_bytes(trace.nodes[3].bsym, trace.layouts) / bandwidth * 1e3
    lay_out_ms = local_copy_bytes(trace.nodes[5].bsym, trace.layouts) / bandwidth * 1e3
    # The copy-out reads and writes the 800 kB gathered; the lay-out reads the 800 kB of
    # gradients, writes them, and the pre-average reads and writes them again.
    assert (copy_out_ms, lay_out_ms) == (pytest.approx(2.0), pytest.approx(4.0))
    sim = simulate(trace, list(range(8)), cost_model)
    ops = {op.node: (op.start_ms, op.end_ms) for op in sim.ops}
    gather, scatter = sim.collectives
    # The gather (0.4 ms) is done by the time a ends at 3 ms; the copy-out runs 3-5 ms, b 5-6.
    assert gather.exposed_ms == 0.0 and ops[3] == (3.0, pytest.approx(5.0)) and ops[4] == (pytest.approx(5.0), pytest.approx(6.0))
    # The lay-out runs 6-10 ms before the reduce-scatter launches (0.4 ms); its wait stalls.
    assert ops[5] == (pytest.approx(6.0), pytest.approx(10.0))
    assert (scatter.issue_ms, scatter.end_ms) == (pytest.approx(10.0), pytest.approx(10.4))
    assert scatter.exposed_ms == pytest.approx(0.4) and sim.step_ms == pytest.approx(10.4)
    # Copies are compute-stream work: they count in compute and in the bound.
    assert sim.compute_ms == pytest.approx(3.0 + 2.0 + 1.0 + 4.0)
    assert sim.bound_ms == pytest.approx(10.0)


def _gradient_tail(independent_first: bool) -> AnnotatedTrace:
    """a (3 ms) makes a gradient g, reduce-scattered (2 ms) and waited on at the end; c (2 ms)
    is independent of both, before a or after it in the compute order."""
    group = _Group()
    a = ("a", ["x"], ["g"])
    c = ("c", ["x"], ["z"])
    first, second = (c, a) if independent_first else (a, c)
    nodes = [
        _node(0, NodeKind.HEADER, "unpack_trivial", outputs=["x"]),
        _node(1, NodeKind.COMPUTE, first[0], inputs=first[1], outputs=first[2]),
        _node(2, NodeKind.COMPUTE, second[0], inputs=second[1], outputs=second[2]),
        _node(3, NodeKind.COLLECTIVE, "reduce_scatter", inputs=["g"], outputs=["fr"], collective=0),
        _node(4, NodeKind.WAIT, "wait", inputs=["fr"], outputs=["r"], collective=0),
        _node(5, NodeKind.RETURN, "python_return", inputs=["r", "z"]),
    ]
    return _trace(nodes, [Collective(CollectiveKind.REDUCE_SCATTER, 3, 4, group, TWO_MS_OF_BYTES)])


def _placements(trace: AnnotatedTrace) -> list[list[int]]:
    """Every order of the trace's nodes that runs each after its inputs' producers and keeps the
    compute in trace order: every placement of the collectives the scheduler may choose."""
    compute = [n.index for n in trace.nodes if n.kind is NodeKind.COMPUTE]
    placements = []
    for order in itertools.permutations(range(len(trace.nodes))):
        position = {index: i for i, index in enumerate(order)}
        after_inputs = all(
            position[trace.producer[name]] < position[n.index] for n in trace.nodes for name in n.inputs if name in trace.producer
        )
        if after_inputs and sorted(compute, key=position.__getitem__) == compute:
            placements.append(list(order))
    return placements


@pytest.mark.parametrize(
    "trace, bound_ms",
    [
        # Every compute op reads the gathered weight: the gather (2 ms) runs alone, then a and b.
        (_one_gather(compute_reads_gathered=True), 6.0),
        # a does not: it hides the gather, and max(compute, communication) binds.
        (_one_gather(), 4.0),
        # The gradient is ready after a; c (after it in the compute order) hides its reduction.
        (_gradient_tail(independent_first=False), 5.0),
        # With c first in the compute order, nothing is left to hide the reduction.
        (_gradient_tail(independent_first=True), 7.0),
    ],
)
def test_dependence_bound_is_what_the_best_placement_of_the_collectives_reaches(trace, bound_ms):
    cost_model = _cost_model()
    assert dependence_bound_ms(trace, cost_model) == pytest.approx(bound_ms)
    steps = [simulate(trace, order, cost_model) for order in _placements(trace)]
    # No placement beats it, the best reaches it, and it never undercuts max(compute, communication).
    assert min(s.step_ms for s in steps) == pytest.approx(bound_ms)
    assert all(s.bound_ms <= bound_ms + 1e-9 for s in steps)


def test_dependence_bound_leaves_links_of_concurrent_launches_to_the_busiest_link_bound():
    trace = _gradient_tail(independent_first=True)
    concurrent = replace(NETWORK, concurrent_launches=2)
    device = DeviceProfile("test", 1e12, 1e12, 1e9)
    cost_model = CostModel(device, concurrent, user_estimate=lambda bsym: COMPUTE_MS.get(bsym.sym.name, 0.0))
    assert dependence_bound_ms(trace, cost_model) == pytest.approx(5.0)  # the compute alone
