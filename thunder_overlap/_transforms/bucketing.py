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
(``"auto"``) sized by the cost model (:mod:`~thunder_overlap._bucketing.auto_plan`), whose plan
the first compile replaces with block buckets where it predicts those faster ([Note: auto against
block]); ``summaries.plan`` says which buckets were formed and why. This transform owns the buckets' state:
their buffers and the pool, kept in the model's state (:class:`ModelState`) with the layout each
runs with, which the bucket path choice sets at the first compile.

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
from dataclasses import dataclass

import thunder
import torch
import torch.distributed as dist
import torch.nn as nn
from thunder.core.trace import TraceCtx, TraceTag
from thunder.core.transform_common import Transform
from thunder.distributed import get_skip_data_parallel_grad_sync

from thunder_overlap._analysis.layout import BucketLayout
from thunder_overlap._analysis.memory_estimate import estimate_memory
from thunder_overlap._analysis.passes import Pass
from thunder_overlap._analysis.pool_slots import SlotPlan
from thunder_overlap._bucketing.buffers import BucketBuffers
from thunder_overlap._bucketing.module_plan import ModuleBuckets, bucket_slots, make_buckets, plan_module_buckets, unsharded_numel
from thunder_overlap._bucketing.plan import BucketPlan, BucketPlanSummary, bucket_owner
from thunder_overlap._bucketing.plan_choice import BucketPlanChoice, PlanCandidate, same_grouping
from thunder_overlap._bucketing.pool import BufferPool
from thunder_overlap._bucketing.trace_rewrite import BucketingSummary, forward_input_names, rewrite_bucket_collectives
from thunder_overlap._scheduling.prediction import predict_step
from thunder_overlap._transforms._lookup import transform_of
from thunder_overlap._transforms._model_state import ModelState
from thunder_overlap.options import BucketingStrategy, MixedPrecision

__all__ = ["BucketingSummaries", "BucketingTransform"]

logger = logging.getLogger(__name__)


@dataclass
class BucketingSummaries:
    """Which buckets were formed, and what the last rewrite of each pass did."""

    plan: BucketPlanSummary | None = None
    # "auto"'s plan against block buckets at the first compile ([Note: auto against block]).
    plan_choice: BucketPlanChoice | None = None
    forward: BucketingSummary | None = None
    backward: BucketingSummary | None = None
    # The last backward compiled under no_sync.
    backward_no_sync: BucketingSummary | None = None


