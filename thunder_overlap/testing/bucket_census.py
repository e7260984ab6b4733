"""What the last training step did to the bucket buffers, op by op: the census the bucketing
tests assert (copies, allocations, paths taken, the pool against its plan)."""

from __future__ import annotations

import collections
from dataclasses import dataclass

import torch

from thunder_overlap import _ops as ops
from thunder_overlap._analysis.layout import GatherPath, ReducePath
from thunder_overlap._bucketing.plan_choice import PLANS_TIED, BucketPlanChoice
from thunder_overlap._transforms import BucketingTransform
from thunder_overlap._transforms.zero3 import Zero3Transform
from thunder_overlap.testing.op_census import COPY_OPS, OpCensus

__all__ = ["BucketCensus", "bucket_census"]


@dataclass
class BucketCensus:
    """What the last training step (not the first) did to the bucket buffers, op by op."""

    # Bucketed collectives in the final traces.
    forward_all_gathers: int
    backward_all_gathers: int
    reduce_scatters: int
    buckets: int
    frozen_buckets: int
    # Buckets of more than one parameter (only those need a copy-out after gathering).
    multi_parameter_labels: tuple[str, ...]
    # The buckets ZeRO3 keeps gathered from the forward to the backward, which the backward does
    # not gather again ([Note: ZeRO3 keeps what is free]); none under ZeRO2.
    kept_buckets: tuple[str, ...]
    # Trainable buckets that lay their gradients out for the reduce-scatter: those with a
    # parameter Thunder padded, and those of several tensors where the backend runs coalesced
    # reduce-scatters one by one (gloo). The others send their gradients where they are.
    laid_out_buckets: int
    # Laid-out buckets that all-reduce their own buffer in place and copy their row out (where
    # the backend's reduce-scatter would copy its input: gloo), outside coalesced launches.
    reduced_in_place: int
    # Labels of the laid-out buckets that hand their buffer to the backend's copy instead, as
    # chosen from the memory estimate (ReducePath.FROM_COPY).
    reduces_from_copy: tuple[str, ...]
    # Labels of the buckets that reduce in place in a pool buffer whose row is their gradient
    # shard (ReducePath.IN_POOL): all-reduced in place, they copy no row out.
    reduced_in_pool: tuple[str, ...]
    # Labels of the buckets that, over a backend running a coalesced launch one collective at a
    # time, gather each parameter in place, as chosen from the memory estimate
    # (GatherPath.IN_PLACE over gloo).
    per_tensor_gathers: tuple[str, ...]
    # reduce_scatter_tensor calls per step: one per other laid-out bucket, one per gradient of the rest.
    reduce_scatter_calls: int
    # Copy ops that read or wrote a bucket buffer, by aten op name.
    bucket_copies: dict[str, int]
    # Copies the process group makes inside one reduce_scatter_tensor of its own (gloo reduces
    # into a scratch buffer and copies the rank's chunk out; NCCL makes none).
    backend_copies_per_reduce_scatter: int
    # Ops of the step that allocated a storage which is now a persistent bucket buffer (a flat
    # shard or the pool).
    bucket_allocations: int
    # Gradient shards alive after the step that the step allocated (one per bucket not reduced
    # in the pool: the gradient itself, given back when .grad is dropped).
    gradient_shard_allocations: int
    # Every pad of the step (bucketing pads the gradients inside its _chunk_cat).
    pads: int
    allocations_after_first_step: int
    allocations_after_last_step: int
    # The shared pool of unsharded buffers: numel -> how many buffers of that size it holds,
    # and each bucket's unsharded numel.
    pool_buffers: dict[int, int]
    # Per pool buffer, what used it ("blocks.0 all-gather", "blocks.0 reduce-scatter", ...).
    pool_users: list[tuple[str, ...]]
    # The same, as the memory estimator plans them from the final traces (BucketingTransform.slot_plan).
    planned_pool_buffers: dict[int, int]
    planned_pool_users: list[tuple[str, ...]]
    bucket_numels: list[int]
    # Whether every .grad after the step is a view of its bucket's gradient shard.
    grads_are_bucket_views: bool
    # "auto"'s plan against block buckets at the first compile, where they differed ([Note: auto
    # against block]).
    plan_choice: BucketPlanChoice | None = None


def _backend_copies_per_reduce_scatter(group) -> int:
    world = group.size()
    source, out = torch.ones(world * 4), torch.empty(4)
    with OpCensus() as census:
        torch.distributed.reduce_scatter_tensor(out, source, group=group)
    return len(census.copies)


