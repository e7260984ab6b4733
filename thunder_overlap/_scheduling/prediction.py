"""A step predicted as the scheduler would run it: which cost model prices a trace, and a forward
and backward scheduled, estimated and simulated together (sharding "auto" compares its choices
by that prediction)."""

from __future__ import annotations

from thunder.core.devices import to_torch_device
from thunder.core.proxies import TensorProxy
from thunder.core.trace import TraceCtx

from thunder_overlap._analysis.classify import AnnotatedTrace, classify_trace
from thunder_overlap._analysis.cost_model import CostModel
from thunder_overlap._analysis.layout import NO_BUCKETS, BucketLayouts
from thunder_overlap._analysis.memory_estimate import estimate_memory
from thunder_overlap._analysis.simulator import simulate
from thunder_overlap._scheduling.step_budget import schedule_step
from thunder_overlap._scheduling.unsharding import StepPrediction
from thunder_overlap.config import OverlapConfig

__all__ = ["cost_model_of", "predict_step"]


def cost_model_of(config: OverlapConfig, annotated: AnnotatedTrace) -> CostModel:
    """The configured cost model, or the default for the device and group ``annotated``'s
    collectives run on. Ranks may estimate differently: that moves collectives relative to
    compute, never the agreed issue order."""
    if config.cost_model is not None:
        return config.cost_model
    group = annotated.process_group
    start = annotated.nodes[annotated.collectives[0].start].bsym
    device = next(to_torch_device(a.device) for a in start.flat_proxy_args if isinstance(a, TensorProxy))
    return CostModel.for_device(device, group.size() if group is not None else 1)


def predict_step(
    config: OverlapConfig,
    forward: TraceCtx,
    backward: TraceCtx,
    layouts: BucketLayouts = NO_BUCKETS,
    *,
    prefetch_unit_bytes: int | None,
    basis_floor_bytes: int | None = None,
) -> StepPrediction:
    """``forward`` then ``backward`` (bucketed with ``layouts``) scheduled as a first compile
    schedules them (the forward within the step's budget), less what needs the other ranks (the
    agreed order, the bucket paths): the predicted peak and the simulated step.
    ``basis_floor_bytes``: see :func:`schedule_trace`."""
    # A pass without collectives is the same in every choice, and has none to find its device by.
    forward_annotated, backward_annotated = (classify_trace(trace, layouts) for trace in (forward, backward))
    step = schedule_step(
        forward_annotated if forward_annotated.collectives else None,
        backward_annotated if backward_annotated.collectives else None,
        config,
        largest_block_bytes=prefetch_unit_bytes,
        cost_model=lambda trace: cost_model_of(config, trace),
        basis_floor_bytes=basis_floor_bytes,
    )
    peak_bytes, step_ms, budget_bound = 0, 0.0, False
    memory_after = None
    for scheduled in step:
        if scheduled is None:
            continue
        memory = scheduled.memory or estimate_memory(scheduled.trace, layouts=layouts, after=memory_after)
        final = classify_trace(scheduled.trace, layouts)  # coalesced launches are one collective each
        step_ms += simulate(final, list(range(len(final.nodes))), cost_model_of(config, scheduled.annotated)).step_ms
        peak_bytes = max(peak_bytes, memory.peak_bytes)
        budget_bound |= scheduled.summary is not None and scheduled.summary.budget_bound
        memory_after = memory
    return StepPrediction(peak_bytes, step_ms, budget_bound)
