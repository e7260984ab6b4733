"""Reduce-scatters that run in place in the bucket pool, chosen from the final backward schedule.

A bucket's gradient shard normally lives in a buffer of its own beside the pool
(:class:`~thunder_overlap._bucketing.buffers.BucketBuffers`), allocated once and alive from the
reduce-scatter to the optimizer step; meanwhile pool buffers whose last use is over sit idle to
the end of the step (in ZeRO2, every gathered bucket once its block's backward is done). Where
the schedule leaves such a buffer idle from a reduce-scatter's issue to the step's end, the
reduce-scatter runs in place in it and this rank's row is the shard
(:func:`~thunder_overlap._analysis.pool_slots.plan_shards_in_pool` chooses, so the pool does not
grow). That changes the collective a bucket launches on NCCL (one reduce-scatter of the laid-out
buffer rather than one per gradient), so ranks agree on the choice at the first compile of the
backward, and keep it through retraces, as they keep their issue order.
"""

from __future__ import annotations

import torch.distributed as dist

from thunder_overlap._analysis.memory_estimate import MemoryEstimate
from thunder_overlap._analysis.pool_slots import ReduceScatterIssue, plan_shards_in_pool
from thunder_overlap._bucketing.buffers import lookup_bucket
from thunder_overlap._scheduling.rank_agreement import agreed_subset

__all__ = ["reduce_in_pool_where_idle", "shards_in_pool"]


def shards_in_pool(backward: MemoryEstimate) -> list[ReduceScatterIssue]:
    """The reduce-scatters of ``backward`` (the final backward trace's estimate, made after its
    forward's) that can run in place in a pool buffer idle to the step's end."""
    return plan_shards_in_pool(backward.pool_intervals, backward.reduce_scatter_issues, backward.timeline_end)


def reduce_in_pool_where_idle(backward: MemoryEstimate, group: dist.ProcessGroup | None, *, exchange: bool) -> list[str]:
    """Switches the buckets whose reduce-scatter in ``backward`` (the final backward trace's
    estimate, made after its forward's) can run in place in an idle pool buffer to do so, as
    agreed with the other ranks of ``group`` when ``exchange``; returns their labels."""
    chosen = shards_in_pool(backward)
    labels = [issue.layout.label for issue in chosen]
    if exchange:
        labels = agreed_subset(labels, group)
    for issue in chosen:
        if issue.layout.label in labels:
            lookup_bucket(issue.bucket_id).reduce_in_pool()
    return labels