def bucket_census(
    jm,
    bucketing: BucketingTransform,
    census: OpCensus,
    allocations_after_first_step: int,
    unsharded_numels: dict[str, int],
    backward,
) -> BucketCensus:
    zero3 = Zero3Transform.of(jm)
    storages = bucketing.buffer_storages()
    grad_shards = bucketing.gradient_storages()
    shards = grad_shards - storages  # the gradient shards of their own, not rows of the pool
    # A gradient shard is allocated in the step, at an address an earlier temporary of the step
    # may have had: it is the shard only from the last op that allocated there.
    shard_born = {ptr: i for i, r in enumerate(census.records) if r.allocated_bytes > 0 for ptr in r.outputs & shards}
    copies: dict[str, int] = {}
    for i, record in enumerate(census.records):
        touched = record.inputs | record.outputs
        on_shard = any(i >= shard_born.get(ptr, 0) for ptr in touched & shards)
        if record.name in COPY_OPS and (touched & storages or on_shard):
            copies[record.name] = copies.get(record.name, 0) + 1
    grads = [p.grad for p in jm.parameters() if p.requires_grad]
    planned = bucketing.slot_plan(jm)
    trainable = [b for b in bucketing.buckets if b.plan.requires_grad]
    laid_out = [b for b in trainable if b.layout.reduce is not ReducePath.SEND]
    coalesced = [bsym for bsym in backward.bound_symbols if bsym.sym.id == ops.coalesced_bucket_reduce_scatter.id]
    in_coalesced_launch = {id(bucket) for bsym in coalesced for bucket, _, _ in bsym.args[1]}
    lone = [b for b in laid_out if b.layout.backend.copies_reduce_scatter_input and id(b) not in in_coalesced_launch]
    in_place = [b for b in lone if b.layout.reduce is not ReducePath.FROM_COPY]
    gathered_per_parameter = [
        b for b in bucketing.buckets if b.layout.gather is GatherPath.IN_PLACE and not b.layout.backend.runs_coalesced_launch_as_one
    ]
    return BucketCensus(
        forward_all_gathers=bucketing.summaries.forward.all_gathers,
        backward_all_gathers=bucketing.summaries.backward.all_gathers,
        reduce_scatters=bucketing.summaries.backward.reduce_scatters,
        buckets=len(bucketing.plans),
        frozen_buckets=sum(not p.requires_grad for p in bucketing.plans),
        multi_parameter_labels=tuple(p.label for p in bucketing.plans if len(p.slots) > 1),
        kept_buckets=() if zero3 is None or zero3.choice is None else zero3.choice.kept,
        laid_out_buckets=len(laid_out),
        reduced_in_place=len(in_place),
        reduces_from_copy=tuple(b.plan.label for b in lone if b.layout.reduce is ReducePath.FROM_COPY),
        reduced_in_pool=tuple(b.plan.label for b in trainable if b.layout.reduce is ReducePath.IN_POOL),
        per_tensor_gathers=tuple(b.plan.label for b in gathered_per_parameter),
        reduce_scatter_calls=len(laid_out) - len(in_place) + sum(b.layout.tensors for b in trainable if b not in laid_out),
        bucket_copies=copies,
        backend_copies_per_reduce_scatter=_backend_copies_per_reduce_scatter(bucketing.process_group),
        bucket_allocations=sum(bool(r.outputs & storages) and r.allocated_bytes > 0 for r in census.records),
        gradient_shard_allocations=len(shard_born),
        pads=census.count("constant_pad_nd"),
        allocations_after_first_step=allocations_after_first_step,
        allocations_after_last_step=bucketing.allocations,
        pool_buffers=dict(collections.Counter(b.numel() for b in bucketing.pool.buffers)),
        pool_users=[slot.users for slot in bucketing.pool.slots],
        planned_pool_buffers=dict(collections.Counter(slot.numel for slot in planned.slots)),
        planned_pool_users=[slot.users for slot in planned.slots],
        bucket_numels=[b.gathered_numel() for b in bucketing.buckets],
        grads_are_bucket_views=all(g is not None and g.untyped_storage().data_ptr() in grad_shards for g in grads),
        plan_choice=bucketing.summaries.plan_choice,
    )


def expected_plan(choice: BucketPlanChoice) -> str:
    """The plan a choice between ``"auto"``'s and block buckets must have run, by its predictions:
    ``"auto"``'s only where faster beyond a tie ([Note: auto against block])."""
    return "auto" if choice.step_ms["auto"] < choice.step_ms["block"] * (1 - PLANS_TIED) else "block"
