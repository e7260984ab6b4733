"""Coalesced launches: collectives the scheduler issues together go out as one launch.

Every launch pays the network's latency once, however little it moves; collectives launched as
one group (``torch.distributed._coalescing_manager``, one ``ncclGroupStart/End`` on NCCL) share
it. After scheduling, :func:`plan_launches` finds *runs*: collectives of the same kind, process
group and dtype (``Collective.bucket_key``) issued one after the other with nothing but their
own prologues in between, so they are consecutive in their group's issue order. It grows a launch
along a run while coalescing does not make the rank wait longer, judged on one simulation of the
uncoalesced order: the coalesced launch (one latency plus every member's transfer, from the first
member's start) is waited on where the first member was, so the compute stream stalls there until
it ends; launched one by one, the members stalled the stream for their exposed times. A latency
saved where it was hidden anyway is worth nothing, so merging a hidden member into an exposed
launch, which would expose its transfer, is refused. Ties coalesce: fewer launches free the
process group's stream sooner for what follows.

:func:`apply_launches` rewrites the trace: one coalesced issue operator where the launch issues,
one ``coalesced_wait`` at the earliest member wait, which returns every member's outputs under
their old names. A launch issues at its first member's point for all-gathers (their inputs are
trace inputs) and at its last member's point for anything else (its inputs are computed): on a
retrace, an agreed launch is reproduced this way however the new schedule spread its members.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from thunder.core.proxies import FutureTensorProxy, TensorProxy
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx, tracectx

from thunder_overlap import _ops as ops
from thunder_overlap._analysis.classify import AnnotatedTrace, Collective, CollectiveKind, NodeKind
from thunder_overlap._analysis.cost_model import CostModel
from thunder_overlap._analysis.simulator import simulate
from thunder_overlap._scheduling.orders import apply_order, trace_of_bound_symbols

__all__ = ["LaunchGroup", "apply_launches", "candidate_runs", "plan_launches"]

logger = logging.getLogger(__name__)



@dataclass(frozen=True)
class LaunchGroup:
    """Collectives (indices into ``AnnotatedTrace.collectives``, in issue order) launched as one."""

    members: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.members) < 2:
            raise ValueError(f"a coalesced launch needs at least two members, got {self.members}")


def _flavour(annotated: AnnotatedTrace, c: int) -> str | None:
    """``"bucket"`` or ``"plain"`` for a collective a coalesced launch can take in, else None."""
    coll = annotated.collectives[c]
    if coll.kind is CollectiveKind.ALL_REDUCE or coll.wait is None or coll.members != 1 or coll.process_group is None:
        return None
    # Members' issue operators a coalesced launch can take in, by how they lay out their arguments.
    op = annotated.nodes[coll.start].bsym.sym.id
    if op in ops.BUCKET_ISSUES:
        return "bucket"
    return "plain" if op in ops.PLAIN_ISSUES else None


def _run_key(annotated: AnnotatedTrace, c: int) -> tuple | None:
    flavour = _flavour(annotated, c)
    if flavour is None:
        return None
    coll = annotated.collectives[c]
    start = annotated.nodes[coll.start].bsym
    # One reduce operator per launch (the coalescing manager takes the first member's).
    reduce_op = start.args[1] if flavour == "plain" and coll.kind is CollectiveKind.REDUCE_SCATTER else None
    return coll.bucket_key, flavour, reduce_op


def candidate_runs(annotated: AnnotatedTrace, order: list[int]) -> list[list[int]]:
    """Runs of two or more collectives that ``order`` issues back to back (only prologues between)
    and that one launch could carry: same kind, process group, dtype, and operator layout."""
    runs: list[list[int]] = []
    current: list[int] = []
    current_key = None
    for index in order:
        node = annotated.nodes[index]
        if node.kind is NodeKind.PROLOGUE:
            continue  # it travels with its collective
        key = _run_key(annotated, node.collective) if node.kind is NodeKind.COLLECTIVE else None
        if key is None or key != current_key:
            if len(current) > 1:
                runs.append(current)
            current, current_key = [], key
        if key is not None:
            current.append(node.collective)
    if len(current) > 1:
        runs.append(current)
    return runs


def plan_launches(annotated: AnnotatedTrace, order: list[int], cost_model: CostModel) -> list[LaunchGroup]:
    """The coalesced launches worth making in ``order`` (see the module docstring), in issue order."""
    runs = candidate_runs(annotated, order)
    if not runs:
        return []
    timings = simulate(annotated, order, cost_model).collectives
    groups: list[LaunchGroup] = []
    for run in runs:
        first_collective = annotated.collectives[run[0]]
        # A run shares kind and group: one network (its group's, under a node topology).
        latency = cost_model.latency_ms(first_collective.process_group.size(), cost_model.network_for(first_collective))
        members = [run[0]]
        for c in run[1:]:
            first = timings[members[0]]
            transfers = sum(_transfer_ms(cost_model, annotated.collectives[m], latency) for m in (*members, c))
            coalesced_stall = max(0.0, first.start_ms + latency + transfers - first.wait_ms)
            separate_stall = sum(timings[m].exposed_ms for m in (*members, c))
            if coalesced_stall <= separate_stall:
                members.append(c)
                continue
            if len(members) > 1:
                groups.append(LaunchGroup(tuple(members)))
            members = [c]
        if len(members) > 1:
            groups.append(LaunchGroup(tuple(members)))
    return groups


def _transfer_ms(cost_model: CostModel, coll: Collective, latency_ms: float) -> float:
    # Its own time less the latency: a measured estimate (collective_estimate) includes one.
    return max(0.0, cost_model.collective_ms(coll) - latency_ms)


def apply_launches(annotated: AnnotatedTrace, order: list[int], launches: list[LaunchGroup], *, provenance: str) -> TraceCtx:
    """The execution trace of ``order`` with each launch's members issued and waited on as one
    (deletions regenerated). Raises ValueError if a member's output is read before the launch's
    wait can be placed, which only a hand-made or mismatched ``launches`` can cause."""
    if not launches:
        return apply_order(annotated, order, provenance=provenance)
    nodes = annotated.nodes
    position = {index: i for i, index in enumerate(order)}
    before: dict[int, list[BoundSymbol]] = {}  # position -> bound symbols emitted before its node
    after: dict[int, list[BoundSymbol]] = {}
    taken: set[int] = set()  # nodes that a launch emits instead of their own position
    for launch in launches:
        colls = [annotated.collectives[c] for c in launch.members]
        starts = [position[c.start] for c in colls]
        point = min(starts) if colls[0].kind is CollectiveKind.ALL_GATHER else max(starts)
        issue, wait = _coalesced_bound_symbols(annotated, launch)
        moved_prologues = sorted((p for c in colls for p in c.prologue if position[p] > point), key=position.get)
        before.setdefault(point, []).extend([nodes[p].bsym for p in moved_prologues] + [issue])
        first_wait = min(position[c.wait] for c in colls)
        if first_wait > point:
            before.setdefault(first_wait, []).append(wait)
        else:  # a member was waited on before the last one issued: wait right after the launch
            after.setdefault(point, []).append(wait)
        taken.update(moved_prologues)
        taken.update(n for c in colls for n in (c.start, c.wait))

    bsyms: list[BoundSymbol] = []
    for i, index in enumerate(order):
        bsyms.extend(before.get(i, ()))
        if index not in taken:
            bsyms.append(nodes[index].bsym)
        bsyms.extend(after.get(i, ()))
    _check_defined_before_use(bsyms)
    return trace_of_bound_symbols(annotated.trace, bsyms, provenance=provenance)


def _coalesced_bound_symbols(annotated: AnnotatedTrace, launch: LaunchGroup) -> tuple[BoundSymbol, BoundSymbol]:
    """The issue and the wait of ``launch``; the wait's outputs are the members' wait outputs."""
    colls = [annotated.collectives[c] for c in launch.members]
    starts = [annotated.nodes[c.start].bsym for c in colls]
    waits = [annotated.nodes[c.wait].bsym for c in colls]
    group = colls[0].process_group
    gather = colls[0].kind is CollectiveKind.ALL_GATHER
    if _flavour(annotated, launch.members[0]) == "bucket":
        # bucket_all_gather(bucket, group, shards, slots) / bucket_reduce_scatter(bucket, group, grads, divisor);
        # their waits (pending, bucket, slots).
        members = tuple((s.args[0], s.args[3], w.args[2]) for s, w in zip(starts, waits, strict=True))
        inputs = [list(s.args[2]) for s in starts]
        op = ops.coalesced_bucket_all_gather if gather else ops.coalesced_bucket_reduce_scatter
        extra: tuple = ()
    else:
        # all_gather(a, group, do_async, dim) / reduce_scatter(a, op, group, do_async, dim)
        dim_position = 3 if gather else 4
        members = tuple(_argument(s, dim_position, "dim") for s in starts)
        inputs = [s.args[0] for s in starts]
        op = ops.coalesced_all_gather if gather else ops.coalesced_reduce_scatter
        extra = () if gather else (starts[0].args[1],)
    outputs = tuple(o for w in waits for o in w.flat_proxy_outs if isinstance(o, TensorProxy))
    # As the operators' metas shape it: every member's future, back to back, in their dtype (a
    # bucket's gather dtype may not be its shards').
    numel = sum(ops.numel(s.flat_proxy_outs[0]) for s in starts)
    with tracectx(annotated.trace):
        future = FutureTensorProxy(shape=(numel,), like=starts[0].flat_proxy_outs[0])
    issue = op.bind(group, members, inputs, *extra, output=future)
    shapes = tuple(tuple(int(s) for s in o.shape) for o in outputs)
    return issue, ops.coalesced_wait.bind(future, shapes, output=outputs)


def _argument(bsym: BoundSymbol, position: int, name: str):
    if name in bsym.kwargs:
        return bsym.kwargs[name]
    return bsym.args[position] if len(bsym.args) > position else None


def _check_defined_before_use(bsyms: list[BoundSymbol]) -> None:
    produced = {o.name for b in bsyms for o in b.flat_proxy_outs}
    defined: set[str] = set()
    for b in bsyms:
        own = {o.name for o in b.flat_proxy_outs}  # an op may write into its input under the same name
        for a in b.flat_proxy_args:
            if a.name in produced and a.name not in defined and a.name not in own:
                raise ValueError(f"coalescing would read {a.name} in {b.sym.name} before it is computed")
        defined.update(o.name for o in b.flat_proxy_outs)
