"""The measuring stick: predicted step time, overlap and memory of a model's FSDP traces.

``thunder_overlap.report(jm)`` simulates three pairs of forward and backward execution traces
with one :class:`CostModel` and estimates their memory:

- ``thunder 0.2.6`` (the baseline): what Thunder's own ``thunder.distributed.fsdp`` produces for
  the same model, world size and sharding type (:mod:`~thunder_overlap.report._thunder_baseline`):
  one collective per parameter, and for ZeRO3 no re-gather in backward, as Thunder runs it;
- ``unscheduled``: thunder_overlap's traces just before its scheduling pass (ZeRO3 re-gathers,
  buckets), in Thunder's order, taken from the trace history Thunder keeps
  (``thunder.last_traces``): the newest trace whose provenance is not one of thunder_overlap's
  ``... schedule`` passes. It is what the ``stock`` policy runs. Re-deriving it from the final
  trace would need to undo the scheduler, which keeps no inverse;
- ``thunder_overlap``: the traces as they run.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import thunder
from thunder.core.trace import TraceCtx

from thunder_overlap._analysis.classify import AnnotatedTrace, NodeKind, classify_trace
from thunder_overlap._analysis.cost_model import CostModel
from thunder_overlap._analysis.memory_estimate import MemoryEstimate, estimate_memory
from thunder_overlap._analysis.simulator import Simulation, simulate
from thunder_overlap.report._thunder_baseline import THUNDER_LABEL, ThunderFSDPTraces, thunder_fsdp_baseline

__all__ = [
    "BASELINE",
    "LEGEND",
    "GroupNetwork",
    "ORDERS",
    "OVERLAP",
    "UNSCHEDULED",
    "OrderReport",
    "PassReport",
    "PassTraces",
    "Report",
    "analyze_trace",
    "report",
    "report_traces",
    "speed_change",
    "unscheduled_trace",
]

# The three orders of a report, by the labels its rows carry.
BASELINE = THUNDER_LABEL
UNSCHEDULED = "unscheduled"
OVERLAP = "thunder_overlap"
ORDERS = (BASELINE, UNSCHEDULED, OVERLAP)
_MIB = 2**20
_SCHEDULE_PROVENANCE = ("thunder_overlap:", "schedule")
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
    name: str  # "forward" or "backward"
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


@dataclass(frozen=True)
class Report:
    """Forward and backward in Thunder's FSDP, unscheduled and thunder_overlap. ``str()`` is a table."""

    passes: tuple[PassReport, ...]
    device: str
    network: str
    world_size: int
    # Why this device profile and network (printed after them); empty when a cost model was given.
    profile_reason: str = ""
    # Each process group and the network its collectives were costed on.
    groups: tuple[GroupNetwork, ...] = ()

    def __getitem__(self, name: str) -> PassReport:
        for p in self.passes:
            if p.name == name:
                return p
        raise KeyError(f"no pass {name!r}; this report has {[p.name for p in self.passes]}")

    def step_ms(self, order: str) -> float:
        return sum(p.order(order).predicted_ms for p in self.passes)

    def __str__(self) -> str:
        head = (
            f"{'pass':<9} {'order':<16} {'colls':>6} {'hideable':>8} {'hidden':>6} {'exposed ms':>10} "
            f"{'predicted ms':>12} {'bound ms':>9} {'peak MiB':>10}"
        )
        why = f" ({self.profile_reason})" if self.profile_reason else ""
        lines = [f"world size {self.world_size}, device {self.device}, network {self.network}{why}"]
        if self.groups:
            lines.append(f"process groups: {'; '.join(str(g) for g in self.groups)}")
        lines += [head, "-" * len(head)]
        for p in self.passes:
            for r in p.orders:
                lines.append(
                    f"{p.name:<9} {r.order:<16} {r.collectives:>6} {r.hideable:>8} {r.hidden:>6} {r.exposed_ms:>10.3f} "
                    f"{r.predicted_ms:>12.3f} {r.bound_ms:>9.3f} {r.peak_bytes / _MIB:>10.1f}"
                )
        for p in self.passes:
            lines.append(
                f"{p.name}: {OVERLAP} hides {p.overlap.hidden} of {p.overlap.hideable} potentially hideable collectives "
                f"({BASELINE}: {p.baseline.hidden} of {p.baseline.hideable}, "
                f"{UNSCHEDULED}: {p.unscheduled.hidden} of {p.unscheduled.hideable})"
            )
        steps = ", ".join(f"{order} {self.step_ms(order):.3f} ms" for order in ORDERS)
        verdict = speed_change(self.step_ms(BASELINE), self.step_ms(OVERLAP))
        lines.append(f"predicted step (forward + backward): {steps}: {OVERLAP} against {BASELINE}: {verdict}")
        return "\n".join([*lines, "", LEGEND])

    def to_json(self, path: str | Path | None = None) -> dict:
        """Scalars per pass and order, and each collective's timing; written to ``path`` if given."""
        data = {
            "device": self.device,
            "network": self.network,
            "world_size": self.world_size,
            "profile_reason": self.profile_reason,
            "groups": [asdict(g) for g in self.groups],
            "step_ms": {order: self.step_ms(order) for order in ORDERS},
            "passes": {
                p.name: {
                    r.order: {
                        **r.summary(),
                        "collective_timings": [
                            {
                                "kind": c.kind,
                                "bytes": c.unsharded_bytes,
                                "start_ms": c.start_ms,
                                "end_ms": c.end_ms,
                                "exposed_ms": c.exposed_ms,
                                "hideable": c.potentially_hideable,
                            }
                            for c in r.simulation.collectives
                        ],
                    }
                    for r in p.orders
                }
                for p in self.passes
            },
        }
        if path is not None:
            Path(path).write_text(json.dumps(data, indent=1))
        return data

    def to_chrome_trace(self, path: str | Path) -> None:
        """A Chrome trace (Perfetto, chrome://tracing): one process per order, one track per
        stream, memory as a counter track."""
        from thunder_overlap.report._plots import write_chrome_trace

        write_chrome_trace(self, Path(path))

    def to_png(self, path: str | Path) -> None:
        """Timeline and memory curve of each order, forward then backward (needs matplotlib)."""
        from thunder_overlap.report._plots import write_png

        write_png(self, Path(path))


