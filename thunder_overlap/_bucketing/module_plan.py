"""The buckets of one sharded module: planned by strategy, and laid out in persistent buffers.

:func:`plan_module_buckets` groups the module's shards (layer, block, or ``"auto"``, sized by the
cost model within the schedule's limits); :func:`make_buckets` moves each bucket's shards into its
flat buffer, with the layout its backend gives it by default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from thunder_overlap._analysis.cost_model import CostModel
from thunder_overlap._analysis.layout import BucketLayout
from thunder_overlap._backends import backend_of
from thunder_overlap._bucketing.auto_plan import AutoBucketCaps, Replicas, plan_auto_buckets
from thunder_overlap._bucketing.buffers import BucketBuffers
from thunder_overlap._bucketing.plan import (
    BucketPlan,
    BucketPlanSummary,
    gather_dtype_of,
    plan_buckets_with_ends,
    summarize_plans,
    unsharded_bytes_of,
)
from thunder_overlap._bucketing.pool import BufferPool
from thunder_overlap._scheduling.limits import resolve_limits
from thunder_overlap.config import OverlapConfig
from thunder_overlap.options import BucketingStrategy, MixedPrecision

__all__ = ["ModuleBuckets", "bucket_slots", "make_buckets", "plan_module_buckets"]


@dataclass(frozen=True)
class ModuleBuckets:
    """What the plan needs to know of the module: its shards (name, sharded parameter, in
    first-use order, each tensor once), the owner each is bucketed with, where they live, and the
    dtypes they are gathered in (sizes count what each all-gather moves)."""

    shards: list[tuple[str, torch.Tensor]]
    owners: dict[str, str]
    block_names: set[str]
    process_group: dist.ProcessGroup
    replicate_group: dist.ProcessGroup | None = None
    mixed_precision: MixedPrecision | None = None

    @property
    def device(self) -> torch.device:
        return self.shards[0][1].device if self.shards else torch.device("cpu")


def plan_module_buckets(
    module: ModuleBuckets, strategy: BucketingStrategy, cap_bytes: int | None, config: OverlapConfig
) -> tuple[list[BucketPlan], BucketPlanSummary]:
    """The module's bucket plans and why each was formed."""
    world_size = module.process_group.size()
    # The scheduler's default cost model; only its network is read, so ranks with other measured
    # compute timings still plan alike.
    cost_model = config.cost_model if config.cost_model is not None else CostModel.for_device(module.device, world_size)
    if strategy is not BucketingStrategy.AUTO:
        mixed_precision = module.mixed_precision
        planned = plan_buckets_with_ends(
            module.shards, module.owners, world_size=world_size, cap_bytes=cap_bytes, mixed_precision=mixed_precision
        )
        cap = (cap_bytes, "bucket_cap_mb") if cap_bytes is not None else (None, None)
        summary = summarize_plans(
            planned,
            module.owners,
            strategy=strategy,
            world_size=world_size,
            cost_model=cost_model,
            cap=cap,
            mixed_precision=mixed_precision,
        )
        return [plan for plan, _ in planned], summary
    replicas = None
    if module.replicate_group is not None:
        replicas = Replicas(module.replicate_group.size(), cost_model.network_of_group(module.replicate_group))
    return plan_auto_buckets(
        module.shards,
        module.owners,
        world_size=world_size,
        cost_model=cost_model,
        latency_share=config.tuning.auto_bucket_latency_share,
        caps=_auto_caps(module, cap_bytes, config),
        replicas=replicas,
        merges_copy=not backend_of(module.process_group, module.device).runs_coalesced_launch_as_one,
        mixed_precision=module.mixed_precision,
    )


def _auto_caps(module: ModuleBuckets, cap_bytes: int | None, config: OverlapConfig) -> AutoBucketCaps:
    # The schedule's limits, with the largest block measured as gathered (padding included),
    # which is what its collectives move: otherwise padding alone would keep two blocks out of a
    # two-block limit. A bucket at the cap is the unit the schedule then counts in.
    world_size = module.process_group.size()
    gathered: dict[str, int] = {}
    for name, shard in module.shards:
        owner = module.owners[name]
        if owner in module.block_names:
            gathered[owner] = gathered.get(owner, 0) + unsharded_bytes_of(shard, world_size, module.mixed_precision)
    limits = resolve_limits(config, max(gathered.values(), default=None))
    # Only the budget's fixed slack: its ratio part follows the activations' shapes, which ranks
    # need not share, and the plan must be the same on every rank.
    slack = limits.memory_budget.slack_bytes if limits.memory_budget is not None else None
    return AutoBucketCaps(bucket_cap_bytes=cap_bytes, prefetch_bytes=limits.max_allgather_bytes, memory_slack_bytes=slack or None)


def make_buckets(
    plans: list[BucketPlan],
    shards: dict[str, torch.Tensor],
    unsharded_numels: dict[str, int],
    process_group: dist.ProcessGroup,
    mixed_precision: MixedPrecision | None = None,
    *,
    priced_only: bool = False,
) -> tuple[list[BucketBuffers], BufferPool]:
    """One :class:`BucketBuffers` per plan, the shards copied into its flat buffer, all on one
    pool; ``unsharded_numels`` (by parameter name, before padding) tell which buckets pad, and
    ``mixed_precision`` which dtype each bucket gathers in. ``priced_only``: buckets that only
    price a step, their buffers on the meta device (no memory, nothing copied), laid out for the
    shards' device."""
    pool = BufferPool()
    buckets = []
    world_size = process_group.size()
    for plan in plans:
        first = shards[plan.slots[0].name]
        flat = torch.empty(plan.shard_numel, dtype=plan.dtype, device="meta" if priced_only else first.device)
        gather_dtype = gather_dtype_of(plan.dtype, mixed_precision)
        layout = BucketLayout.default(
            plan.label,
            unsharded_numel=world_size * plan.shard_numel,
            dtype=str(flat.dtype),
            itemsize=flat.element_size(),
            tensors=len(plan.slots),
            world_size=world_size,
            backend=backend_of(process_group, first.device),
            padded=sum(unsharded_numels[s.name] for s in plan.slots) != world_size * plan.shard_numel,
            gather_dtype=str(gather_dtype),
            gather_itemsize=gather_dtype.itemsize,
        )
        bucket = BucketBuffers(plan, flat, process_group, pool, layout, gather_dtype)
        for index, slot in enumerate(plan.slots):
            if not priced_only:
                with torch.no_grad():
                    bucket.shard_view(index).copy_(shards[slot.name])
        buckets.append(bucket)
    return buckets, pool


def bucket_slots(buckets: list[BucketBuffers], aliases: dict[str, list[str]]) -> dict[str, tuple[int, int]]:
    """Each parameter's (every one of its ``aliases``') (index into ``buckets``, slot)."""
    return {
        alias: (index, slot_index)
        for index, bucket in enumerate(buckets)
        for slot_index, slot in enumerate(bucket.plan.slots)
        for alias in aliases[slot.name]
    }


def unsharded_numel(model: nn.Module, name: str) -> int:
    """Elements of parameter ``name`` of the original (unsharded, possibly meta) module."""
    return math.prod(model.get_parameter(name).shape)
