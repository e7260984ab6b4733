"""Bucketing: one all-gather and one reduce-scatter per bucket, on persistent buffers.

Thunder's FSDP gathers and reduce-scatters every parameter on its own. This transform changes:

- the module: each bucket's shards move into one flat buffer
  (:class:`~thunder_overlap._bucketing.buffers.BucketBuffers`) and the parameters become views of it;
- the forward and backward execution traces: the all-gathers and waits of a bucket's parameters
  become one ``bucket_all_gather`` and one ``bucket_all_gather_wait``, whose outputs keep the
  names of the per-parameter waits (so the unpadding slices and the compute read them as before);
  the pad, pre-average, reduce-scatter and wait of a bucket's gradients become one
  ``bucket_reduce_scatter`` and its wait. ZeRO3's backward re-gathers are bucketed the same way.
  A backward compiled under no_sync gets one ``bucket_accumulate_grads`` per bucket instead,
  which sums the gradients locally; the bucket's next reduce-scatter sends the sum.

Which parameters share a bucket is planned in ``transform_module``: by layer, by block, or
(``"auto"``) sized by the cost model (:mod:`~thunder_overlap._bucketing.auto_plan`);
``summaries.plan`` says which buckets were formed and why. This transform owns the buckets' state:
their buffers, and the layout each runs with (:attr:`BucketingTransform.layouts`, changed only
through :meth:`BucketingTransform.set_layouts`, by the bucket path choice at the first compile).

A bucket's gather starts where its first parameter's did and its reduce-scatter where the last
gradient's did; :class:`OverlapScheduleTransform`, which runs next, moves them from there.
Collectives this transform cannot bucket (a parameter it does not know, a gradient that is not
returned as is, a bucket whose gradients are only partly in the trace) stay per-parameter and are
listed, with the reason, in :attr:`BucketingTransform.summaries` and in a warning.

This module holds only the Thunder hooks; the trace rewrite itself is
:func:`~thunder_overlap._bucketing.trace_rewrite.rewrite_bucket_collectives`.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field

import thunder
import torch.distributed as dist
import torch.nn as nn
from thunder.core.trace import TraceCtx, TraceTag
from thunder.core.transform_common import Transform
from thunder.distributed import get_skip_data_parallel_grad_sync

from thunder_overlap._analysis.blocks import BlockTypes
from thunder_overlap._analysis.classify import parameter_names_of_inputs
from thunder_overlap._analysis.layout import BucketLayout
from thunder_overlap._analysis.memory_estimate import estimate_memory
from thunder_overlap._analysis.pool_slots import SlotPlan
from thunder_overlap._bucketing.buffers import BucketBuffers
from thunder_overlap._bucketing.module_plan import ModuleBuckets, block_names, make_buckets, plan_module_buckets, unsharded_numel
from thunder_overlap._bucketing.plan import BucketPlan, BucketPlanSummary, bucket_owner
from thunder_overlap._bucketing.pool import BufferPool
from thunder_overlap._bucketing.trace_rewrite import BucketIndex, BucketingSummary, forward_input_names, rewrite_bucket_collectives
from thunder_overlap._transforms._lookup import transform_of
from thunder_overlap.config import OverlapConfig
from thunder_overlap.options import BucketingStrategy, MixedPrecision, parse_bucketing_strategy

__all__ = ["BucketingSummaries", "BucketingTransform"]

logger = logging.getLogger(__name__)


@dataclass
class BucketingSummaries:
    """Which buckets were formed, and what the last rewrite of each pass did."""

    plan: BucketPlanSummary | None = None
    forward: BucketingSummary | None = None
    backward: BucketingSummary | None = None
    # The last backward compiled under no_sync.
    backward_no_sync: BucketingSummary | None = field(default=None)

    def __getitem__(self, key: str):
        """The summaries by their former names ("plan", "forward", "backward", "backward (no_sync)")."""
        return getattr(self, key.replace(" (no_sync)", "_no_sync"))


class BucketingTransform(Transform):
    """Lays buckets out in persistent flat buffers and bucket-wise collectives in the traces.

    Args:
        strategy: ``"layer"``, ``"block"`` or ``"auto"`` (:class:`BucketingStrategy`).
        process_group: the FSDP process group.
        cap_bytes: largest unsharded bucket size; None for no cap.
        config: the scheduler's options: its cost model, prefetch limit and memory slack size
            ``"auto"`` buckets.
        block_types: the module classes that form blocks (None: detected).
        replicate_group: hybrid sharding's group across replicas, whose all-reduce of each
            bucket's shard ``"auto"`` buckets must saturate too; None for plain FSDP.
        mixed_precision: the policy :class:`MixedPrecisionTransform` casts with: each bucket
            gathers in its ``param_dtype`` (one cast of the flat shard per gather).

    After ``transform_module``: :attr:`buckets` (one :class:`BucketBuffers` each), their
    :attr:`layouts`, ``summaries.plan``; after each compile, ``summaries.forward``,
    ``.backward`` (or ``.backward_no_sync``). ``pool`` holds the unsharded buffers; after a step,
    ``print(pool)`` says which buckets used each for what, and :meth:`slot_plan` predicts it.
    """

    def __init__(
        self,
        strategy: BucketingStrategy | str,
        process_group: dist.ProcessGroup,
        cap_bytes: int | None = None,
        *,
        config: OverlapConfig | None = None,
        block_types: BlockTypes | None = None,
        replicate_group: dist.ProcessGroup | None = None,
        mixed_precision: MixedPrecision | None = None,
    ) -> None:
        self.strategy = parse_bucketing_strategy(strategy)
        if not self.strategy.has_buckets:
            raise ValueError(f"BucketingTransform needs strategy 'layer', 'block' or 'auto', got {strategy!r}")
        self.process_group = process_group
        self.cap_bytes = cap_bytes
        self.config = config if config is not None else OverlapConfig()
        self.block_types = block_types
        self.replicate_group = replicate_group
        self.mixed_precision = mixed_precision
        self.buckets: list[BucketBuffers] = []
        self.pool = BufferPool()
        self.summaries = BucketingSummaries()
        # parameter name (every alias of a tied parameter) -> (index into buckets, slot)
        self._slots: dict[str, tuple[int, int]] = {}
        # computation-trace input name -> parameter name, from every prologue seen
        self._parameter_of_input: dict[str, str] = {}
        self._forward_inputs: list[str | None] | None = None

    @staticmethod
    def of(module) -> BucketingTransform | None:
        """The bucketing transform of a module ``thunder_overlap.fsdp`` returned, if any."""
        return transform_of(module, BucketingTransform)

    # --- the buckets' state ---------------------------------------------------------------------

    @property
    def plans(self) -> list[BucketPlan]:
        return [b.plan for b in self.buckets]

    @property
    def layouts(self) -> dict[BucketBuffers, BucketLayout]:
        """Each bucket's layout, keyed by the bucket object the traces name: what analysis of
        this module's traces takes (``layouts=``)."""
        return {bucket: bucket.layout for bucket in self.buckets}

    def set_layouts(self, layouts: dict[BucketBuffers, BucketLayout]) -> None:
        """Runs each bucket with its layout in ``layouts`` from the next step on."""
        for bucket in self.buckets:
            bucket.layout = layouts.get(bucket, bucket.layout)

    def plan_digest(self) -> str | None:
        """The plan's hash, which ranks compare before their first collective."""
        return self.summaries.plan.digest if self.summaries.plan is not None else None

    def largest_bucket_bytes(self) -> int | None:
        """The largest bucket's gathered (unsharded, padded) bytes; None before planning."""
        plan = self.summaries.plan
        return max((b.unsharded_bytes for b in plan.buckets), default=None) if plan is not None else None

    def buffer_storages(self) -> set[int]:
        """Data pointers of every persistent buffer: the flat shards, their casts (mixed
        precision) and the pool."""
        storages = {s.untyped_storage().data_ptr() for b in self.buckets for s in (b.flat_shard, b.gather_shard)}
        return storages | {p.untyped_storage().data_ptr() for p in self.pool.buffers}

    def gradient_storages(self) -> set[int]:
        """Data pointers of the buffers a reduced gradient can live in: the gradient shards alive
        (held by ``.grad``), and the pool (where a bucket reduces in place)."""
        storages = set().union(*(b.grad_shard_storages() for b in self.buckets))
        return storages | {p.untyped_storage().data_ptr() for p in self.pool.buffers}

    @property
    def allocations(self) -> int:
        """Pool buffers allocated so far (gradient shards, allocated every step as the gradients
        they are, are not counted)."""
        return self.pool.allocations

    def slot_plan(self, module) -> SlotPlan:
        """The pool a step of ``module``'s last compiled traces needs, planned from the live
        intervals of their bucket buffers: after a step, the same buffers as ``pool.slots``."""
        forward = estimate_memory(thunder.last_traces(module)[-1], layouts=self.layouts)
        return estimate_memory(thunder.last_backward_traces(module)[-1], layouts=self.layouts, after=forward).pool

    # --- Thunder's hooks ------------------------------------------------------------------------

    def transform_module(self, model) -> None:
        owners = bucket_owner(model._model, self.strategy, self.block_types)
        shards = list(model.named_parameters())
        module = ModuleBuckets(shards, owners, block_names(model._model, self.block_types), self.process_group, self.replicate_group)
        plans, self.summaries.plan = plan_module_buckets(module, self.strategy, self.cap_bytes, self.config)
        logger.info("%s", self.summaries.plan)
        numels = {name: unsharded_numel(model._model, name) for name, _ in shards}
        self.buckets, self.pool = make_buckets(plans, dict(shards), numels, self.process_group, self.mixed_precision)
        shared = model._get_shared_names()
        for index, bucket in enumerate(self.buckets):
            for slot_index, slot in enumerate(bucket.plan.slots):
                parameter = nn.Parameter(bucket.shard_view(slot_index), requires_grad=bucket.plan.requires_grad)
                for alias in shared[slot.name]:
                    model._overrides_parameters[alias] = parameter
                    self._slots[alias] = (index, slot_index)

    def transform_traces_pre_prologue(self, prologue_trace, computation_trace, epilogue_trace, **kwargs):
        self._parameter_of_input.update(parameter_names_of_inputs(prologue_trace, computation_trace))
        return prologue_trace, computation_trace, epilogue_trace

    def transform_trace_post_optimization(self, computation_trace: TraceCtx, **kwargs) -> TraceCtx:
        is_backward = TraceTag.BACKWARD in computation_trace.tags
        if not is_backward:
            self._forward_inputs = forward_input_names(computation_trace)
        unsynced = is_backward and get_skip_data_parallel_grad_sync()
        index = BucketIndex(self.buckets, self.process_group, self._slot_of_input)
        rewritten, summary = rewrite_bucket_collectives(computation_trace, index, forward_inputs=self._forward_inputs, accumulate=unsynced)
        pass_name = ("backward_no_sync" if unsynced else "backward") if is_backward else "forward"
        setattr(self.summaries, pass_name, summary)
        logger.info(
            "%s: %d bucket all-gathers, %d bucket reduce-scatters, %d bucket accumulations, %d collectives left unbucketed",
            pass_name, summary.all_gathers, summary.reduce_scatters, summary.accumulations, len(summary.unbucketed),
        )  # fmt: skip
        if summary.unbucketed:
            # Correct but slower (one collective per parameter): say so rather than leave it to summaries.
            listed = "; ".join(f"{what}: {why}" for what, why in summary.unbucketed)
            warnings.warn(
                f"thunder_overlap bucketing ({pass_name}): {len(summary.unbucketed)} collectives stay per-parameter: {listed}",
                stacklevel=2,
            )
        return rewritten

    def slot_of_parameter(self, name: str) -> tuple[int, int] | None:
        """(index into :attr:`buckets`, slot) of parameter ``name`` (any alias); None if unbucketed."""
        return self._slots.get(name)

    def bucketed(self, forward: TraceCtx, backward: TraceCtx) -> tuple[TraceCtx, TraceCtx]:
        """A forward and its backward with their collectives bucketed as this transform's hooks
        bucket them (nothing recorded), for estimates made before it runs (sharding "auto")."""
        index = BucketIndex(self.buckets, self.process_group, self._slot_of_input)
        bucketed_forward, _ = rewrite_bucket_collectives(forward, index)
        bucketed_backward, _ = rewrite_bucket_collectives(backward, index, forward_inputs=forward_input_names(forward))
        return bucketed_forward, bucketed_backward

    def _slot_of_input(self, name: str) -> tuple[int, int] | None:
        parameter = self._parameter_of_input.get(name)
        return self._slots.get(parameter) if parameter is not None else None
