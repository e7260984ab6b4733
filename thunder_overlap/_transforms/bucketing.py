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
``summaries["plan"]`` says which buckets were formed and why.

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

import thunder
import torch
import torch.distributed as dist
import torch.nn as nn
from thunder.core.trace import TraceCtx, TraceTag
from thunder.core.transform_common import Transform
from thunder.distributed import get_skip_data_parallel_grad_sync

from thunder_overlap._analysis.blocks import BlockTypes, find_blocks
from thunder_overlap._analysis.classify import parameter_names_of_inputs
from thunder_overlap._analysis.cost_model import CostModel
from thunder_overlap._analysis.memory_estimate import estimate_memory
from thunder_overlap._analysis.pool_slots import SlotPlan
from thunder_overlap._bucketing.auto_plan import AutoBucketCaps, Replicas, plan_auto_buckets
from thunder_overlap._bucketing.buffers import BucketBuffers, BufferPool, register_bucket, runs_coalesced_launches_as_one
from thunder_overlap._bucketing.plan import (
    BucketPlan,
    BucketPlanSummary,
    bucket_owner,
    plan_buckets_with_ends,
    summarize_plans,
    unsharded_bytes_of,
)
from thunder_overlap._bucketing.trace_rewrite import (
    BucketIndex,
    BucketingSummary,
    BucketOperators,
    forward_input_names,
    rewrite_bucket_collectives,
)
from thunder_overlap._transforms.executor import (
    bucket_accumulate_grads,
    bucket_all_gather,
    bucket_all_gather_wait,
    bucket_reduce_scatter,
    bucket_reduce_scatter_wait,
)
from thunder_overlap.config import OverlapConfig
from thunder_overlap.options import BucketingStrategy, parse_bucketing_strategy

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
        strategy: :attr:`BucketingStrategy.LAYER`, ``BLOCK`` or ``AUTO`` (or their names; see
            :func:`~thunder_overlap._bucketing.plan.bucket_owner` and
            :mod:`~thunder_overlap._bucketing.auto_plan`).
        process_group: the FSDP process group.
        cap_bytes: largest unsharded bucket size; None for no cap.
        config: the scheduler's options: its cost model (default: the shards' device's, over
            :func:`~thunder_overlap._analysis.cost_model.default_network`), prefetch limit, memory
            slack and ``auto_bucket_latency_share`` size ``"auto"`` buckets.
        block_types: the module classes that form blocks (None: detected).
        replicate_group: hybrid sharding's group across replicas, whose all-reduce of each
            bucket's shard ``"auto"`` buckets must saturate too; None for plain FSDP.

    After ``transform_module``, ``summaries["plan"]`` is the :class:`BucketPlanSummary`; after
    each compile, ``summaries["forward"]``, ``["backward"]`` (or ``["backward (no_sync)"]``) are
    the :class:`BucketingSummary` of that trace's rewrite. ``pool`` is the
    :class:`~thunder_overlap._bucketing.buffers.BufferPool` of the unsharded buffers; once a step
    has run, ``pool.slots`` (or ``print(pool)``) says its buffers, their bytes and which buckets
    used each for what; :meth:`slot_plan` predicts them from the final traces.
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
    ) -> None:
        self.strategy = parse_bucketing_strategy(strategy)
        if not self.strategy.has_buckets:
            raise ValueError(f"BucketingTransform needs strategy 'layer', 'block' or 'auto', got {strategy!r}")
        self.process_group = process_group
        self.cap_bytes = cap_bytes
        self.config = config if config is not None else OverlapConfig()
        self.block_types = block_types
        self.replicate_group = replicate_group
        self.buckets: dict[int, BucketBuffers] = {}
        self.pool = BufferPool()
        self.summaries: dict[str, BucketingSummary | BucketPlanSummary] = {}
        # parameter name (every alias of a tied parameter) -> (bucket id, slot)
        self._slots: dict[str, tuple[int, int]] = {}
        # computation-trace input name -> parameter name, from every prologue seen
        self._parameter_of_input: dict[str, str] = {}
        self._forward_inputs: list[str | None] | None = None

    @property
    def plans(self) -> list[BucketPlan]:
        return [b.plan for b in self.buckets.values()]

    def buffer_storages(self) -> set[int]:
        """Data pointers of every persistent buffer: the flat shards and the pool."""
        storages = {b.flat_shard.untyped_storage().data_ptr() for b in self.buckets.values()}
        return storages | {p.untyped_storage().data_ptr() for p in self.pool.buffers}

    def gradient_storages(self) -> set[int]:
        """Data pointers of the buffers a reduced gradient can live in: the gradient shards alive
        (held by ``.grad``), and the pool (a bucket that reduces in place there:
        ``BucketLayout.reduces_in_pool``)."""
        storages = set().union(*(b.grad_shard_storages() for b in self.buckets.values()))
        return storages | {p.untyped_storage().data_ptr() for p in self.pool.buffers}

    @property
    def allocations(self) -> int:
        """Pool buffers allocated so far (gradient shards, allocated every step as the
        gradients they are, are not counted)."""
        return self.pool.allocations

    def slot_plan(self, module) -> SlotPlan:
        """The pool a step of ``module``'s last compiled traces needs, planned from the live
        intervals of their bucket buffers (:mod:`thunder_overlap._analysis.pool_slots`): after a
        step, the same buffers as ``pool.slots``, known before it runs."""
        forward = estimate_memory(thunder.last_traces(module)[-1])
        return estimate_memory(thunder.last_backward_traces(module)[-1], after=forward).pool

    @staticmethod
    def of(module) -> BucketingTransform | None:
        """The bucketing transform of a module ``thunder_overlap.fsdp`` returned, if any."""
        from thunder import compile_data

        return next((t for t in compile_data(module).transforms if isinstance(t, BucketingTransform)), None)

    # --- module -----------------------------------------------------------------------------

    @property
    def plan_summary(self) -> BucketPlanSummary | None:
        """Which buckets were formed and why; None before ``transform_module``."""
        summary = self.summaries.get("plan")
        return summary if isinstance(summary, BucketPlanSummary) else None

    def plan_digest(self) -> str | None:
        """The plan's hash, which ranks compare before their first collective."""
        summary = self.plan_summary
        return summary.digest if summary is not None else None

    def largest_bucket_bytes(self) -> int | None:
        """The largest bucket's gathered (unsharded, padded) bytes; None before planning."""
        summary = self.plan_summary
        return max((b.unsharded_bytes for b in summary.buckets), default=None) if summary is not None else None

    def transform_module(self, model) -> None:
        owners = bucket_owner(model._model, self.strategy, self.block_types)
        shared = model._get_shared_names()
        shards = list(model.named_parameters())
        plans = self._plan(model, shards, owners)
        logger.info("%s", self.summaries["plan"])
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

    def _plan(self, model, shards: list[tuple[str, torch.Tensor]], owners: dict[str, str]) -> list[BucketPlan]:
        world_size = self.process_group.size()
        # The same cost model the scheduler uses by default; only its network is read, so ranks
        # with other measured compute timings still plan alike.
        device = shards[0][1].device if shards else torch.device("cpu")
        cost_model = self.config.cost_model if self.config.cost_model is not None else CostModel.for_device(device, world_size)
        if self.strategy is BucketingStrategy.AUTO:
            caps = self._auto_caps(model, shards, owners)
            plans, summary = plan_auto_buckets(
                shards,
                owners,
                world_size=world_size,
                cost_model=cost_model,
                latency_share=self.config.auto_bucket_latency_share,
                caps=caps,
                replicas=self._replicas(cost_model),
                merges_copy=not runs_coalesced_launches_as_one(self.process_group, device),
            )
            self.summaries["plan"] = summary
            return plans
        planned = plan_buckets_with_ends(shards, owners, world_size=world_size, cap_bytes=self.cap_bytes)
        cap = (self.cap_bytes, "bucket_cap_mb") if self.cap_bytes is not None else (None, None)
        self.summaries["plan"] = summarize_plans(
            planned, owners, strategy=self.strategy, world_size=world_size, cost_model=cost_model, cap=cap
        )
        return [plan for plan, _ in planned]

    def _replicas(self, cost_model: CostModel) -> Replicas | None:
        if self.replicate_group is None:
            return None
        return Replicas(self.replicate_group.size(), cost_model.network_of_group(self.replicate_group))

    def _auto_caps(self, model, shards: list[tuple[str, torch.Tensor]], owners: dict[str, str]) -> AutoBucketCaps:
        # The schedule's limits, resolved as OverlapScheduleTransform resolves them, with the
        # largest block measured as gathered (padding included), which is what its collectives
        # move: otherwise padding alone would keep two blocks out of a two-block limit. The cap
        # is the limit itself (prefetch_blocks), not the eager part of it for buckets: a bucket
        # at the cap is the unit the schedule then counts in, one of them eagerly ahead.
        blocks = {name for name, _ in find_blocks(model._model, self.block_types)}
        gathered: dict[str, int] = {}
        for name, shard in shards:
            if owners[name] in blocks:
                gathered[owners[name]] = gathered.get(owners[name], 0) + unsharded_bytes_of(shard, self.process_group.size())
        limits = self.config.limits(max(gathered.values(), default=None))
        # Only the budget's fixed slack: its ratio part follows the activations' shapes, which
        # ranks need not share, and the plan must be the same on every rank.
        slack = limits.memory_budget.slack_bytes if limits.memory_budget is not None else None
        return AutoBucketCaps(
            bucket_cap_bytes=self.cap_bytes,
            prefetch_bytes=limits.max_allgather_bytes,
            memory_slack_bytes=slack or None,
        )

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
