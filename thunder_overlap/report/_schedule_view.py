"""Reading a final execution trace back: a compact picture of its schedule and its figures."""

from __future__ import annotations

from dataclasses import dataclass

from thunder.core.trace import TraceCtx

from thunder_overlap._analysis.classify import CollectiveKind, NodeKind, classify_trace, is_expensive
from thunder_overlap._analysis.cost_model import CostModel, default_cost_model
from thunder_overlap._analysis.layout import NO_BUCKETS, BucketLayouts
from thunder_overlap._analysis.simulator import simulate

__all__ = ["ScheduleStats", "default_cost_model", "schedule_picture", "schedule_stats"]

_COLLECTIVE_LABELS = {CollectiveKind.ALL_GATHER: "AG", CollectiveKind.REDUCE_SCATTER: "RS", CollectiveKind.ALL_REDUCE: "AR"}


def schedule_picture(trace: TraceCtx) -> str:
    """One token per event: ``AG``/``RS`` issue, ``W`` wait, ``mm`` a matmul-like op, ``c`` a run
    of other compute ops; ``AGx25`` is 25 ``AG`` in a row. Prologue and epilogue ops are folded
    into their collective."""
    annotated = classify_trace(trace, roles_only=True)
    tokens: list[str] = []
    for node in annotated.nodes:
        if node.kind is NodeKind.COLLECTIVE:
            tokens.append(_COLLECTIVE_LABELS[annotated.collectives[node.collective].kind])
        elif node.kind is NodeKind.WAIT:
            tokens.append("W")
        elif node.kind is NodeKind.COMPUTE:
            token = "mm" if is_expensive(node.bsym) else "c"
            if token == "c" and tokens and tokens[-1] == "c":
                continue
            tokens.append(token)
    runs: list[list] = []
    for token in tokens:
        if runs and runs[-1][0] == token:
            runs[-1][1] += 1
        else:
            runs.append([token, 1])
    return " ".join(token if count == 1 else f"{token}x{count}" for token, count in runs)


@dataclass(frozen=True)
class ScheduleStats:
    """Overlap and in-flight figures of one execution trace, as it will run.

    *Overlapped* means hidden in the one sense of :mod:`thunder_overlap._analysis.overlap`: the
    rank computes, not waits, for the collective's whole run, i.e. the compute between its issue
    and its wait covers its estimated time; judged with the cost model ``schedule_stats`` got.
    """

    allgathers: int
    # All-gathers whose estimated time the compute between issue and wait covers.
    allgathers_overlapped: int
    reduce_scatters: int
    # Reduce-scatters whose estimated time the compute between issue and wait covers.
    reduce_scatters_overlapped: int
    # Largest sum of all-gather output bytes issued but not yet waited on.
    peak_allgather_bytes_in_flight: int
    max_allgathers_in_flight: int
    # Largest sum of reduce-scatter input bytes issued but not yet waited on.
    peak_reduce_scatter_bytes_in_flight: int
    # Launches that carry several of the collectives counted above (scheduling/launches.py).
    coalesced_launches: int = 0
    # Hybrid sharding's all-reduces across replicas; those whose estimated time the compute
    # between issue and wait covers; and those with any compute op between issue and wait.
    all_reduces: int = 0
    all_reduces_overlapped: int = 0
    all_reduces_beside_compute: int = 0

    @property
    def allgather_overlap_fraction(self) -> float:
        return self.allgathers_overlapped / self.allgathers if self.allgathers else 1.0

    @property
    def reduce_scatter_overlap_fraction(self) -> float:
        return self.reduce_scatters_overlapped / self.reduce_scatters if self.reduce_scatters else 1.0


def schedule_stats(trace: TraceCtx, cost_model: CostModel | None = None, *, layouts: BucketLayouts = NO_BUCKETS) -> ScheduleStats:
    """Overlap counts (hidden collectives, judged by simulating the trace's order with
    ``cost_model``; default :func:`default_cost_model`) and in-flight figures, which follow the
    trace order. A bucketed trace needs its buckets' ``layouts`` (``BucketingTransform.of(model).layouts``)."""
    annotated = classify_trace(trace, layouts)
    nodes = annotated.nodes
    cost_model = cost_model if cost_model is not None else default_cost_model(annotated)
    simulation = simulate(annotated, list(range(len(nodes))), cost_model)

    counts = {kind: [0, 0] for kind in CollectiveKind}
    for coll, timing in zip(annotated.collectives, simulation.collectives, strict=True):
        if coll.kind in counts:
            # Collectives, not launches: a coalesced launch counts each of its members.
            counts[coll.kind][0] += coll.members
            counts[coll.kind][1] += coll.members * timing.hidden

    in_flight: dict[int, int] = {}
    peaks = {CollectiveKind.ALL_GATHER: 0, CollectiveKind.REDUCE_SCATTER: 0}
    max_allgathers = 0
    for node in nodes:
        if node.collective is None or node.kind not in (NodeKind.COLLECTIVE, NodeKind.WAIT):
            continue
        coll = annotated.collectives[node.collective]
        if coll.kind not in peaks:
            continue
        if node.kind is NodeKind.COLLECTIVE:
            in_flight[node.collective] = coll.unsharded_bytes
        else:
            in_flight.pop(node.collective, None)
        for kind in peaks:
            live = [c for c in in_flight if annotated.collectives[c].kind is kind]
            peaks[kind] = max(peaks[kind], sum(in_flight[c] for c in live))
            if kind is CollectiveKind.ALL_GATHER:
                max_allgathers = max(max_allgathers, sum(annotated.collectives[c].members for c in live))
    return ScheduleStats(
        allgathers=counts[CollectiveKind.ALL_GATHER][0],
        allgathers_overlapped=counts[CollectiveKind.ALL_GATHER][1],
        reduce_scatters=counts[CollectiveKind.REDUCE_SCATTER][0],
        reduce_scatters_overlapped=counts[CollectiveKind.REDUCE_SCATTER][1],
        peak_allgather_bytes_in_flight=peaks[CollectiveKind.ALL_GATHER],
        max_allgathers_in_flight=max_allgathers,
        peak_reduce_scatter_bytes_in_flight=peaks[CollectiveKind.REDUCE_SCATTER],
        coalesced_launches=sum(c.members > 1 for c in annotated.collectives),
        all_reduces=counts[CollectiveKind.ALL_REDUCE][0],
        all_reduces_overlapped=counts[CollectiveKind.ALL_REDUCE][1],
        all_reduces_beside_compute=_beside_compute(annotated, CollectiveKind.ALL_REDUCE),
    )


def _beside_compute(annotated, kind: CollectiveKind) -> int:
    """Collectives of ``kind`` with at least one compute op between their issue and their wait."""
    compute_before = [0]
    for node in annotated.nodes:
        compute_before.append(compute_before[-1] + (node.kind is NodeKind.COMPUTE))
    return sum(
        c.wait is not None and compute_before[c.wait] > compute_before[c.start + 1]
        for c in annotated.collectives
        if c.kind is kind
    )
