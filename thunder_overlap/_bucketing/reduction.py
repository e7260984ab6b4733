"""A bucket's reduce-scatter by its reduce path (``_analysis/layout.py``), hybrid sharding's
all-reduce of the reduced shard, and the no_sync accumulation.

- ``SEND``: each gradient sent where it is into its slot of a new gradient shard, one coalesced
  launch; the shard is averaged once complete. No copy and no pool buffer.
- ``LAID_OUT``: the gradients laid out (and padded) into a pool buffer with one ``_chunk_cat``,
  row r of its (world_size, shard_numel) view being what rank r receives. Where the backend
  copies a reduce-scatter's input (gloo), the buffer is all-reduced in place instead and the wait
  copies this rank's row out: no second copy, the buffer held until the wait.
- ``FROM_COPY``: laid out, then handed to gloo's own copy at the launch: the buffer is free at once.
- ``IN_POOL``: laid out and reduced in place; this rank's row of the buffer is the gradient shard.

A coalesced launch's members keep their buffers (gloo copies them when the launch ends).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from thunder_overlap._analysis.layout import ReducePath
from thunder_overlap._bucketing.pool import PendingCollective, all_reduce_in_place
from thunder_overlap._bucketing.state import BucketState

__all__ = ["accumulate_unsynced", "finish_all_reduce", "launch", "prepare", "reduced_views", "start_all_reduce"]


def _lay_out(bucket: BucketState, grads: list[torch.Tensor], purpose: str) -> torch.Tensor:
    """Every gradient copied (and padded) into a pool buffer with one ``_chunk_cat``."""
    bucket.check_gradient_count(grads)
    laid_out = bucket.acquire(purpose)
    torch._chunk_cat(grads, dim=0, num_chunks=bucket.world_size, out=laid_out.view(bucket.world_size, bucket.plan.shard_numel))
    return laid_out


def _sends(bucket: BucketState, grads: list[torch.Tensor]) -> bool:
    # Gradients summed under no_sync, or of another dtype than the bucket's, go by a lay-out.
    return (
        bucket.layout.reduce is ReducePath.SEND
        and bucket.unsynced_grads is None
        and all(g.dtype == bucket.flat_shard.dtype for g in grads)
    )


def prepare(bucket: BucketState, grads: list[torch.Tensor], divisor: float | None) -> PendingCollective:
    """Everything before the launch: the gradient shard to reduce into and, unless the gradients
    are sent where they are, their lay-out (with the no_sync sum added) pre-averaged."""
    bucket.check_gradient_count(grads)
    in_pool = bucket.layout.reduce is ReducePath.IN_POOL
    shard = None if in_pool else bucket.new_grad_shard()
    if shard is not None and _sends(bucket, grads):
        pieces = [shard[s.offset : s.offset + s.numel] for s in bucket.plan.slots]
        # A gradient can come strided (a transposed matmul's); a collective needs it dense.
        sends = [(piece, g.contiguous().view(-1)) for piece, g in zip(pieces, grads, strict=True)]
        return PendingCollective(None, shard, sends=sends, divide_by=divisor)
    laid_out = _lay_out(bucket, grads, "reduce-scatter in place" if in_pool else "reduce-scatter")
    if bucket.unsynced_grads is not None:
        laid_out.add_(bucket.unsynced_grads)
        bucket.unsynced_grads = None
    if divisor is not None:
        laid_out.div_(divisor)
    if shard is None:
        # This rank's row is the gradient shard, which keeps the buffer busy until its last view dies.
        own_row = laid_out.view(bucket.world_size, bucket.plan.shard_numel)[bucket.process_group.rank()]
        return PendingCollective(None, own_row, source=laid_out)
    return PendingCollective(None, shard, source=laid_out)


def launch(bucket: BucketState, pending: PendingCollective, *, async_op: bool) -> dist.Work | None:
    """Issues the prepared reduce-scatter; inside a ``_coalescing_manager`` it only joins that
    launch (``async_op=False``). Gradients sent where they are go out as one launch of their own."""
    pending.mark_launch()
    group, path = bucket.process_group, bucket.layout.reduce
    if pending.sends is None and async_op and path is ReducePath.FROM_COPY:
        work = dist.reduce_scatter_tensor(pending.result, pending.source, group=group, async_op=True)
        pending.source = None  # gloo copied it at the launch: the pool buffer is free
        return work
    if pending.sends is None and async_op and bucket.layout.backend.copies_reduce_scatter_input:
        # gloo's reduce-scatter would all-reduce a copy of the whole input; the laid-out buffer is
        # ours to overwrite, so the same all-reduce runs on it in place.
        if path is not ReducePath.IN_POOL:  # in the pool, the result is that row already
            pending.row_of_source = group.rank()
        return all_reduce_in_place(pending.source, group)
    if pending.sends is None:
        return dist.reduce_scatter_tensor(pending.result, pending.source, group=group, async_op=async_op)
    if async_op and len(pending.sends) > 1:
        with dist._coalescing_manager(group, async_ops=True) as manager:
            for piece, g in pending.sends:
                dist.reduce_scatter_tensor(piece, g, group=group)
        return manager
    work = None
    for piece, g in pending.sends:  # one alone, or members of the caller's launch
        work = dist.reduce_scatter_tensor(piece, g, group=group, async_op=async_op)
    return work


def reduced_views(bucket: BucketState, pending: PendingCollective, slots: tuple[int, ...]) -> list[torch.Tensor]:
    """The gradient shards of ``slots`` from a finished reduce-scatter (views, no copy), averaged
    in place if the reduce-scatter sent the gradients themselves."""
    pending.sends = None  # the backward may free the gradients now
    if pending.row_of_source is not None:
        pending.result.copy_(pending.source.view(bucket.world_size, -1)[pending.row_of_source])
        pending.row_of_source = None
    if pending.divide_by is not None:
        pending.result.div_(pending.divide_by)
        pending.divide_by = None
    return bucket.slot_views(pending.result, slots)


def start_all_reduce(bucket: BucketState, reduced: list[torch.Tensor], group: dist.ProcessGroup, divisor: float) -> PendingCollective:
    """Sums the bucket's reduced gradient shard over ``group`` in place, pre-divided by
    ``divisor``: one all-reduce on the buffer that ``reduced`` (the views of its reduce-scatter's
    wait) live in."""
    flat = _grad_shard_holding(bucket, reduced[0])
    flat.div_(divisor)
    pending = PendingCollective(None, flat)
    pending.mark_launch()
    pending.work = all_reduce_in_place(flat, group)
    return pending


def finish_all_reduce(bucket: BucketState, pending: PendingCollective, slots: tuple[int, ...]) -> list[torch.Tensor]:
    pending.work.wait()
    pending.settle()
    return bucket.slot_views(pending.result, slots)


def _grad_shard_holding(bucket: BucketState, view: torch.Tensor) -> torch.Tensor:
    storage = view.untyped_storage().data_ptr()
    if storage in bucket.grad_shard_storages():
        # The shard starts its storage (a tensor of its own): its whole flat view.
        return view.new_empty(0).set_(view.untyped_storage(), 0, (bucket.flat_shard.numel(),))
    if bucket.layout.reduce is ReducePath.IN_POOL:
        for buffer in bucket.pool.buffers:
            if buffer.untyped_storage().data_ptr() == storage:
                return buffer.view(bucket.world_size, -1)[bucket.process_group.rank()]
    raise RuntimeError(f"thunder_overlap bucketing: bucket {bucket.plan.label!r} holds no gradient shard that this gradient lives in")


def accumulate_unsynced(bucket: BucketState, grads: list[torch.Tensor], slots: tuple[int, ...]) -> list[torch.Tensor]:
    """Adds the gradients to ``unsynced_grads`` instead of reduce-scattering them (no_sync).

    Returns this rank's part of the sum, shaped like the shards, only so the trace has its
    gradients to return: Thunder hands autograd None under no_sync.
    """
    laid_out = _lay_out(bucket, grads, "reduce-scatter")
    if bucket.unsynced_grads is None:
        bucket.unsynced_grads = laid_out.clone()
    else:
        bucket.unsynced_grads.add_(laid_out)
    own = bucket.unsynced_grads.view(bucket.world_size, bucket.plan.shard_numel)[bucket.process_group.rank()]
    return bucket.slot_views(own, slots)
