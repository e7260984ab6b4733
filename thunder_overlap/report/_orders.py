"""What a report holds: each execution trace in each order (:class:`OrderReport`), the three
orders of one pass (:class:`PassReport`), and the networks each process group ran on."""

from __future__ import annotations

from dataclasses import dataclass, field

from thunder.core.trace import TraceCtx

from thunder_overlap._analysis.classify import AnnotatedTrace, NodeKind
from thunder_overlap._analysis.cost_model import CostModel
from thunder_overlap._analysis.memory_estimate import MemoryEstimate
from thunder_overlap._analysis.passes import Pass
from thunder_overlap._analysis.simulator import Simulation
from thunder_overlap.report._thunder_baseline import THUNDER_LABEL

__all__ = [
    "BASELINE",
    "LEGEND",
    "ORDERS",
    "OVERLAP",
    "UNSCHEDULED",
    "GroupNetwork",
    "OrderReport",
    "PassReport",
    "PassTraces",
    "group_networks",
    "speed_change",
]

# The three orders of a report, by the labels its rows carry.
BASELINE = THUNDER_LABEL
UNSCHEDULED = "unscheduled"
OVERLAP = "thunder_overlap"
ORDERS = (BASELINE, UNSCHEDULED, OVERLAP)
_MIB = 2**20
_SHORT_KINDS = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR"}

LEGEND = f"""\
{BASELINE}: the traces Thunder's own FSDP produces for this model: one collective per parameter
  (its bucketing does nothing), and ZeRO3 run as ZeRO2 (no re-gather in backward). Thunder has no
  hybrid sharding: for a 2-D device mesh (replicate, shard) it shards over the whole world.
{UNSCHEDULED}: thunder_overlap's traces before its scheduling pass (ZeRO3 re-gathers, buckets), in
  Thunder's order.
hideable: collectives that some compute op neither feeds nor depends on: the most any order can hide.
hidden: collectives whose whole run the compute stream spends computing, not waiting: the compute
  between issue and wait covers their estimated time (thunder_overlap._analysis.overlap).
exposed ms: time the compute stream stands still waiting for communication.
predicted ms: the pass simulated on one compute stream and one communication stream per group,
  each on its group's network (process groups: which network each group's collectives use).
bound ms: max(compute, busiest communication stream): no order of these ops can be faster.
dep. bound: with the compute in its order, no faster than any set of one group's collectives
  after the compute the first needs and before the compute that needs the last (the first forward
  gather, the last backward reduce-scatters): what these buckets leave exposed wherever they go.
A collective's duration is its latency (latency x (ranks - 1) on a ring, x log2(ranks) on a tree)
  plus bytes / bandwidth. Each launch pays the latency; a coalesced launch of several tensors is one
  launch, so orders that coalesce differently differ in communication and bound ms.
A bucketed collective's local copies (lay-out and pre-average before its launch, copy-out after
  its wait) run on the compute stream at memory bandwidth."""


def speed_change(before_ms: float, after_ms: float) -> str:
    """``after_ms`` against ``before_ms`` in words: "1.52x faster (34% less time)"."""
    if after_ms <= 0 or before_ms <= 0:
        return "no time to compare"
    if after_ms < before_ms:
        return f"{before_ms / after_ms:.2f}x faster ({1 - after_ms / before_ms:.0%} less time)"
    if after_ms > before_ms:
        return f"{after_ms / before_ms:.2f}x slower ({after_ms / before_ms - 1:.0%} more time)"
    return "the same time"


@dataclass(frozen=True)
class OrderReport:
    """One execution trace in one order: its simulated time and its memory."""

    order: str
    collectives: int
    hideable: int
    hidden: int
    exposed_ms: float
    predicted_ms: float
    bound_ms: float
    dependence_bound_ms: float
    compute_ms: float
    communication_ms: float
    peak_bytes: int
    trace: TraceCtx = field(repr=False, compare=False)
    annotated: AnnotatedTrace = field(repr=False, compare=False)
    simulation: Simulation = field(repr=False, compare=False)
    memory: MemoryEstimate = field(repr=False, compare=False)

    def memory_after_node(self) -> list[int]:
        """Live bytes once each node (in trace order) and the ``del``s after it have run."""
        position = {id(b): i for i, b in enumerate(self.trace.bound_symbols)}
        starts = [position[id(n.bsym)] for n in self.annotated.nodes]
        ends = [*starts[1:], len(self.trace.bound_symbols)]
        return [self.memory.live_after[end - 1] for end in ends]

    def summary(self) -> dict:
        keys = (
            "order",
            "collectives",
            "hideable",
            "hidden",
            "exposed_ms",
            "predicted_ms",
            "bound_ms",
            "dependence_bound_ms",
            "compute_ms",
            "communication_ms",
            "peak_bytes",
        )
        return {k: getattr(self, k) for k in keys}


