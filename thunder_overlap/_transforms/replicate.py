"""Hybrid sharding (HSDP): every reduced gradient shard is all-reduced across the replicas.

Under a 2-D device mesh (replicate, shard), Thunder's FSDP shards, all-gathers and
reduce-scatters in the shard group. In each backward execution trace, this transform puts after
every reduce-scatter's wait an all-reduce of its result over the replicate group and that
all-reduce's wait, which now produces the gradient the rest of the trace reads:

    g_shard = wait(reduce_scatter(g / shard_size))        # unchanged, output renamed
    f = replica_all_reduce(g_shard, replicate, replicas)  # divides in place, sums in place
    g = replica_all_reduce_wait(f)                        # the name the trace used before

A bucketed reduce-scatter gets one ``bucket_all_reduce`` on its persistent gradient shard. The
result is the gradient averaged over the whole world. The all-reduces are ordinary collectives
of the trace: the scheduler that runs after this transform issues each as soon as its
reduce-scatter has been waited on, and places its wait before the first use.

A backward compiled under no_sync has no reduce-scatter (the bucket buffers accumulate), so it
gets no all-reduce either.
"""

from __future__ import annotations

import torch.distributed as dist
from thunder.core import prims
from thunder.core.proxies import TensorProxy
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx, TraceProvenance, TraceTag, from_trace, tracectx
from thunder.core.transform_common import Transform
from torch.distributed.device_mesh import DeviceMesh

from thunder_overlap import _ops as ops
from thunder_overlap._analysis.classify import CollectiveKind, classify_trace
from thunder_overlap._scheduling.orders import with_deletions
from thunder_overlap._transforms._lookup import transform_of

__all__ = ["ReplicaReduceTransform", "with_replica_all_reduces"]

_BUCKET_WAIT = "bucket_reduce_scatter_wait"


class ReplicaReduceTransform(Transform):
    """Adds hybrid sharding's all-reduce after each reduce-scatter, across dim 0 (replicate)
    of ``device_mesh``, a 2-D mesh (replicate, shard)."""

    def __init__(self, device_mesh: DeviceMesh) -> None:
        if device_mesh.ndim != 2:
            raise ValueError(f"ReplicaReduceTransform needs a 2-D device mesh (replicate, shard), got {device_mesh.ndim} dims")
        # Kept for checkpoints, whose DTensors are placed on it (Replicate(), Shard(0)).
        self.device_mesh = device_mesh
        self.replicate_group: dist.ProcessGroup = device_mesh.get_group(0)
        # All-reduces the last backward got: (per parameter, per bucket).
        self.all_reduces: tuple[int, int] = (0, 0)

    @staticmethod
    def of(module) -> ReplicaReduceTransform | None:
        """The transform of a module ``thunder_overlap.fsdp`` returned with a 2-D mesh, if any."""
        return transform_of(module, ReplicaReduceTransform)

    def transform_trace_post_optimization(self, computation_trace: TraceCtx, **kwargs) -> TraceCtx:
        if TraceTag.BACKWARD not in computation_trace.tags:
            return computation_trace
        rewritten, all_reduces = with_replica_all_reduces(computation_trace, self.replicate_group)
        if rewritten is not computation_trace:
            self.all_reduces = all_reduces
        return rewritten


def with_replica_all_reduces(backward: TraceCtx, replicate_group: dist.ProcessGroup) -> tuple[TraceCtx, tuple[int, int]]:
    """``backward`` with an all-reduce across ``replicate_group`` after each reduce-scatter's wait
    (the same trace where it has none), and how many it got (per parameter, per bucket)."""
    annotated = classify_trace(backward, roles_only=True)
    waits = {
        id(annotated.nodes[c.wait].bsym) for c in annotated.collectives if c.kind is CollectiveKind.REDUCE_SCATTER and c.wait is not None
    }
    if not waits:
        return backward, (0, 0)
    replicas = float(replicate_group.size())
    bsyms: list[BoundSymbol] = []
    per_parameter = per_bucket = 0
    with tracectx(backward):
        for bsym in backward.bound_symbols:
            # Deletions are regenerated below: the renamed outputs die elsewhere.
            if bsym.sym.id is prims.PrimIDs.DEL or bsym.sym.name == "clear_mutable_collection":
                continue
            if id(bsym) not in waits:
                bsyms.append(bsym)
            elif bsym.sym.name == _BUCKET_WAIT:
                bsyms += _bucket_all_reduce(bsym, replicate_group, replicas)
                per_bucket += 1
            else:
                bsyms += _all_reduce(bsym, replicate_group, replicas)
                per_parameter += 1
    rebuilt = from_trace(backward)
    rebuilt.bound_symbols = bsyms
    rebuilt = with_deletions(rebuilt, clear_collections=True)
    rebuilt.set_provenance(TraceProvenance("thunder_overlap: all-reduce across replicas"))
    return rebuilt, (per_parameter, per_bucket)


def _all_reduce(wait: BoundSymbol, group: dist.ProcessGroup, replicas: float) -> list[BoundSymbol]:
    reduced = wait.output
    shard = TensorProxy(like=reduced)
    future = ops.replica_all_reduce.meta(shard, group, replicas)
    return [
        wait.from_bsym(output=shard),
        ops.replica_all_reduce.bind(shard, group, replicas, output=future),
        ops.replica_all_reduce_wait.bind(future, output=reduced),
    ]


def _bucket_all_reduce(wait: BoundSymbol, group: dist.ProcessGroup, replicas: float) -> list[BoundSymbol]:
    _, bucket, slots = wait.args
    reduced = tuple(wait.output)
    shards = [TensorProxy(like=t) for t in reduced]
    future = ops.bucket_all_reduce.meta(bucket, group, shards, replicas)
    return [
        wait.from_bsym(output=tuple(shards)),
        ops.bucket_all_reduce.bind(bucket, group, shards, replicas, output=future),
        ops.bucket_all_reduce_wait.bind(future, bucket, slots, output=reduced),
    ]