def analyze_trace(trace: TraceCtx, cost_model: CostModel, *, order: str, after: MemoryEstimate | None = None) -> OrderReport:
    """Simulates and estimates one execution trace in the order it is written."""
    annotated = classify_trace(trace)
    simulation = simulate(annotated, list(range(len(annotated.nodes))), cost_model)
    memory = estimate_memory(trace, after=after)
    # Collectives, not launches: each member of a coalesced launch counts, as hidden as its launch.
    members = [(c.members, t) for c, t in zip(annotated.collectives, simulation.collectives, strict=True)]
    return OrderReport(
        order=order,
        collectives=sum(m for m, _ in members),
        hideable=sum(m for m, t in members if t.potentially_hideable),
        hidden=sum(m for m, t in members if t.potentially_hideable and t.hidden),
        exposed_ms=simulation.exposed_ms,
        predicted_ms=simulation.step_ms,
        bound_ms=simulation.bound_ms,
        compute_ms=simulation.compute_ms,
        communication_ms=simulation.communication_ms,
        peak_bytes=memory.peak_bytes,
        trace=trace,
        annotated=annotated,
        simulation=simulation,
        memory=memory,
    )


def unscheduled_trace(history: list[TraceCtx]) -> TraceCtx:
    """The newest trace of ``history`` that thunder_overlap's scheduler did not produce."""
    for trace in reversed(history):
        provenance = str(trace.get_provenance() or "")
        if not all(word in provenance for word in _SCHEDULE_PROVENANCE):
            return trace
    raise ValueError("every trace in the history comes from thunder_overlap's scheduler; no baseline to compare with")


def report_traces(
    forward: PassTraces, backward: PassTraces | None, cost_model: CostModel, profile_reason: str = "", world_size: int | None = None
) -> Report:
    """A report from the forward and backward execution traces in the three orders; its world
    size is ``world_size``, or the size of the first process group of thunder_overlap's traces."""
    passes = []
    forward_memory: dict[str, MemoryEstimate] = {}
    for name, traces in (("forward", forward), ("backward", backward)):
        if traces is None:
            continue
        reports = []
        for order, trace in traces.by_order().items():
            r = analyze_trace(trace, cost_model, order=order, after=forward_memory.get(order))
            if name == "forward":
                forward_memory[order] = r.memory
            reports.append(r)
        passes.append(PassReport(name, *reports))
    if world_size is None:
        groups = (c.process_group for p in passes for c in p.overlap.annotated.collectives if c.process_group is not None)
        world_size = next((g.size() for g in groups), 1)
    groups = group_networks([p.order(order) for order in (OVERLAP, UNSCHEDULED, BASELINE) for p in passes], cost_model)
    return Report(tuple(passes), cost_model.device.name, cost_model.network.name, world_size, profile_reason, groups)


def report(
    jm,
    *,
    cost_model: CostModel | None = None,
    device_profile: str | None = None,
    network: str | None = None,
    thunder_fsdp: ThunderFSDPTraces | None = None,
) -> Report:
    """Report for the last forward and backward traces of ``jm`` (run or traced once first).

    Args:
        jm: a module returned by :func:`thunder_overlap.fsdp` (or any ``thunder.jit`` module).
        cost_model: how long ops and collectives take; wins over the two names below.
        device_profile: a name from ``cost_model.DEVICE_PROFILES`` (h100, h200, a100, cpu);
            default: the profile of the device ``jm``'s parameters are on.
        network: a name from ``cost_model.NETWORK_PROFILES`` or ``custom:<latency_us>:<GB/s>[:ring|tree[:<concurrent launches>]]``;
            default: from the backend and size of the process group of ``jm``'s collectives
            (gloo: gloo-loopback; otherwise NVLink within a node, InfiniBand across nodes).
        thunder_fsdp: Thunder's own FSDP traces of the same model (the baseline); default:
            :func:`~thunder_overlap.report._thunder_baseline.thunder_fsdp_baseline` (which traces
            them, seconds per transformer layer).
    """
    forward = thunder.last_traces(jm)
    if not forward:
        raise ValueError("the module has not been run or traced yet: call it once (or trace it) before report()")
    backward = thunder.last_backward_traces(jm)
    reason = ""
    if cost_model is None:
        from thunder_overlap.report._device_choice import choose_profile

        finals = [classify_trace(forward[-1])] + ([classify_trace(backward[-1])] if backward else [])
        choice = choose_profile(jm, finals, device_profile=device_profile, network=network)
        cost_model, reason = choice.cost_model(), choice.reason
    if thunder_fsdp is None:
        thunder_fsdp = thunder_fsdp_baseline(jm)
    if (thunder_fsdp.backward is None) != (not backward):
        raise ValueError("Thunder's FSDP traces and the module's must both have a backward, or neither")
    return report_traces(
        PassTraces(thunder_fsdp.forward, unscheduled_trace(forward), forward[-1]),
        PassTraces(thunder_fsdp.backward, unscheduled_trace(backward), backward[-1]) if backward else None,
        cost_model,
        reason,
        world_size=thunder_fsdp.world_size,
    )
