"""Orders that need no scheduling, and turning any order into an execution trace."""

from __future__ import annotations

from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx, TraceProvenance, TraceTag, from_trace
from thunder.executors.passes import del_last_used

from thunder_overlap._analysis.classify import AnnotatedTrace

__all__ = ["apply_order", "stock_order", "trace_of_bound_symbols"]


def stock_order(annotated: AnnotatedTrace) -> list[int]:
    """Thunder's own order (deletions left out): the baseline."""
    return [n.index for n in annotated.nodes]


def apply_order(annotated: AnnotatedTrace, order: list[int], *, provenance: str) -> TraceCtx:
    """Builds the execution trace in the scheduled order, with deletions regenerated."""
    return trace_of_bound_symbols(annotated.trace, [annotated.nodes[i].bsym for i in order], provenance=provenance)


def trace_of_bound_symbols(trace: TraceCtx, bsyms: list[BoundSymbol], *, provenance: str) -> TraceCtx:
    """A copy of ``trace`` holding ``bsyms`` (no deletions among them), deletions regenerated."""
    is_backward = TraceTag.BACKWARD in trace.tags
    new_trace = from_trace(trace)
    new_trace.bound_symbols = list(bsyms)
    new_trace = del_last_used(new_trace, clear_mutable_collections=is_backward)
    new_trace.set_provenance(TraceProvenance(provenance))
    return new_trace
