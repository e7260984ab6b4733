"""An operator executor that owns FSDP's collectives, so that no fusion executor swallows them.

Thunder's ``torchcompile`` executor can fuse every op the torch executor runs, collectives
included (on CPU, 0.2.6 fuses an all-gather with its wait), and then no scheduler can see or
move them. Claiming all-gather, reduce-scatter and wait here, ahead of the fusion executors,
gives them symbols no fusion executor knows. The implementations are the torch executor's;
only their names change.

The bucketed collectives that :class:`~thunder_overlap._transforms.BucketingTransform` puts in
the traces are operators of this executor too; they run on :mod:`thunder_overlap._bucketing.buffers`.
So are the coalesced launches that :mod:`thunder_overlap._scheduling.launches` makes of several
collectives (:mod:`thunder_overlap._transforms.coalesced`): each issue operator takes the process
group, then a tuple with one entry per member (what ``classify`` counts), then the inputs. And so
are hybrid sharding's all-reduces across replicas (:mod:`thunder_overlap._transforms.replicate`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from thunder.core.proxies import FutureTensorProxy, TensorProxy
from thunder.distributed import prims as dist_prims
from thunder.executors import torchex
from thunder.extend import Executor, FusionExecutor, OperatorExecutor, register_executor

from thunder_overlap._analysis.classify import COALESCED_PREFIX
from thunder_overlap._bucketing import buffers as bucket_buffers
from thunder_overlap._transforms import coalesced

__all__ = [
    "overlap_executor",
    "with_collectives_kept_visible",
    "bucket_all_gather",
    "bucket_all_gather_wait",
    "bucket_reduce_scatter",
    "bucket_reduce_scatter_wait",
    "bucket_accumulate_grads",
    "bucket_all_reduce",
    "bucket_all_reduce_wait",
    "replica_all_reduce",
    "replica_all_reduce_wait",
    "coalesced_all_gather",
    "coalesced_reduce_scatter",
    "coalesced_bucket_all_gather",
    "coalesced_bucket_reduce_scatter",
    "coalesced_wait",
]

overlap_executor = OperatorExecutor("thunder_overlap")
register_executor(overlap_executor)


def _always(*args, **kwargs) -> bool:
    return True


for _prim, _impl in (
    (dist_prims.all_gather, torchex._all_gather_prim_impl),
    (dist_prims.reduce_scatter, torchex._reduce_scatter_prim_impl),
    (dist_prims.wait, torchex._wait_prim_impl),
):
    _op = overlap_executor.register_operator(f"overlap_{_prim.name}", meta=_prim.meta, fn=_impl)
    overlap_executor.register_implementation(_prim, _op, checker=_always)


def _bucket_all_gather_meta(bucket_id: int, group, shards: list[TensorProxy], slots: tuple[int, ...]) -> FutureTensorProxy:
    bucket = bucket_buffers.lookup_bucket(bucket_id)
    return FutureTensorProxy(shape=(bucket.world_size * bucket.plan.shard_numel,), like=shards[0])


def _bucket_all_gather_wait_meta(pending: FutureTensorProxy, bucket_id: int, slots: tuple[int, ...]) -> list[TensorProxy]:
    bucket = bucket_buffers.lookup_bucket(bucket_id)
    return [TensorProxy(like=pending, shape=bucket.unsharded_shape(i)) for i in slots]


def _bucket_reduce_scatter_meta(bucket_id: int, group, grads: list[TensorProxy], divisor: float | None) -> FutureTensorProxy:
    bucket = bucket_buffers.lookup_bucket(bucket_id)
    return FutureTensorProxy(shape=(bucket.plan.shard_numel,), like=grads[0])


def _bucket_reduce_scatter_wait_meta(pending: FutureTensorProxy, bucket_id: int, slots: tuple[int, ...]) -> list[TensorProxy]:
    bucket = bucket_buffers.lookup_bucket(bucket_id)
    return [TensorProxy(like=pending, shape=bucket.plan.slots[i].shard_shape) for i in slots]


def _bucket_accumulate_grads_meta(bucket_id: int, grads: list[TensorProxy], slots: tuple[int, ...]) -> list[TensorProxy]:
    bucket = bucket_buffers.lookup_bucket(bucket_id)
    return [TensorProxy(like=grads[0], shape=bucket.plan.slots[i].shard_shape) for i in slots]


bucket_all_gather = overlap_executor.register_operator(
    "bucket_all_gather", meta=_bucket_all_gather_meta, fn=bucket_buffers.all_gather_bucket
)
bucket_all_gather_wait = overlap_executor.register_operator(
    "bucket_all_gather_wait", meta=_bucket_all_gather_wait_meta, fn=bucket_buffers.wait_all_gather_bucket
)
bucket_reduce_scatter = overlap_executor.register_operator(
    "bucket_reduce_scatter", meta=_bucket_reduce_scatter_meta, fn=bucket_buffers.reduce_scatter_bucket
)
bucket_reduce_scatter_wait = overlap_executor.register_operator(
    "bucket_reduce_scatter_wait", meta=_bucket_reduce_scatter_wait_meta, fn=bucket_buffers.wait_reduce_scatter_bucket
)
bucket_accumulate_grads = overlap_executor.register_operator(
    "bucket_accumulate_grads", meta=_bucket_accumulate_grads_meta, fn=bucket_buffers.accumulate_bucket_grads
)


# Hybrid sharding's all-reduce of a reduced gradient shard across replicas (transforms/replicate.py).
def _replica_all_reduce_meta(reduced: TensorProxy, group, divisor: float) -> FutureTensorProxy:
    return FutureTensorProxy(like=reduced)


def _replica_all_reduce_impl(reduced: torch.Tensor, group, divisor: float) -> tuple[dist.Work, torch.Tensor]:
    # In place: the reduce-scatter's fresh output, read by nothing but this all-reduce.
    reduced.div_(divisor)
    return dist.all_reduce(reduced, group=group, async_op=True), reduced


def _replica_all_reduce_wait_meta(pending: FutureTensorProxy) -> TensorProxy:
    return TensorProxy(like=pending)


def _bucket_all_reduce_meta(bucket_id: int, group, reduced: list[TensorProxy], divisor: float) -> FutureTensorProxy:
    bucket = bucket_buffers.lookup_bucket(bucket_id)
    return FutureTensorProxy(shape=(bucket.plan.shard_numel,), like=reduced[0])


replica_all_reduce = overlap_executor.register_operator("replica_all_reduce", meta=_replica_all_reduce_meta, fn=_replica_all_reduce_impl)
replica_all_reduce_wait = overlap_executor.register_operator(
    "replica_all_reduce_wait", meta=_replica_all_reduce_wait_meta, fn=torchex._wait_prim_impl
)
bucket_all_reduce = overlap_executor.register_operator(
    "bucket_all_reduce", meta=_bucket_all_reduce_meta, fn=bucket_buffers.all_reduce_bucket
)
bucket_all_reduce_wait = overlap_executor.register_operator(
    "bucket_all_reduce_wait", meta=_bucket_reduce_scatter_wait_meta, fn=bucket_buffers.wait_all_reduce_bucket
)



def _numel(t: TensorProxy) -> int:
    numel = 1
    for s in t.shape:
        numel *= int(s)
    return numel


# A coalesced launch's future stands for every member's output, back to back: its numel is
# theirs summed, which is what the cost model and the memory estimator read.
def _coalesced_all_gather_meta(group, dims: tuple, shards: list[TensorProxy]) -> FutureTensorProxy:
    return FutureTensorProxy(shape=(sum(_numel(s) for s in shards) * group.size(),), like=shards[0])


def _coalesced_reduce_scatter_meta(group, dims: tuple, tensors: list[TensorProxy], op) -> FutureTensorProxy:
    return FutureTensorProxy(shape=(sum(_numel(t) for t in tensors) // group.size(),), like=tensors[0])


def _coalesced_bucket_all_gather_meta(group, members: tuple, shards: list[list[TensorProxy]]) -> FutureTensorProxy:
    buckets = [bucket_buffers.lookup_bucket(bucket_id) for bucket_id, _, _ in members]
    return FutureTensorProxy(shape=(sum(b.world_size * b.plan.shard_numel for b in buckets),), like=shards[0][0])


def _coalesced_bucket_reduce_scatter_meta(group, members: tuple, grads: list[list[TensorProxy]]) -> FutureTensorProxy:
    buckets = [bucket_buffers.lookup_bucket(bucket_id) for bucket_id, _, _ in members]
    return FutureTensorProxy(shape=(sum(b.plan.shard_numel for b in buckets),), like=grads[0][0])


def _coalesced_wait_meta(pending: FutureTensorProxy, shapes: tuple[tuple[int, ...], ...]) -> list[TensorProxy]:
    return [TensorProxy(like=pending, shape=shape) for shape in shapes]


def _coalesced_op(kind: str, meta, fn):
    return overlap_executor.register_operator(f"{COALESCED_PREFIX}{kind}", meta=meta, fn=fn)


coalesced_all_gather = _coalesced_op("all_gather", _coalesced_all_gather_meta, coalesced.all_gather)
coalesced_reduce_scatter = _coalesced_op("reduce_scatter", _coalesced_reduce_scatter_meta, coalesced.reduce_scatter)
coalesced_bucket_all_gather = _coalesced_op("bucket_all_gather", _coalesced_bucket_all_gather_meta, coalesced.bucket_all_gather)
coalesced_bucket_reduce_scatter = _coalesced_op(
    "bucket_reduce_scatter", _coalesced_bucket_reduce_scatter_meta, coalesced.bucket_reduce_scatter
)
coalesced_wait = _coalesced_op("wait", _coalesced_wait_meta, coalesced.wait)


def _can_swallow_collectives(executor: Executor) -> bool:
    collective_ids = (dist_prims.all_gather.id, torchex.all_gather_prim_impl.id, torchex.wait_prim_impl.id)
    return isinstance(executor, FusionExecutor) and any(i in executor.implmap for i in collective_ids)


def with_collectives_kept_visible(executors: list[Executor]) -> list[Executor]:
    """``executors`` with ``overlap_executor`` first when one of them could fuse collectives.

    Otherwise the list is returned unchanged, so Thunder's own passes (which know the torch
    executor's collective symbols) produce the same order as they do for Thunder's FSDP.
    """
    if any(_can_swallow_collectives(e) for e in executors):
        return [overlap_executor, *(e for e in executors if e is not overlap_executor)]
    return list(executors)
