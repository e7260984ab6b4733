"""Trace classification: what each bound symbol of an execution trace is, for scheduling.

A Thunder execution trace (forward or backward, after optimisation) is read into
:class:`AnnotatedTrace`: one :class:`TraceNode` per top-level bound symbol with its role, and one
:class:`Collective` per asynchronous collective with the nodes that belong to it.

Roles:
- ``COMPUTE`` ops keep their relative order; everything else is placed around them.
- ``COLLECTIVE`` issues an asynchronous collective (its output is a future), ``WAIT`` completes it.
- ``PROLOGUE`` ops exist only to prepare one collective's input (padding, gradient pre-averaging,
  a dtype cast). They travel with the collective so that it can issue as soon as its input exists.
- ``EPILOGUE`` ops are pure functions of gathered parameters (unpadding slices, broadcasts of a
  norm weight). They travel with the wait, so hoisted parameter views do not force early waits.
- ``HEADER`` (unpacking of inputs) stays first and ``RETURN`` last; deletions are dropped and
  regenerated after scheduling.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch.distributed as dist
from thunder.core import prims
from thunder.core.proxies import FutureTensorProxy, Proxy, TensorProxy
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx

from thunder_overlap._analysis.layout import NO_BUCKETS, BucketLayouts
from thunder_overlap._analysis.local_copies import backend_launches, pool_bytes_to_wait
from thunder_overlap._ops import ALL_GATHER_ISSUES, BUCKETED_ISSUES, COALESCED_ISSUES, DROPPED_BY_SCHEDULING, REDUCE_SCATTER_ISSUES, numel

__all__ = [
    "AnnotatedTrace",
    "Collective",
    "CollectiveKind",
    "NodeKind",
    "TraceNode",
    "classify_trace",
    "find_swallowed_collectives",
    "is_expensive",
    "parameter_names_of_inputs",
]


class NodeKind(Enum):
    HEADER = "header"
    COMPUTE = "compute"
    PROLOGUE = "prologue"
    COLLECTIVE = "collective"
    WAIT = "wait"
    EPILOGUE = "epilogue"
    RETURN = "return"


class CollectiveKind(Enum):
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    # Hybrid sharding's reduction across replicas; any other collective is costed as one too.
    ALL_REDUCE = "all_reduce"


_HEADER_IDS = {prims.PrimIDs.UNPACK_TRIVIAL, prims.PrimIDs.UNPACK_SEQUENCE}
_EXPENSIVE_TAGS = {prims.OpTags.MATMUL_OP, prims.OpTags.DONT_AUTO_RECOMPUTE_IN_BACKWARD, prims.OpTags.DONT_RECOMPUTE_IN_BACKWARD}
_COMMENT_IDS = {prims.PrimIDs.COMMENT}


@dataclass
class TraceNode:
    """One top-level bound symbol of the trace and its role."""

    index: int
    bsym: BoundSymbol
    kind: NodeKind
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    # For COLLECTIVE, WAIT and PROLOGUE nodes: index into AnnotatedTrace.collectives.
    collective: int | None = None

    @property
    def name(self) -> str:
        return self.bsym.sym.name


@dataclass
class Collective:
    """One asynchronous collective: where it is issued, waited on, and what it moves."""

    kind: CollectiveKind
    start: int
    wait: int | None
    process_group: dist.ProcessGroup | None
    # Bytes of the unsharded tensor: the all-gather output, or the reduce-scatter input.
    unsharded_bytes: int
    prologue: list[int] = field(default_factory=list)
    # Element type of what it moves (a thunder dtype; None when unknown).
    dtype: object = None
    # Collectives launched together in it: more than one for a coalesced launch, which pays
    # the network's latency once for all of them.
    members: int = 1
    # Launches the backend pays a latency for (local_copies.backend_launches).
    launches: int = 1
    # Bytes of bucket pool buffers it keeps busy from its issue to its wait (local_copies.pool_bytes_to_wait).
    pool_bytes_to_wait: int = 0

    @property
    def group_key(self) -> int:
        return id(self.process_group)

    @property
    def bucket_key(self) -> tuple:
        """Collectives that could share one launch: same kind, process group and dtype."""
        return self.kind, self.group_key, self.dtype


@dataclass
class AnnotatedTrace:
    """An execution trace read for scheduling."""

    trace: TraceCtx
    nodes: list[TraceNode]
    collectives: list[Collective]
    # proxy name -> index of the node that produces it (trace inputs have no producer)
    producer: dict[str, int]
    # proxy name -> indices of the nodes that read it, in trace order
    consumers: dict[str, list[int]]
    # The layouts of the buckets its operators name (empty where it runs none).
    layouts: BucketLayouts = field(default_factory=lambda: NO_BUCKETS)

    def is_input(self, name: str) -> bool:
        """True for the trace's inputs: names no node computes (only the header unpacks them)."""
        p = self.producer.get(name)
        return p is None or self.nodes[p].kind is NodeKind.HEADER

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The process group of its first collective that names one (None where none does): the
        group the trace shards over, whose size and backend price and agree its collectives."""
        return next((c.process_group for c in self.collectives if c.process_group is not None), None)

    @property
    def runs_buckets(self) -> bool:
        """Whether its all-gathers or reduce-scatters move buckets (on the bucket pool's buffers,
        which are held for the whole step) rather than one parameter each."""
        return any(self.nodes[c.start].bsym.sym.id in BUCKETED_ISSUES for c in self.collectives)


def _proxy_names(values) -> tuple[str, ...]:
    names: list[str] = []
    for v in values:
        if isinstance(v, Proxy) and v.name not in names:
            names.append(v.name)
    return tuple(names)





def _walk(bsym: BoundSymbol):
    yield bsym
    for sub in bsym.subsymbols:
        yield from _walk(sub)


def is_expensive(bsym: BoundSymbol) -> bool:
    """True for matmul-like ops, the ones Thunder itself refuses to recompute automatically."""
    return any(s.sym.tags and _EXPENSIVE_TAGS.intersection(s.sym.tags) for s in _walk(bsym))


def _is_collective_start(bsym: BoundSymbol) -> bool:
    return any(isinstance(o, FutureTensorProxy) for o in bsym.flat_proxy_outs)


def _is_wait(bsym: BoundSymbol) -> bool:
    args = bsym.flat_proxy_args
    return len(args) == 1 and isinstance(args[0], FutureTensorProxy) and not _is_collective_start(bsym)


def _collective_kind(bsym: BoundSymbol) -> CollectiveKind:
    if bsym.sym.id in ALL_GATHER_ISSUES:
        return CollectiveKind.ALL_GATHER
    if bsym.sym.id in REDUCE_SCATTER_ISSUES:
        return CollectiveKind.REDUCE_SCATTER
    return CollectiveKind.ALL_REDUCE


def _launch_members(bsym: BoundSymbol) -> int:
    return len(bsym.args[1]) if bsym.sym.id in COALESCED_ISSUES else 1


def _process_group(bsym: BoundSymbol) -> dist.ProcessGroup | None:
    for a in bsym.args:
        if isinstance(a, dist.ProcessGroup):
            return a
    return None


def find_swallowed_collectives(trace: TraceCtx) -> list[str]:
    """Names of top-level bound symbols (fusions) that contain a collective or a wait inside.

    Such a fusion hides communication from any scheduler (Thunder 0.2.6's torch_compile executor
    makes one on CPU from an all-gather and its wait). Returns an empty list when every collective is top-level.
    """
    swallowed = []
    for bsym in trace.bound_symbols:
        # A collective's own bound symbol lists its implementation inside; a fusion that
        # returns a future is no collective of its own, only a region holding one.
        if (_is_collective_start(bsym) or _is_wait(bsym)) and not bsym.sym.is_fusion:
            continue
        inner = list(_walk(bsym))[1:]
        if any(_is_collective_start(s) or _is_wait(s) for s in inner):
            swallowed.append(bsym.sym.name)
    return swallowed


def classify_trace(trace: TraceCtx, layouts: BucketLayouts = NO_BUCKETS, *, roles_only: bool = False) -> AnnotatedTrace:
    """Reads ``trace`` into nodes with roles; deletions are left out. ``layouts``: those of the
    buckets its bucketed collectives name (``BucketingTransform.layouts``), which the launches and
    pool buffers of a bucketed collective follow; ``roles_only`` reads the roles without them (the
    collectives' launches and pool buffers are then left at one launch and none)."""
    nodes: list[TraceNode] = []
    for bsym in trace.bound_symbols:
        if bsym.sym.id in DROPPED_BY_SCHEDULING or bsym.sym.id in _COMMENT_IDS:
            continue
        if bsym.sym.id in _HEADER_IDS:
            kind = NodeKind.HEADER
        elif bsym.sym.id is prims.PrimIDs.RETURN:
            kind = NodeKind.RETURN
        elif _is_collective_start(bsym):
            kind = NodeKind.COLLECTIVE
        elif _is_wait(bsym):
            kind = NodeKind.WAIT
        else:
            kind = NodeKind.COMPUTE
        nodes.append(
            TraceNode(
                index=len(nodes),
                bsym=bsym,
                kind=kind,
                inputs=_proxy_names(bsym.flat_args),
                outputs=_proxy_names(bsym.flat_outs),
            )
        )

    producer: dict[str, int] = {}
    consumers: dict[str, list[int]] = {}
    for node in nodes:
        for name in node.inputs:
            consumers.setdefault(name, []).append(node.index)
        for name in node.outputs:
            # An op that writes into its input (same name out) keeps the first producer.
            producer.setdefault(name, node.index)

    collectives = _link_collectives(nodes, producer, consumers, None if roles_only else layouts)
    _mark_prologues(nodes, collectives, producer, consumers)
    _mark_epilogues(nodes, collectives, producer)
    return AnnotatedTrace(trace, nodes, collectives, producer, consumers, NO_BUCKETS if roles_only else layouts)


def _link_collectives(nodes, producer, consumers, layouts: BucketLayouts | None) -> list[Collective]:
    collectives: list[Collective] = []
    for node in nodes:
        if node.kind is not NodeKind.COLLECTIVE:
            continue
        bsym = node.bsym
        kind = _collective_kind(bsym)
        future = next((o for o in bsym.flat_proxy_outs if isinstance(o, FutureTensorProxy)), None)
        if kind is CollectiveKind.ALL_GATHER:
            moved = [future]
            moved_dtype = future.dtype
        else:
            # A bucketed reduce-scatter reads every gradient of its bucket, and sends them in its
            # result's dtype (mixed precision's lay-out casts bf16 gradients to float32).
            moved = [a for a in bsym.flat_proxy_args if isinstance(a, TensorProxy)]
            moved_dtype = future.dtype if future is not None else moved[0].dtype
        wait = None
        for name in node.outputs:
            for c in consumers.get(name, []):
                if nodes[c].kind is NodeKind.WAIT:
                    wait = c
        node.collective = len(collectives)
        if wait is not None:
            nodes[wait].collective = node.collective
        collectives.append(
            Collective(
                kind=kind,
                start=node.index,
                wait=wait,
                process_group=_process_group(bsym),
                unsharded_bytes=sum(numel(t) for t in moved) * moved_dtype.bytes,
                dtype=moved_dtype,
                members=_launch_members(bsym),
                launches=1 if layouts is None else backend_launches(bsym, layouts),
                pool_bytes_to_wait=0 if layouts is None else pool_bytes_to_wait(bsym, layouts),
            )
        )
    return collectives


def _is_cheap_single_input(node: TraceNode) -> bool:
    tensor_inputs = [a for a in node.bsym.flat_proxy_args if isinstance(a, TensorProxy)]
    return node.kind is NodeKind.COMPUTE and len(tensor_inputs) == 1 and not is_expensive(node.bsym)


def _mark_prologues(nodes, collectives, producer, consumers) -> None:
    # Walk backwards from each collective through cheap single-input ops (pad, pre-average, cast)
    # read only by that collective's chain. Multi-input ops, such as the add that sums a tied
    # weight's gradients, are real compute and stay in place.
    for cidx, coll in enumerate(collectives):
        frontier = [coll.start]
        while frontier:
            current = nodes[frontier.pop()]
            for name in current.inputs:
                p = producer.get(name)
                if p is None or not _is_cheap_single_input(nodes[p]):
                    continue
                readers = {c for out in nodes[p].outputs for c in consumers.get(out, [])}
                own_kinds = (NodeKind.COLLECTIVE, NodeKind.PROLOGUE)
                if readers and all(nodes[r].collective == cidx and nodes[r].kind in own_kinds for r in readers):
                    nodes[p].kind = NodeKind.PROLOGUE
                    nodes[p].collective = cidx
                    coll.prologue.append(p)
                    frontier.append(p)
        coll.prologue.sort()


def _mark_epilogues(nodes, collectives, producer) -> None:
    gathered_waits = {c.wait for c in collectives if c.kind is CollectiveKind.ALL_GATHER and c.wait is not None}
    for node in nodes:
        if node.kind is not NodeKind.COMPUTE or not node.inputs or is_expensive(node.bsym):
            continue
        sources = [producer.get(name) for name in node.inputs]
        if all(s is not None and (s in gathered_waits or nodes[s].kind is NodeKind.EPILOGUE) for s in sources):
            node.kind = NodeKind.EPILOGUE


def parameter_names_of_inputs(prologue_trace: TraceCtx, computation_trace: TraceCtx) -> dict[str, str]:
    """Computation-trace input name -> the name of the module parameter the prologue unpacks into it."""
    producers = {o.name: b for b in prologue_trace.bound_symbols for o in b.flat_proxy_outs}
    names: dict[str, str] = {}
    # The prologue's outputs are the computation's arguments, position by position.
    for out, inp in zip(prologue_trace.output[0], computation_trace.args, strict=True):
        bsym = producers.get(getattr(out, "name", None))
        if bsym is not None and bsym.sym.id is prims.PrimIDs.UNPACK_PARAMETER:
            names[inp.name] = bsym.args[1]
    return names
