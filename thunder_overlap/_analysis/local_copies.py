"""Bytes the bucketed collectives copy in local memory, the launches they make, and the pool
buffers their reduce-scatters hold until the wait: what the cost model and the scheduler need of
a bucket operator beyond what it moves.

A bucketed collective's start may lay the bucket's tensors out for the launch and its wait may lay
the result out for its readers (``_bucketing/buffers.py``). Those copies run on the compute
stream, before the launch and after the wait, at memory bandwidth; :meth:`CostModel.local_copy_ms`
turns the bytes counted here into time. What each operator copies follows the bucket's paths
(:mod:`~thunder_overlap._analysis.layout`; ``U`` is the bucket's unsharded bytes, ``G`` its gradients'):

- ``bucket_all_gather``: nothing, the flat shard it sends being the parameters' storage; with mixed
  precision, the cast of the flat shard into the gather dtype (read and written once).
- ``bucket_all_gather_wait``: ``2 U`` for a copy-out, else nothing.
- ``bucket_reduce_scatter``: ``G + U`` for the ``_chunk_cat`` that lays the gradients out (and
  pads them), ``2 U`` more for the in-place pre-average when it divides, ``2 U`` more where it
  goes from the backend's copy. Sending its gradients where they are, it only averages the
  received shard, ``2 U / world_size`` (done at the wait, counted here).
- ``coalesced_bucket_all_gather``, ``coalesced_bucket_reduce_scatter`` and the ``coalesced_wait``
  of a ``coalesced_bucket_all_gather``: each member as alone (the wait names no bucket, so its bytes come from the issue:
  :data:`WAIT_COPY_BYTES`).
- ``bucket_accumulate_grads`` (no_sync): the lay-out (``G + U``) and the sum into the kept
  gradients (``3 U``), with ``U`` taken as ``G``.

An operator in neither table copies nothing (Thunder's per-parameter collectives send and receive
the tensors the trace names). Adding an operator is one entry in :data:`LOCAL_COPY_BYTES`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist
from thunder.core.proxies import FutureTensorProxy, TensorProxy
from thunder.core.symbol import BoundSymbol

from thunder_overlap import _ops as ops
from thunder_overlap._analysis.layout import BucketLayout, BucketLayouts, GatherPath, ReducePath, layout_of

__all__ = ["LOCAL_COPY_BYTES", "WAIT_COPY_BYTES", "LocalCopyBytes", "backend_launches", "local_copy_bytes", "pool_bytes_to_wait"]

# Bytes read plus bytes written by one operator's local copies, from its bound symbol and the
# layouts of the buckets it names.
LocalCopyBytes = Callable[[BoundSymbol, BucketLayouts], int]




def _bytes(t: TensorProxy) -> int:
    return ops.numel(t) * t.dtype.bytes


def _futures(values) -> list[FutureTensorProxy]:
    return [v for v in values if isinstance(v, FutureTensorProxy)]


def _tensors(values) -> list[TensorProxy]:
    return [v for v in values if isinstance(v, TensorProxy) and not isinstance(v, FutureTensorProxy)]


def no_copy(bsym: BoundSymbol, layouts: BucketLayouts) -> int:
    return 0


def _cast_bytes(layout: BucketLayout) -> int:
    """Mixed precision: the flat shard read in the parameters' dtype, written in the gather dtype."""
    if not layout.casts_for_gather:
        return 0
    return layout.unsharded_numel // layout.world_size * (layout.itemsize + layout.gather_itemsize)


def all_gather_cast(bsym: BoundSymbol, layouts: BucketLayouts) -> int:
    """The cast of the flat shard before the gather (mixed precision only)."""
    return _cast_bytes(layout_of(layouts, bsym.args[0]))


def coalesced_all_gather_cast(bsym: BoundSymbol, layouts: BucketLayouts) -> int:
    return sum(_cast_bytes(layout_of(layouts, bucket)) for bucket, _, _ in bsym.args[1])


def all_gather_copy_out(bsym: BoundSymbol, layouts: BucketLayouts) -> int:
    """Reads and writes the gathered bucket once where it copies out."""
    if layout_of(layouts, bsym.args[1]).gather is not GatherPath.COPY_OUT:
        return 0
    (gathered,) = _futures(bsym.flat_args)
    return 2 * _bytes(gathered)


def _laid_out_bytes(bsym: BoundSymbol, gradient_bytes: int) -> int:
    """The reduce-scatter input: the shard the future holds on every rank (padding included)."""
    groups = [a for a in bsym.args if isinstance(a, dist.ProcessGroup)]
    futures = _futures(bsym.flat_outs)
    if len(groups) != 1 or len(futures) != 1:
        return gradient_bytes
    return groups[0].size() * _bytes(futures[0])


def reduce_scatter_copy_in(bsym: BoundSymbol, layouts: BucketLayouts) -> int:
    """``_chunk_cat`` of the gradients into the laid-out input, the pre-average in place and the
    backend's copy of it where the bucket reduces from that copy; a bucket that sends its
    gradients where they are only averages the received shard."""
    layout = layout_of(layouts, bsym.args[0])
    gradients = sum(_bytes(t) for t in _tensors(bsym.flat_args))
    divides = bsym.args[-1] is not None
    if layout.reduce is ReducePath.SEND:
        shard = sum(_bytes(f) for f in _futures(bsym.flat_outs))
        return 2 * shard if divides else 0
    laid_out = _laid_out_bytes(bsym, gradients)
    backend_copy = 2 * laid_out if layout.reduce is ReducePath.FROM_COPY else 0
    return gradients + laid_out + (2 * laid_out if divides else 0) + backend_copy


