"""Overlap scheduling of the forward and backward execution traces."""

from __future__ import annotations

import warnings

from thunder.core.trace import TraceCtx
from thunder.core.transform_common import Transform

from thunder_overlap.blocks import largest_block_bytes
from thunder_overlap.classify import classify_trace, find_swallowed_collectives
from thunder_overlap.config import OverlapConfig, ScheduleLimits
from thunder_overlap.scheduling import OverlapScheduler, apply_order, stock_order

__all__ = ["OverlapScheduleTransform"]


class OverlapScheduleTransform(Transform):
    """Reorders collectives and waits around Thunder's compute order (see ``scheduling``).

    Compute keeps its order; all-gathers move up to prefetch within the configured limits,
    reduce-scatters move up to right after their gradient, waits move down to their first use.
    """

    def __init__(self, config: OverlapConfig | None = None) -> None:
        self.config = config if config is not None else OverlapConfig()
        self.limits: ScheduleLimits = self.config.limits(largest_block_bytes=None)

    def transform_module(self, model) -> None:
        # The original module still has the unsharded shapes (on meta once FSDP released it).
        block_bytes = largest_block_bytes(model._model)
        if block_bytes is None:
            warnings.warn(
                f"thunder_overlap: {type(model._model).__name__} has no nn.ModuleList/nn.Sequential of blocks to "
                f"size prefetching by; limiting all-gathers in flight to {self.config.fallback_in_flight_allgathers} "
                "and leaving reduce-scatter bytes unbounded unless OverlapConfig sets limits",
                stacklevel=2,
            )
        self.limits = self.config.limits(block_bytes)

    def transform_trace_post_optimization(self, computation_trace: TraceCtx, **kwargs) -> TraceCtx:
        swallowed = find_swallowed_collectives(computation_trace)
        if swallowed:
            executors = [ex.name for ex in kwargs.get("executors_list", ())]
            raise RuntimeError(
                f"thunder_overlap: collectives were fused into {swallowed}, so they cannot be scheduled. "
                f"Executors in use: {executors}. Leave out executors that fuse communication "
                "(such as 'torchcompile'); nvFuser and the torch executor keep collectives top-level."
            )
        annotated = classify_trace(computation_trace)
        if not annotated.collectives:
            return computation_trace
        if self.config.policy == "stock":
            order = stock_order(annotated)
        else:
            order = OverlapScheduler(annotated, self.limits).schedule()
        return apply_order(annotated, order, provenance=f"thunder_overlap: {self.config.policy} schedule")
