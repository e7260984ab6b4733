"""The measuring stick: predicted step time, overlap and memory of a model's FSDP traces.

``thunder_overlap.report(jm)`` simulates three pairs of forward and backward execution traces
with one :class:`CostModel` and estimates their memory:

- ``thunder 0.2.6`` (the baseline): what Thunder's own ``thunder.distributed.fsdp`` produces for
  the same model, world size and sharding type (:mod:`~thunder_overlap.report._thunder_baseline`):
  one collective per parameter, and for ZeRO3 no re-gather in backward, as Thunder runs it;
- ``unscheduled``: thunder_overlap's traces just before its scheduling pass (ZeRO3 re-gathers,
  buckets), in Thunder's order, taken from the trace history Thunder keeps
  (``thunder.last_traces``): the newest trace the schedule transform did not return (the
  model's state records those it returned). It is what the ``stock``
  policy runs. Re-deriving it from the final trace would need to undo the scheduler, which
  keeps no inverse;
- ``thunder_overlap``: the traces as they run.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import thunder
from thunder.core import dtypes
from thunder.core.trace import TraceCtx

from thunder_overlap._analysis.bounds import dependence_bound_ms
from thunder_overlap._analysis.classify import classify_trace
from thunder_overlap._analysis.cost_model import CostModel
from thunder_overlap._analysis.layout import NO_BUCKETS, BucketLayouts
from thunder_overlap._analysis.memory_estimate import MemoryEstimate, estimate_memory
from thunder_overlap._analysis.passes import Pass
from thunder_overlap._analysis.simulator import Simulation, simulate
from thunder_overlap._scheduling.unsharding import UnshardingChoice
from thunder_overlap._transforms.bucketing import BucketingTransform
from thunder_overlap._transforms.schedule import OverlapScheduleTransform
from thunder_overlap._transforms.zero3 import Zero3Transform
from thunder_overlap.report._orders import (
    BASELINE,
    LEGEND,
    ORDERS,
    OVERLAP,
    UNSCHEDULED,
    GroupNetwork,
    OrderReport,
    PassReport,
    PassTraces,
    group_networks,
    speed_change,
)
from thunder_overlap.report._thunder_baseline import ThunderFSDPTraces, thunder_fsdp_baseline

_MIB = 2**20

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
    "longest_waits",
    "module_layouts",
    "report",
    "report_traces",
    "speed_change",
    "unscheduled_trace",
]

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
    # What thunder_overlap's collectives move, by kind: ("all_gather", ("bfloat16",)), ...
    collective_dtypes: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # ZeRO3's or sharding "auto"'s choice of the units kept unsharded to the backward (else None).
    unsharding: UnshardingChoice | None = None
    # Bytes of this rank's trainable parameter shards: what optimizer state is sized by (None: unknown).
    trainable_shard_bytes: int | None = None

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
            f"{'predicted ms':>12} {'bound ms':>9} {'dep. bound':>10} {'peak MiB':>10}"
        )
        why = f" ({self.profile_reason})" if self.profile_reason else ""
        lines = [f"world size {self.world_size}, device {self.device}, network {self.network}{why}"]
        if self.groups:
            lines.append(f"process groups: {'; '.join(str(g) for g in self.groups)}")
        if self.collective_dtypes:
            moved = ", ".join(f"{kind.replace('_', '-')}s {' and '.join(names)}" for kind, names in self.collective_dtypes)
            lines.append(f"{OVERLAP} collectives move: {moved}")
        lines += [head, "-" * len(head)]
        for p in self.passes:
            for r in p.orders:
                lines.append(
                    f"{p.name:<9} {r.order:<16} {r.collectives:>6} {r.hideable:>8} {r.hidden:>6} {r.exposed_ms:>10.3f} "
                    f"{r.predicted_ms:>12.3f} {r.bound_ms:>9.3f} {r.dependence_bound_ms:>10.3f} {r.peak_bytes / _MIB:>10.1f}"
                )
        for p in self.passes:
            lines.append(
                f"{p.name}: {OVERLAP} hides {p.overlap.hidden} of {p.overlap.hideable} potentially hideable collectives "
                f"({BASELINE}: {p.baseline.hidden} of {p.baseline.hideable}, "
                f"{UNSCHEDULED}: {p.unscheduled.hidden} of {p.unscheduled.hideable})"
            )
            lines.append(longest_waits(p.name, p.overlap.simulation))
        if self.unsharding is not None:
            lines.append(f"sharding {self.unsharding.sharding}: {self.unsharding.describe()}")
        if self.trainable_shard_bytes is not None:
            # What the peaks, and so a memory budget, leave out (docs/memory.md, "The budget").
            lines.append(
                "peak MiB: what the step's traces hold (parameter shards, batch, activations, gathered parameters, gradients, "
                f"buckets); not optimizer state (AdamW's: {2 * self.trainable_shard_bytes / _MIB:.1f} MiB a rank, twice the "
                "trainable shards), the loss computed outside the model or the allocator's slack"
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
            "collective_dtypes": {kind: list(names) for kind, names in self.collective_dtypes},
            "step_ms": {order: self.step_ms(order) for order in ORDERS},
            "unsharding": asdict(self.unsharding) if self.unsharding is not None else None,
            "trainable_shard_bytes": self.trainable_shard_bytes,
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


# Collectives named per pass where the compute waits longest: where a step loses its time to
# communication is mostly a few launches (the first gather, the last reduce-scatters).
_LONGEST_WAITS = 3


def longest_waits(pass_name: str, simulation: Simulation) -> str:
    """One line: how long thunder_overlap's compute stands waiting in ``simulation``, and at which
    launches most (kind, position among the pass's launches, a coalesced one counting once;
    unsharded MiB), in trace order."""
    waits = sorted((c for c in simulation.collectives if c.exposed_ms > 0), key=lambda c: -c.exposed_ms)[:_LONGEST_WAITS]
    if not waits:
        return f"{pass_name}: {OVERLAP}'s compute never waits for a collective"
    count = len(simulation.collectives)
    named = "; ".join(
        f"{c.kind.replace('_', '-')} launch {c.collective + 1} of {count} ({c.unsharded_bytes / _MIB:.1f} MiB) {c.exposed_ms:.3f} ms"
        for c in sorted(waits, key=lambda c: c.collective)
    )
    return f"{pass_name}: {OVERLAP}'s compute waits {simulation.exposed_ms:.3f} ms for collectives, longest at: {named}"


def analyze_trace(
    trace: TraceCtx, cost_model: CostModel, *, order: str, after: MemoryEstimate | None = None, layouts: BucketLayouts = NO_BUCKETS
) -> OrderReport:
    """Simulates and estimates one execution trace in the order it is written (``layouts``: its
    buckets', as :func:`module_layouts` gives them)."""
    annotated = classify_trace(trace, layouts)
    simulation = simulate(annotated, list(range(len(annotated.nodes))), cost_model)
    memory = estimate_memory(trace, layouts=layouts, after=after)
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
        dependence_bound_ms=max(simulation.bound_ms, dependence_bound_ms(annotated, cost_model)),
        compute_ms=simulation.compute_ms,
        communication_ms=simulation.communication_ms,
        peak_bytes=memory.peak_bytes,
        trace=trace,
        annotated=annotated,
        simulation=simulation,
        memory=memory,
    )


