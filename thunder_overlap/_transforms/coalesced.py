"""What the coalesced operators of the traces run: several collectives of one kind, process group
and dtype launched together, and the one wait that completes them all.

Separately launched collectives each pay the network's latency; collectives issued inside one
``torch.distributed._coalescing_manager(group, async_ops=True)`` go out as one launch (one
``ncclGroupStart``/``ncclGroupEnd`` on NCCL; gloo runs them correctly too) and share it. Which
collectives are coalesced is decided by :mod:`thunder_overlap._scheduling.launches`; the trace
operators are registered in :mod:`thunder_overlap._transforms.executor`.

Members are either per-parameter collectives (Thunder's all-gather / reduce-scatter of one
tensor) or bucketed ones (:mod:`thunder_overlap._bucketing.buffers`): each member's copy-in runs
before the launch, its copy-out after the wait, exactly as when it is launched alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from thunder.torch import to_torch_distributed_reduce_op

from thunder_overlap._bucketing import buffers as bucket_buffers

__all__ = [
    "CoalescedLaunch",
    "all_gather",
    "bucket_all_gather",
    "bucket_reduce_scatter",
    "reduce_scatter",
    "wait",
]


@dataclass
class CoalescedLaunch:
    """What a coalesced issue returns and its wait consumes."""

    manager: dist.distributed_c10d._CoalescingManager | None
    # Per member, its outputs once the launch is complete (copy-out included).
    finishers: list[Callable[[], list[torch.Tensor]]]
    # Inputs that must stay referenced while the launch runs (pool buffers stay busy).
    sources: list[object]


def _launch(group: dist.ProcessGroup, launches: list[Callable[[], None]]) -> dist.distributed_c10d._CoalescingManager:
    with dist._coalescing_manager(group, async_ops=True) as manager:
        for launch in launches:
            launch()
    return manager


def _scaled_shape(t: torch.Tensor, dim: int | None, factor: float) -> list[int]:
    # As Thunder's torch executor shapes one collective's output: dim (default 0) grows or shrinks.
    shape = list(t.shape)
    axis = 0 if dim is None else dim
    shape[axis] = int(shape[axis] * factor)
    return shape


def all_gather(group: dist.ProcessGroup, dims: tuple[int | None, ...], shards: list[torch.Tensor]) -> CoalescedLaunch:
    outs = [torch.empty(_scaled_shape(s, d, group.size()), dtype=s.dtype, device=s.device) for s, d in zip(shards, dims, strict=True)]
    launches = [lambda o=o, s=s: dist.all_gather_into_tensor(o, s, group=group) for o, s in zip(outs, shards, strict=True)]
    return CoalescedLaunch(_launch(group, launches), [lambda o=o: [o] for o in outs], list(shards))


def reduce_scatter(group: dist.ProcessGroup, dims: tuple[int | None, ...], tensors: list[torch.Tensor], op) -> CoalescedLaunch:
    torch_op = to_torch_distributed_reduce_op(op)
    outs = [torch.empty(_scaled_shape(t, d, 1 / group.size()), dtype=t.dtype, device=t.device) for t, d in zip(tensors, dims, strict=True)]
    launches = [lambda o=o, t=t: dist.reduce_scatter_tensor(o, t, op=torch_op, group=group) for o, t in zip(outs, tensors, strict=True)]
    return CoalescedLaunch(_launch(group, launches), [lambda o=o: [o] for o in outs], list(tensors))


def bucket_all_gather(
    group: dist.ProcessGroup, members: tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...], shards: list[list[torch.Tensor]]
) -> CoalescedLaunch:
    """``members``: per bucket (bucket id, the slots it gathers, the slots its wait returns)."""
    buckets = [bucket_buffers.lookup_bucket(bucket_id) for bucket_id, _, _ in members]
    pendings = [b.prepare_all_gather(s, slots) for b, s, (_, slots, _) in zip(buckets, shards, members, strict=True)]
    launches = [lambda b=b, p=p: b.launch_all_gather(p, async_op=False) for b, p in zip(buckets, pendings, strict=True)]
    finishers = [
        lambda b=b, p=p, slots=slots: b.copy_out(p.result, slots) for b, p, (_, _, slots) in zip(buckets, pendings, members, strict=True)
    ]
    return CoalescedLaunch(_launch(group, launches), finishers, pendings)


def bucket_reduce_scatter(
    group: dist.ProcessGroup, members: tuple[tuple[int, float | None, tuple[int, ...]], ...], grads: list[list[torch.Tensor]]
) -> CoalescedLaunch:
    """``members``: per bucket (bucket id, the pre-average divisor, the slots its wait returns)."""
    buckets = [bucket_buffers.lookup_bucket(bucket_id) for bucket_id, _, _ in members]
    pendings = [b.prepare_reduce_scatter(g, divisor) for b, g, (_, divisor, _) in zip(buckets, grads, members, strict=True)]
    launches = [lambda b=b, p=p: b.launch_reduce_scatter(p, async_op=False) for b, p in zip(buckets, pendings, strict=True)]
    finishers = [
        lambda b=b, p=p, slots=slots: b.reduced_views(p, slots) for b, p, (_, _, slots) in zip(buckets, pendings, members, strict=True)
    ]
    return CoalescedLaunch(_launch(group, launches), finishers, pendings)


def wait(launch: CoalescedLaunch, shapes: tuple[tuple[int, ...], ...]) -> list[torch.Tensor]:
    """Waits for the whole launch; every member's outputs, member after member."""
    launch.manager.wait()
    # Drop the manager (it holds the backend's works), then let the backend release the
    # bucket members' pool buffers before their copy-outs take new views.
    launch.manager = None
    for source in launch.sources:
        if isinstance(source, bucket_buffers.PendingCollective):
            source.settle()
    outputs = [t for finish in launch.finishers for t in finish()]
    if len(outputs) != len(shapes):
        raise RuntimeError(f"thunder_overlap: a coalesced launch produced {len(outputs)} outputs, its trace expects {len(shapes)}")
    return outputs
