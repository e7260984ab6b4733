"""Bucketing: one all-gather and one reduce-scatter per bucket, on persistent buffers.

Thunder's FSDP gathers and reduce-scatters every parameter on its own. This transform changes:

- the module: each bucket's shards move into one flat buffer
  (:class:`~thunder_overlap.bucketing.buffers.BucketBuffers`) and the parameters become views of it;
- the forward and backward execution traces: the all-gathers and waits of a bucket's parameters
  become one ``bucket_all_gather`` and one ``bucket_all_gather_wait``, whose outputs keep the
  names of the per-parameter waits (so the unpadding slices and the compute read them as before);
  the pad, pre-average, reduce-scatter and wait of a bucket's gradients become one
  ``bucket_reduce_scatter`` and its wait. ZeRO3's backward re-gathers are bucketed the same way.
  A backward compiled under no_sync gets one ``bucket_accumulate_grads`` per bucket instead,
  which sums the gradients locally; the bucket's next reduce-scatter sends the sum.

A bucket's gather starts where its first parameter's did and its reduce-scatter where the last
gradient's did; :class:`OverlapScheduleTransform`, which runs next, moves them from there.
Collectives this transform cannot bucket (a parameter it does not know, a gradient that is not
returned as is, a bucket whose gradients are only partly in the trace) stay per-parameter and are
listed, with the reason, in :attr:`BucketingTransform.summaries` and in a warning.

This module holds only the Thunder hooks; the trace rewrite itself is
:func:`~thunder_overlap.bucketing.trace_rewrite.rewrite_bucket_collectives`.
"""

from __future__ import annotations

import logging
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from thunder.core.trace import TraceCtx, TraceTag
from thunder.core.transform_common import Transform
from thunder.distributed import get_skip_data_parallel_grad_sync

from thunder_overlap.analysis.classify import parameter_names_of_inputs
from thunder_overlap.bucketing.buffers import BucketBuffers, BufferPool, register_bucket
from thunder_overlap.bucketing.plan import BucketPlan, bucket_owner, plan_buckets
from thunder_overlap.bucketing.trace_rewrite import (
    BucketIndex,
    BucketingSummary,
    BucketOperators,
    forward_input_names,
    rewrite_bucket_collectives,
)
from thunder_overlap.options import BucketingStrategy, parse_bucketing_strategy
from thunder_overlap.transforms.executor import (
    bucket_accumulate_grads,
    bucket_all_gather,
    bucket_all_gather_wait,
    bucket_reduce_scatter,
    bucket_reduce_scatter_wait,
)

__all__ = ["BucketingTransform", "BucketingSummary"]

logger = logging.getLogger(__name__)

_OPERATORS = BucketOperators(
    all_gather=bucket_all_gather,
    all_gather_wait=bucket_all_gather_wait,
    reduce_scatter=bucket_reduce_scatter,
    reduce_scatter_wait=bucket_reduce_scatter_wait,
    accumulate_grads=bucket_accumulate_grads,
)


