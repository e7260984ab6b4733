"""Bytes the bucketed collectives copy in local memory, on the compute stream, the launches
they make, and the pool buffers their reduce-scatters hold until the wait.

A bucketed collective does more than launch: its start may lay the bucket's tensors out for the
launch and its wait may lay the result out for its readers (:mod:`thunder_overlap._bucketing.buffers`).
Those copies run on the compute stream, before the launch and after the wait, at memory
bandwidth; :meth:`CostModel.local_copy_ms` turns the bytes counted here into time and the
simulator runs it at the operator's node.

:data:`LOCAL_COPY_BYTES` maps an operator's name to a function of its bound symbol that returns
the bytes it reads plus the bytes it writes, computed from the symbol's proxies. An operator that
is not in the table copies nothing (Thunder's per-parameter collectives send and receive the
tensors the trace names). Adding an operator, a coalesced one included, is one entry here: reuse
the helpers below or write a function of the same shape.

What each bucket operator copies (``U`` is the bucket's unsharded bytes, ``G`` its gradients'):

- ``bucket_all_gather``: nothing; the flat shard it sends is the parameters' storage.
- ``bucket_all_gather_wait``: ``2 U``, the ``split_with_sizes_copy`` from the rank-major gather
  output to the parameter-major layout; nothing when the bucket holds one tensor (views suffice)
  or gathers each parameter in place (on NCCL: ``BucketLayout.copies_out``).
- ``bucket_reduce_scatter``: ``G + U`` for the ``_chunk_cat`` that lays the gradients out (and
  pads them), plus ``2 U`` for the in-place pre-average when it divides. A bucket that sends its
  gradients where they are (one that needs no padding, of one gradient or on NCCL: see
  ``BucketLayout.sends_gradients``) only averages the received shard, ``2 U / world_size``, done
  at the wait but counted here (the wait cannot tell), nothing without a divisor. A bucket whose
  reduce-scatter hands the laid-out buffer to the backend's copy (gloo:
  ``BucketLayout.reduce_scatter_from_copy``) adds that copy, ``2 U``. Gradients
  summed under no_sync add ``2 U`` once, on the step after; not counted.
- ``bucket_reduce_scatter_wait``: nothing; the reduce-scatter wrote the gradient shard in place.
- ``coalesced_bucket_reduce_scatter``: each member bucket's lay-out and pre-average (or shard
  average), as alone.
- ``coalesced_wait`` of a ``coalesced_bucket_all_gather``: each member bucket's copy-out, as
  alone (``2 U`` for a bucket of several tensors that copies out). The wait names no bucket, so these bytes come
  from the issue (:data:`WAIT_COPY_BYTES`, keyed by the issue's name).
- ``bucket_accumulate_grads`` (no_sync): the ``_chunk_cat`` (``G + U``) and the sum into the kept
  gradients (``3 U``), with ``U`` taken as ``G``: this operator has no process group to pad by.

A bucketed collective is one launch, except where a bucket gathers each parameter in place on a
backend that runs a coalesced launch one collective at a time (gloo; chosen per bucket by
:mod:`~thunder_overlap._bucketing.per_tensor_gathers`): it then pays a latency per parameter
(:func:`backend_launches`, which :class:`~thunder_overlap._analysis.classify.Collective` records).
A reduce-scatter that lays its gradients out into a pool buffer and reduces them in place there
keeps that buffer busy until its wait (:func:`pool_bytes_to_wait`), which the scheduler caps.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch.distributed as dist
from thunder.core.proxies import FutureTensorProxy, TensorProxy
from thunder.core.symbol import BoundSymbol

__all__ = ["LOCAL_COPY_BYTES", "WAIT_COPY_BYTES", "LocalCopyBytes", "backend_launches", "local_copy_bytes", "pool_bytes_to_wait"]

# Bytes read plus bytes written by one operator's local copies, from its bound symbol.
LocalCopyBytes = Callable[[BoundSymbol], int]


def _bytes(t: TensorProxy) -> int:
    return math.prod(int(s) for s in t.shape) * t.dtype.bytes


def _futures(values) -> list[FutureTensorProxy]:
    return [v for v in values if isinstance(v, FutureTensorProxy)]


def _tensors(values) -> list[TensorProxy]:
    return [v for v in values if isinstance(v, TensorProxy) and not isinstance(v, FutureTensorProxy)]


def no_copy(bsym: BoundSymbol) -> int:
    return 0


def _layout(bucket_id: object):
    """The live bucket's layout; None for a bucket not alive (a synthetic trace)."""
    from thunder_overlap._bucketing.buffers import bucket_layout

    return bucket_layout(bucket_id) if isinstance(bucket_id, int) else None


