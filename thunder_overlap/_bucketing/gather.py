"""A bucket's all-gather, by its gather path (``_analysis/layout.py``).

- ``VIEWS``: one tensor (or one rank): the flat shard gathered into a pool buffer, whose views
  are the parameters.
- ``IN_PLACE``: each parameter gathered straight into its place in the buffer, one coalesced
  launch (one launch on NCCL; gloo runs it one collective at a time): the buffer is
  parameter-major as it arrives and its views are the parameters.
- ``COPY_OUT``: the flat shard gathered rank-major with one launch, the parameters copied out of
  it with one ``split_with_sizes_copy`` into a second pool buffer.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from thunder_overlap._analysis.layout import GatherPath
from thunder_overlap._bucketing.pool import PendingCollective
from thunder_overlap._bucketing.state import BucketState

__all__ = ["copy_out", "launch", "prepare"]


def prepare(bucket: BucketState, shards: list[torch.Tensor], slots: tuple[int, ...]) -> PendingCollective:
    """Everything before the launch: checks the shards, casts them for the gather (mixed precision)
    and takes an output buffer."""
    bucket.check_is_flat_shard(shards, slots)
    bucket.cast_for_gather()
    return PendingCollective(None, bucket.acquire("all-gather", gathered=True))


def launch(bucket: BucketState, pending: PendingCollective, *, async_op: bool) -> dist.Work | None:
    """Issues the prepared all-gather; inside a ``_coalescing_manager`` it only joins that launch
    (``async_op=False``)."""
    pending.mark_launch()
    group = bucket.process_group
    if bucket.layout.gather is not GatherPath.IN_PLACE:
        return dist.all_gather_into_tensor(pending.result, bucket.gather_shard, group=group, async_op=async_op)
    world = bucket.world_size
    places = [pending.result[world * s.offset : world * (s.offset + s.numel)] for s in bucket.plan.slots]
    if async_op:
        with dist._coalescing_manager(group, async_ops=True) as manager:
            for place, shard in zip(places, bucket.gather_pieces, strict=True):
                dist.all_gather_into_tensor(place, shard, group=group)
        return manager
    work = None
    for place, shard in zip(places, bucket.gather_pieces, strict=True):
        work = dist.all_gather_into_tensor(place, shard, group=group, async_op=async_op)
    return work


def copy_out(bucket: BucketState, gathered: torch.Tensor, slots: tuple[int, ...]) -> list[torch.Tensor]:
    """The unsharded parameters of ``slots`` from a finished gather, with at most one copy: a
    rank-major gather needs its rows from every rank next to each other."""
    world, plan = bucket.world_size, bucket.plan
    unsharded = bucket.acquire("copy-out", gathered=True) if bucket.layout.gather is GatherPath.COPY_OUT else gathered
    pieces = [unsharded[world * s.offset : world * (s.offset + s.numel)] for s in plan.slots]
    if unsharded is not gathered:
        torch.split_with_sizes_copy(
            gathered.view(world, plan.shard_numel),
            [s.numel for s in plan.slots],
            dim=1,
            out=[p.view(world, s.numel) for p, s in zip(pieces, plan.slots, strict=True)],
        )
    return [pieces[i].view(bucket.unsharded_shape(i)) for i in slots]