def accumulate_copy(bsym: BoundSymbol, layouts: BucketLayouts) -> int:
    """``_chunk_cat`` of the gradients, then ``sum += laid_out`` (two reads, one write)."""
    gradients = sum(_bytes(t) for t in _tensors(bsym.flat_args))
    laid_out = gradients
    return gradients + laid_out + 3 * laid_out


def coalesced_reduce_scatter_copy_in(bsym: BoundSymbol, layouts: BucketLayouts) -> int:
    """Each bucket of a coalesced launch lays out and pre-averages as when launched alone
    (padding not counted: the operator names buckets, not their padded sizes), or, sending its
    gradients where they are, averages its received shard."""
    group, members, grads = bsym.args[:3]
    total = 0
    for (bucket, divisor, _), member_grads in zip(members, grads, strict=True):
        gradients = sum(_bytes(t) for t in member_grads)
        if layout_of(layouts, bucket).reduce is ReducePath.SEND:
            world_size = 1 if group is None else group.size()
            total += 2 * gradients // world_size if divisor is not None else 0
        else:
            total += 2 * gradients + (2 * gradients if divisor is not None else 0)
    return total


def coalesced_all_gather_copy_out(issue: BoundSymbol, layouts: BucketLayouts) -> int:
    """The copy-out of every member bucket that copies out, from the coalesced issue: a member's
    gathered ranks are ``world_size`` times the shards it sends, in its gather dtype."""
    group, members, shards = issue.args[:3]
    total = 0
    for (bucket, _, _), member in zip(members, shards, strict=True):
        layout = layout_of(layouts, bucket)
        if layout.gather is GatherPath.COPY_OUT:
            total += 2 * group.size() * sum(ops.numel(s) for s in member) * layout.gather_itemsize
    return total


# Copies a wait makes that only its collective's issue can count, by the issue's symbol id.
WAIT_COPY_BYTES: dict[str, LocalCopyBytes] = {
    ops.coalesced_bucket_all_gather.id: coalesced_all_gather_copy_out,
}

# By the operator's symbol id.
LOCAL_COPY_BYTES: dict[str, LocalCopyBytes] = {
    ops.bucket_all_gather.id: all_gather_cast,
    ops.bucket_all_gather_wait.id: all_gather_copy_out,
    ops.bucket_reduce_scatter.id: reduce_scatter_copy_in,
    ops.bucket_reduce_scatter_wait.id: no_copy,
    ops.bucket_accumulate_grads.id: accumulate_copy,
    ops.coalesced_bucket_all_gather.id: coalesced_all_gather_cast,
    ops.coalesced_bucket_reduce_scatter.id: coalesced_reduce_scatter_copy_in,
}


def backend_launches(bsym: BoundSymbol, layouts: BucketLayouts) -> int:
    """Launches a collective's issue makes the backend pay a latency for: one, unless a bucket
    gathers each parameter in place on a backend that runs a coalesced launch one collective at
    a time (``BucketLayout.gather_launches``). A coalesced launch counts once, plus each member's
    launches beyond its first."""
    op = bsym.sym.id
    if op == ops.bucket_all_gather.id:
        return layout_of(layouts, bsym.args[0]).gather_launches()
    if op == ops.coalesced_bucket_all_gather.id:
        return 1 + sum(layout_of(layouts, bucket).gather_launches() - 1 for bucket, _, _ in bsym.args[1])
    return 1


def pool_bytes_to_wait(bsym: BoundSymbol, layouts: BucketLayouts) -> int:
    """Bytes of bucket pool buffers a reduce-scatter's issue keeps busy until its wait
    (``BucketLayout.reduce_scatter_holds_pool_buffer``); 0 for every other collective."""
    op = bsym.sym.id
    if op == ops.bucket_reduce_scatter.id:
        layout = layout_of(layouts, bsym.args[0])
        return layout.nbytes if layout.reduce_scatter_holds_pool_buffer() else 0
    if op == ops.coalesced_bucket_reduce_scatter.id:
        members = [layout_of(layouts, bucket) for bucket, _, _ in bsym.args[1]]
        return sum(layout.nbytes for layout in members if layout.reduce_scatter_holds_pool_buffer(coalesced=True))
    return 0


def local_copy_bytes(bsym: BoundSymbol, layouts: BucketLayouts, issued_by: BoundSymbol | None = None) -> int:
    """Bytes ``bsym`` copies in local memory (0 for an operator in neither table). For a wait,
    ``issued_by`` is its collective's issue, which counts what the wait cannot name."""
    if issued_by is not None and issued_by.sym.id in WAIT_COPY_BYTES:
        return WAIT_COPY_BYTES[issued_by.sym.id](issued_by, layouts)
    count = LOCAL_COPY_BYTES.get(bsym.sym.id)
    return 0 if count is None else count(bsym, layouts)