def all_gather_copy_out(bsym: BoundSymbol) -> int:
    """Reads and writes each gathered bucket once, unless its one output is the whole of it or
    the bucket gathers in place."""
    layout = _layout(bsym.args[1])
    if layout is not None and not layout.copies_out:
        return 0
    (gathered,) = _futures(bsym.flat_args)
    outputs = _tensors(bsym.flat_outs)
    if len(outputs) == 1 and _bytes(outputs[0]) == _bytes(gathered):
        return 0
    return 2 * _bytes(gathered)


def _laid_out_bytes(bsym: BoundSymbol, gradient_bytes: int) -> int:
    """The reduce-scatter input: the shard the future holds on every rank (padding included)."""
    groups = [a for a in bsym.args if isinstance(a, dist.ProcessGroup)]
    futures = _futures(bsym.flat_outs)
    if len(groups) != 1 or len(futures) != 1:
        return gradient_bytes
    return groups[0].size() * _bytes(futures[0])


def _sends_gradients(bucket_id: object, grads: list[TensorProxy], *, unpadded: bool) -> bool:
    """Whether the bucket sends these gradients where they are (``BucketLayout.sends_gradients``).
    A bucket not alive (a synthetic trace) is taken to send one gradient as it is if ``unpadded``."""
    layout = _layout(bucket_id)
    if layout is None:
        return len(grads) == 1 and unpadded
    return layout.sends_gradients([math.prod(int(s) for s in g.shape) for g in grads])


def reduce_scatter_copy_in(bsym: BoundSymbol) -> int:
    """``_chunk_cat`` of the gradients into the laid-out input, the pre-average in place and the
    backend's copy of it where the bucket reduces from that copy; a bucket that sends its
    gradients where they are only averages the received shard."""
    grads = _tensors(bsym.flat_args)
    gradients = sum(_bytes(t) for t in grads)
    laid_out = _laid_out_bytes(bsym, gradients)
    divides = bsym.args[-1] is not None
    if _sends_gradients(bsym.args[0], grads, unpadded=laid_out == gradients):
        shard = sum(_bytes(f) for f in _futures(bsym.flat_outs))
        return 2 * shard if divides else 0
    layout = _layout(bsym.args[0])
    backend_copy = 2 * laid_out if layout is not None and layout.reduce_scatter_from_copy else 0
    return gradients + laid_out + (2 * laid_out if divides else 0) + backend_copy


def accumulate_copy(bsym: BoundSymbol) -> int:
    """``_chunk_cat`` of the gradients, then ``sum += laid_out`` (two reads, one write)."""
    gradients = sum(_bytes(t) for t in _tensors(bsym.flat_args))
    laid_out = gradients
    return gradients + laid_out + 3 * laid_out


def coalesced_reduce_scatter_copy_in(bsym: BoundSymbol) -> int:
    """Each bucket of a coalesced launch lays out and pre-averages as when launched alone
    (padding not counted: the operator names buckets, not their padded sizes), or, sending its
    gradients where they are, averages its received shard."""
    group, members, grads = bsym.args[:3]
    total = 0
    for (bucket_id, divisor, _), member_grads in zip(members, grads, strict=True):
        gradients = sum(_bytes(t) for t in member_grads)
        if _sends_gradients(bucket_id, member_grads, unpadded=True):  # padding unknown here
            world_size = 1 if group is None else group.size()
            total += 2 * gradients // world_size if divisor is not None else 0
        else:
            total += 2 * gradients + (2 * gradients if divisor is not None else 0)
    return total