class BucketingTransform(Transform):
    """Lays buckets out in persistent flat buffers and bucket-wise collectives in the traces.

    Args:
        state: the model's (:class:`ModelState`), where the buckets are kept; its configuration's
            cost model, prefetch limit and memory slack size ``"auto"`` buckets, its blocks form
            block buckets.
        strategy: ``LAYER``, ``BLOCK`` or ``AUTO``.
        process_group: the FSDP process group.
        cap_bytes: largest unsharded bucket size; None for no cap.
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
        state: ModelState,
        strategy: BucketingStrategy,
        process_group: dist.ProcessGroup,
        cap_bytes: int | None = None,
        *,
        replicate_group: dist.ProcessGroup | None = None,
        mixed_precision: MixedPrecision | None = None,
    ) -> None:
        if not strategy.has_buckets:
            raise ValueError(f"BucketingTransform needs strategy LAYER, BLOCK or AUTO, got {strategy!r}")
        self.state = state
        self.strategy = strategy
        self.process_group = process_group
        self.cap_bytes = cap_bytes
        self.replicate_group = replicate_group
        self.mixed_precision = mixed_precision
        self.summaries = BucketingSummaries()
        self._forward_inputs: list[str | None] | None = None
        # The first forward with a backward, before and after its rewrite, until the backward's
        # hook has chosen the plan ([Note: auto against block]).
        self._first_forward: tuple[TraceCtx, TraceCtx] | None = None

    @staticmethod
    def of(module) -> BucketingTransform | None:
        """The bucketing transform of a module ``thunder_overlap.fsdp`` returned, if any."""
        return transform_of(module, BucketingTransform)

    # --- the buckets' state ---------------------------------------------------------------------

    @property
    def buckets(self) -> list[BucketBuffers]:
        return self.state.buckets

    @property
    def pool(self) -> BufferPool:
        """Where the buckets' unsharded buffers come from."""
        return self.state.pool

    @property
    def plans(self) -> list[BucketPlan]:
        return [b.plan for b in self.buckets]

    @property
    def layouts(self) -> dict[BucketBuffers, BucketLayout]:
        """Each bucket's layout, keyed by the bucket object the traces name: what analysis of
        this module's traces takes (``layouts=``)."""
        return self.state.layouts

    def set_layouts(self, layouts: dict[BucketBuffers, BucketLayout]) -> None:
        """Runs each bucket with its layout in ``layouts`` from the next step on."""
        self.state.set_layouts(layouts)

    def held_buffers(self) -> list[torch.Tensor]:
        """The buffers the buckets hold between steps besides the parameters' flat shards: the
        pool's and, under mixed precision, the cast shards. The memory estimate counts them as
        held all along; a tracker started at a step's start should too."""
        casts = [b.gather_shard for b in self.buckets if b.gather_shard is not b.flat_shard]
        return [*self.pool.buffers, *casts]

    def buffer_storages(self) -> set[int]:
        """Data pointers of every persistent buffer: the flat shards, their casts (mixed
        precision) and the pool."""
        return {t.untyped_storage().data_ptr() for t in (*(b.flat_shard for b in self.buckets), *self.held_buffers())}

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
        state = self.state
        block_names = [name for name, _ in state.find_blocks(model._model)]
        if self.strategy is BucketingStrategy.BLOCK and not block_names:
            warnings.warn(
                f"thunder_overlap: bucketing_strategy='block' found no blocks in {type(model._model).__name__} (no "
                "nn.ModuleList/nn.Sequential of two or more modules): each module's parameters form a bucket, as with "
                "'layer'. Name the blocks with block_types=",
                stacklevel=2,
            )
        owners = bucket_owner(model._model, self.strategy, block_names)
        shards = list(model.named_parameters())
        module = ModuleBuckets(shards, owners, set(block_names), self.process_group, self.replicate_group, self.mixed_precision)
        plans, self.summaries.plan = plan_module_buckets(module, self.strategy, self.cap_bytes, state.config)
        logger.info("%s", self.summaries.plan)
        numels = {name: unsharded_numel(model._model, name) for name, _ in shards}
        buckets, state.pool = make_buckets(plans, dict(shards), numels, self.process_group, self.mixed_precision)
        state.buckets, state.bucket_group, state.bucket_plan = buckets, self.process_group, self.summaries.plan
        shared = model._get_shared_names()
        if self.strategy is BucketingStrategy.AUTO and state.config.tuning.auto_weighs_block_buckets:
            block_plans, block_summary = plan_module_buckets(module, BucketingStrategy.BLOCK, self.cap_bytes, state.config)
            if not same_grouping(plans, block_plans):
                state.plan_alternative = PlanCandidate(block_plans, block_summary, numels, shared, self.mixed_precision)
        # The mapping the module reads its parameters from: ShardsInPlaceTransform puts the
        # original parameters there later, pointed at the same shards.
        state.module_parameters = model._overrides_parameters
        state.bucket_slots = bucket_slots(buckets, shared)
        for bucket in buckets:
            for slot_index, slot in enumerate(bucket.plan.slots):
                parameter = nn.Parameter(bucket.shard_view(slot_index), requires_grad=bucket.plan.requires_grad)
                for alias in shared[slot.name]:
                    model._overrides_parameters[alias] = parameter

    def transform_traces_pre_prologue(self, prologue_trace, computation_trace, epilogue_trace, **kwargs):
        self.state.record_inputs(prologue_trace, computation_trace)
        return prologue_trace, computation_trace, epilogue_trace

    def transform_trace_post_optimization(self, computation_trace: TraceCtx, **kwargs) -> TraceCtx:
        pass_ = Pass.of(computation_trace)
        state = self.state
        if pass_ is Pass.FORWARD:
            self._forward_inputs = forward_input_names(computation_trace)
            if state.plan_alternative is not None and TraceTag.AUGMENTED_FORWARD not in computation_trace.tags:
                state.plan_alternative = None  # an inference compile runs the buckets laid out: they stay
        unsynced = pass_ is Pass.BACKWARD and get_skip_data_parallel_grad_sync()
        if pass_ is Pass.BACKWARD and self._first_forward is not None:
            forward_in, forward_out = self._first_forward
            self._first_forward = None
            if state.plan_alternative is not None and self._choose_plan(forward_in, computation_trace):
                redone = self._rewrite(forward_in, Pass.FORWARD, unsynced=False)
                forward_out.bound_symbols, forward_out.names = redone.bound_symbols, forward_out.names | redone.names
        rewritten = self._rewrite(computation_trace, pass_, unsynced)
        if pass_ is Pass.FORWARD and state.plan_alternative is not None:
            self._first_forward = (computation_trace, rewritten)
        return rewritten

    def _choose_plan(self, forward: TraceCtx, backward: TraceCtx) -> bool:
        """[Note: auto against block] where ZeRO3 did not choose it: both plans' steps predicted
        as the schedule will run them. True where block buckets replaced ``"auto"``'s."""
        state = self.state

        def step_ms_of(priced: ModelState) -> float:
            step = priced.bucketed(forward, backward)
            return predict_step(
                priced.config,
                *step,
                priced.layouts,
                prefetch_unit_bytes=priced.prefetch_unit_bytes,
                basis_floor_bytes=priced.regather_all_peak_bytes,
            ).step_ms

        group = state.agreement_group if state.agreement_group is not None else self.process_group
        state.agree_settings_once(group)
        return state.choose_plan(step_ms_of, group)

    def _rewrite(self, computation_trace: TraceCtx, pass_: Pass, unsynced: bool) -> TraceCtx:
        """``computation_trace`` with its collectives bucketed, recorded in :attr:`summaries`."""
        self.summaries.plan, self.summaries.plan_choice = self.state.bucket_plan, self.state.plan_choice
        rewritten, summary = rewrite_bucket_collectives(
            computation_trace, self.state.bucket_index(), forward_inputs=self._forward_inputs, accumulate=unsynced
        )
        if pass_ is Pass.FORWARD:
            self.summaries.forward = summary
        elif unsynced:
            self.summaries.backward_no_sync = summary
        else:
            self.summaries.backward = summary
        pass_name = f"{pass_} under no_sync" if unsynced else str(pass_)
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
        return self.state.bucket_slots.get(name)