@dataclass(frozen=True)
class GroupNetwork:
    """One process group of the report's traces and the network its collectives are costed on."""

    ranks: int
    # Where its ranks lie ("in 1 node", "across 128 nodes"); empty without a node topology.
    placement: str
    kinds: tuple[str, ...]  # its collectives' kinds (all_gather, reduce_scatter, all_reduce)
    network: str
    orders: tuple[str, ...]  # the report's orders whose traces use it

    def __str__(self) -> str:
        where = f" {self.placement}" if self.placement else ""
        only = "" if OVERLAP in self.orders else f" [{', '.join(self.orders)}]"
        return f"{self.ranks} ranks{where} ({', '.join(self.kinds)}): {self.network}{only}"


def group_networks(reports: list[OrderReport], cost_model: CostModel) -> tuple[GroupNetwork, ...]:
    """The process groups of ``reports``' collectives, one entry per (size, placement, network),
    in order of first use."""
    found: dict[tuple, tuple[list[str], list[str]]] = {}
    for r in reports:
        for c, timing in zip(r.annotated.collectives, r.simulation.collectives, strict=True):
            group = c.process_group
            placement = cost_model.topology.placement(group) if cost_model.topology and group is not None else ""
            key = (group.size() if group is not None else 1, placement, cost_model.network_for(c).name)
            kinds, orders = found.setdefault(key, ([], []))
            if timing.kind not in kinds:
                kinds.append(timing.kind)
            if r.order not in orders:
                orders.append(r.order)
    return tuple(GroupNetwork(*key[:2], tuple(kinds), key[2], tuple(orders)) for key, (kinds, orders) in found.items())


@dataclass(frozen=True)
class PassTraces:
    """One pass's execution traces in the report's three orders."""

    baseline: TraceCtx  # Thunder's own FSDP
    unscheduled: TraceCtx  # thunder_overlap's, before scheduling
    overlap: TraceCtx  # thunder_overlap's, as it runs

    def by_order(self) -> dict[str, TraceCtx]:
        return dict(zip(ORDERS, (self.baseline, self.unscheduled, self.overlap), strict=True))


@dataclass(frozen=True)
class PassReport:
    name: Pass
    baseline: OrderReport  # Thunder's own FSDP
    unscheduled: OrderReport
    overlap: OrderReport

    @property
    def orders(self) -> tuple[OrderReport, ...]:
        return self.baseline, self.unscheduled, self.overlap

    def order(self, label: str) -> OrderReport:
        """The row of ``label`` (one of :data:`ORDERS`)."""
        for r in self.orders:
            if r.order == label:
                return r
        raise KeyError(f"no order {label!r}; a report has {list(ORDERS)}")

    def step_table(self, order: str = OVERLAP, max_rows: int | None = None) -> str:
        """A pipeline-schedule view: one row per op with the collectives in flight and memory."""
        chosen = self.order(order)
        sim, nodes = chosen.simulation, chosen.annotated.nodes
        memory = chosen.memory_after_node()
        rows = [f"{'step':>5} {'t ms':>9}  {'compute op':<28} {'comm in flight':<30} {'live MiB':>9}"]
        steps = [op for op in sim.ops if nodes[op.node].kind not in (NodeKind.HEADER, NodeKind.RETURN)]
        for step, op in enumerate(steps):
            if max_rows is not None and step >= max_rows:
                rows.append(f"... {len(steps) - max_rows} more steps")
                break
            node = nodes[op.node]
            # Issued and not finished: running, or queued behind earlier collectives of its group.
            in_flight = [f"{_SHORT_KINDS[c.kind]}{c.collective}" for c in sim.collectives if c.issue_ms <= op.start_ms < c.end_ms]
            if node.kind is NodeKind.WAIT:
                label = f"wait {_SHORT_KINDS[sim.collectives[node.collective].kind]}{node.collective}"
            elif node.kind is NodeKind.COLLECTIVE:
                label = f"issue {_SHORT_KINDS[sim.collectives[node.collective].kind]}{node.collective}"
            else:
                label = node.name
            flight = " ".join(in_flight[:6]) + (f" +{len(in_flight) - 6}" if len(in_flight) > 6 else "")
            rows.append(f"{step:>5} {op.start_ms:>9.4f}  {label[:28]:<28} {flight:<30} {memory[op.node] / _MIB:>9.2f}")
        return "\n".join(rows)