def coalesced_all_gather_copy_out(issue: BoundSymbol) -> int:
    """The copy-out of every member bucket of several tensors that copies out, from the coalesced
    issue: a member's gathered ranks are ``world_size`` times its flat shard (the shards it sends)."""
    group, members, shards = issue.args[:3]
    world_size = group.size()
    if world_size <= 1:
        return 0
    total = 0
    for (bucket_id, _, _), member in zip(members, shards, strict=True):
        layout = _layout(bucket_id)
        if len(member) > 1 and (layout is None or layout.copies_out):
            total += 2 * world_size * sum(_bytes(s) for s in member)
    return total


# Copies a wait makes that only its collective's issue can count, by the issue's name.
WAIT_COPY_BYTES: dict[str, LocalCopyBytes] = {
    "coalesced_bucket_all_gather": coalesced_all_gather_copy_out,
}

LOCAL_COPY_BYTES: dict[str, LocalCopyBytes] = {
    "bucket_all_gather": no_copy,
    "bucket_all_gather_wait": all_gather_copy_out,
    "bucket_reduce_scatter": reduce_scatter_copy_in,
    "bucket_reduce_scatter_wait": no_copy,
    "bucket_accumulate_grads": accumulate_copy,
    "coalesced_bucket_all_gather": no_copy,
    "coalesced_bucket_reduce_scatter": coalesced_reduce_scatter_copy_in,
}


def backend_launches(bsym: BoundSymbol) -> int:
    """Launches a collective's issue makes the backend pay a latency for: one, unless a bucket
    gathers each parameter in place on a backend that runs a coalesced launch one collective at
    a time (``BucketLayout.gather_launches``). A coalesced launch counts once, plus each member's
    launches beyond its first."""
    name = bsym.sym.name
    if name == "bucket_all_gather" and (layout := _layout(bsym.args[0])) is not None:
        return layout.gather_launches()
    if name == "coalesced_bucket_all_gather":
        layouts = [_layout(bucket_id) for bucket_id, _, _ in bsym.args[1]]
        return 1 + sum(layout.gather_launches() - 1 for layout in layouts if layout is not None)
    return 1


def pool_bytes_to_wait(bsym: BoundSymbol) -> int:
    """Bytes of bucket pool buffers a reduce-scatter's issue keeps busy until its wait
    (``BucketLayout.reduce_scatter_holds_pool_buffer``): one unsharded buffer per bucket whose
    gradients it lays out and reduces in place there. 0 for every other collective, and for a
    bucket not alive (a synthetic trace)."""
    name = bsym.sym.name
    if name == "bucket_reduce_scatter":
        members, coalesced = [(bsym.args[0], bsym.args[2])], False
    elif name == "coalesced_bucket_reduce_scatter":
        members, coalesced = [(bucket_id, grads) for (bucket_id, _, _), grads in zip(bsym.args[1], bsym.args[2], strict=True)], True
    else:
        return 0
    total = 0
    for bucket_id, grads in members:
        layout = _layout(bucket_id)
        numels = [math.prod(int(s) for s in g.shape) for g in _tensors(grads)]
        if layout is not None and layout.reduce_scatter_holds_pool_buffer(numels, coalesced=coalesced):
            total += layout.nbytes
    return total


def local_copy_bytes(bsym: BoundSymbol, issued_by: BoundSymbol | None = None) -> int:
    """Bytes ``bsym`` copies in local memory (0 for an operator in neither table). For a wait,
    ``issued_by`` is its collective's issue, which counts what the wait cannot name."""
    if issued_by is not None and issued_by.sym.name in WAIT_COPY_BYTES:
        return WAIT_COPY_BYTES[issued_by.sym.name](issued_by)
    count = LOCAL_COPY_BYTES.get(bsym.sym.name)
    return 0 if count is None else count(bsym)