class BucketingTransform(Transform):
    """Lays buckets out in persistent flat buffers and bucket-wise collectives in the traces.

    Args:
        strategy: :attr:`BucketingStrategy.LAYER` or ``BLOCK`` (or their names; see
            :func:`~thunder_overlap.bucketing.plan.bucket_owner`).
        process_group: the FSDP process group.
        cap_bytes: largest unsharded bucket size; None for no cap.
    """

    def __init__(
        self, strategy: BucketingStrategy | str, process_group: dist.ProcessGroup, cap_bytes: int | None = None
    ) -> None:
        self.strategy = parse_bucketing_strategy(strategy)
        if not self.strategy.has_buckets:
            raise ValueError(f"BucketingTransform needs strategy 'layer' or 'block', got {strategy!r}")
        self.process_group = process_group
        self.cap_bytes = cap_bytes
        self.buckets: dict[int, BucketBuffers] = {}
        self.pool = BufferPool()
        self.summaries: dict[str, BucketingSummary] = {}
        # parameter name (every alias of a tied parameter) -> (bucket id, slot)
        self._slots: dict[str, tuple[int, int]] = {}
        # computation-trace input name -> parameter name, from every prologue seen
        self._parameter_of_input: dict[str, str] = {}
        self._forward_inputs: list[str | None] | None = None

    @property
    def plans(self) -> list[BucketPlan]:
        return [b.plan for b in self.buckets.values()]

    def buffer_storages(self) -> set[int]:
        """Data pointers of every persistent buffer: flat shards, gradient shards, the pool."""
        storages = {b.flat_shard.untyped_storage().data_ptr() for b in self.buckets.values()}
        storages |= {g.untyped_storage().data_ptr() for b in self.buckets.values() for g in b.grad_shards}
        return storages | {p.untyped_storage().data_ptr() for p in self.pool.buffers}

    @property
    def allocations(self) -> int:
        """Buffers allocated so far, by the pool and for gradient shards."""
        return self.pool.allocations + sum(b.allocations for b in self.buckets.values())

    @staticmethod
    def of(module) -> BucketingTransform | None:
        """The bucketing transform of a module ``thunder_overlap.fsdp`` returned, if any."""
        from thunder import compile_data

        return next((t for t in compile_data(module).transforms if isinstance(t, BucketingTransform)), None)

    # --- module -----------------------------------------------------------------------------

    def transform_module(self, model) -> None:
        owners = bucket_owner(model._model, self.strategy)
        shared = model._get_shared_names()
        shards = list(model.named_parameters())
        plans = plan_buckets(shards, owners, world_size=self.process_group.size(), cap_bytes=self.cap_bytes)
        current = dict(shards)
        for plan in plans:
            first = current[plan.slots[0].name]
            flat = torch.empty(plan.shard_numel, dtype=plan.dtype, device=first.device)
            bucket = BucketBuffers(plan, flat, self.process_group, self.pool)
            bucket_id = register_bucket(bucket)
            self.buckets[bucket_id] = bucket
            for index, slot in enumerate(plan.slots):
                view = bucket.shard_view(index)
                with torch.no_grad():
                    view.copy_(current[slot.name])
                parameter = nn.Parameter(view, requires_grad=plan.requires_grad)
                for alias in shared[slot.name]:
                    model._overrides_parameters[alias] = parameter
                    self._slots[alias] = (bucket_id, index)

    # --- traces -----------------------------------------------------------------------------

    def transform_traces_pre_prologue(self, prologue_trace, computation_trace, epilogue_trace, **kwargs):
        self._parameter_of_input.update(parameter_names_of_inputs(prologue_trace, computation_trace))
        return prologue_trace, computation_trace, epilogue_trace

    def transform_trace_post_optimization(self, computation_trace: TraceCtx, **kwargs) -> TraceCtx:
        is_backward = TraceTag.BACKWARD in computation_trace.tags
        if not is_backward:
            self._forward_inputs = forward_input_names(computation_trace)
        unsynced = is_backward and get_skip_data_parallel_grad_sync()
        index = BucketIndex(self.buckets, self.process_group, self._slot_of_input)
        rewritten, summary = rewrite_bucket_collectives(
            computation_trace, index, _OPERATORS, forward_inputs=self._forward_inputs, accumulate=unsynced
        )
        pass_name = "forward"
        if is_backward:
            pass_name = "backward (no_sync)" if unsynced else "backward"
        self.summaries[pass_name] = summary
        logger.info(
            "%s: %d bucket all-gathers, %d bucket reduce-scatters, %d bucket accumulations, %d collectives left unbucketed",
            pass_name, summary.all_gathers, summary.reduce_scatters, summary.accumulations, len(summary.unbucketed),
        )
        if summary.unbucketed:
            # Correct but slower (one collective per parameter): say so rather than leave it to summaries.
            listed = "; ".join(f"{what}: {why}" for what, why in summary.unbucketed)
            warnings.warn(
                f"thunder_overlap bucketing ({pass_name}): {len(summary.unbucketed)} collectives stay per-parameter: {listed}",
                stacklevel=2,
            )
        return rewritten

    def _slot_of_input(self, name: str) -> tuple[int, int] | None:
        parameter = self._parameter_of_input.get(name)
        return self._slots.get(parameter) if parameter is not None else None