def module_layouts(jm) -> BucketLayouts:
    """The layouts of ``jm``'s buckets, which analysis of its bucketed traces needs (none
    without buckets)."""
    bucketing = BucketingTransform.of(jm)
    return bucketing.layouts if bucketing is not None else NO_BUCKETS


def unscheduled_trace(jm, history: list[TraceCtx]) -> TraceCtx:
    """The newest trace of ``jm``'s ``history`` that thunder_overlap's scheduler did not produce."""
    schedule = OverlapScheduleTransform.of(jm)
    scheduled = schedule.state.scheduled if schedule is not None else ()
    for trace in reversed(history):
        if trace not in scheduled:
            return trace
    raise ValueError("every trace in the history comes from thunder_overlap's scheduler; no baseline to compare with")


def report_traces(
    forward: PassTraces,
    backward: PassTraces | None,
    cost_model: CostModel,
    profile_reason: str = "",
    world_size: int | None = None,
    layouts: BucketLayouts = NO_BUCKETS,
) -> Report:
    """A report from the forward and backward execution traces in the three orders; its world
    size is ``world_size``, or the size of the first process group of thunder_overlap's traces;
    ``layouts`` those of the buckets thunder_overlap's traces run."""
    passes = []
    forward_memory: dict[str, MemoryEstimate] = {}
    for name, traces in ((Pass.FORWARD, forward), (Pass.BACKWARD, backward)):
        if traces is None:
            continue
        reports = []
        for order, trace in traces.by_order().items():
            # Thunder's own traces run none of thunder_overlap's buckets, nor hold their buffers.
            own_layouts = NO_BUCKETS if order == BASELINE else layouts
            r = analyze_trace(trace, cost_model, order=order, after=forward_memory.get(order), layouts=own_layouts)
            if name is Pass.FORWARD:
                forward_memory[order] = r.memory
            reports.append(r)
        passes.append(PassReport(name, *reports))
    if world_size is None:
        groups = (p.overlap.annotated.process_group for p in passes)
        world_size = next((g.size() for g in groups if g is not None), 1)
    groups = group_networks([p.order(order) for order in (OVERLAP, UNSCHEDULED, BASELINE) for p in passes], cost_model)
    dtypes = _collective_dtypes([p.overlap for p in passes])
    return Report(tuple(passes), cost_model.device.name, cost_model.network.name, world_size, profile_reason, groups, dtypes)


def _collective_dtypes(reports: list[OrderReport]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The dtypes each kind of collective moves in these orders' traces (mixed precision shows
    here: bfloat16 all-gathers, float32 reduce-scatters)."""
    moved: dict[str, set[str]] = {}
    for r in reports:
        for c in r.annotated.collectives:
            if c.dtype is not None:
                moved.setdefault(c.kind.value, set()).add(str(dtypes.to_torch_dtype(c.dtype)).removeprefix("torch."))
    return tuple((kind, tuple(sorted(names))) for kind, names in moved.items())


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

        layouts = module_layouts(jm)
        finals = [classify_trace(forward[-1], layouts)] + ([classify_trace(backward[-1], layouts)] if backward else [])
        choice = choose_profile(jm, finals, device_profile=device_profile, network=network)
        cost_model, reason = choice.cost_model(), choice.reason
    if thunder_fsdp is None:
        thunder_fsdp = thunder_fsdp_baseline(jm)
    if (thunder_fsdp.backward is None) != (not backward):
        raise ValueError("Thunder's FSDP traces and the module's must both have a backward, or neither")
    result = report_traces(
        PassTraces(thunder_fsdp.forward, unscheduled_trace(jm, forward), forward[-1]),
        PassTraces(thunder_fsdp.backward, unscheduled_trace(jm, backward), backward[-1]) if backward else None,
        cost_model,
        reason,
        world_size=thunder_fsdp.world_size,
        layouts=module_layouts(jm),
    )
    result = replace(result, trainable_shard_bytes=sum(p.numel() * p.element_size() for p in jm.parameters() if p.requires_grad))
    zero3 = Zero3Transform.of(jm)
    return result if zero3 is None or zero3.choice is None else replace(result, unsharding=zero3.choice)
