"""Communication only: replays the collectives of Thunder execution traces with no compute.

The slow-link testbed's calibration run M. Each trace (forward, then backward) is read with
:func:`thunder_overlap.classify.classify_trace`; its collectives are issued asynchronously and
waited on in the trace's own order, so the replay keeps the schedule's in-flight pattern (and
therefore the link utilisation it achieves) while every compute op is left out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from thunder.core.dtypes import to_torch_dtype
from thunder.core.trace import TraceCtx

from thunder_overlap._analysis.classify import CollectiveKind, NodeKind, classify_trace

__all__ = ["CommEvent", "CommReplay", "comm_events"]


@dataclass(frozen=True)
class CommEvent:
    """Issue (``wait=False``) or wait (``wait=True``) of collective ``collective`` of one trace."""

    collective: int
    wait: bool


@dataclass
class _Buffers:
    kind: CollectiveKind
    group: dist.ProcessGroup | None
    unsharded: torch.Tensor
    shard: torch.Tensor

    def issue(self) -> dist.Work:
        if self.kind is CollectiveKind.ALL_GATHER:
            return dist.all_gather_into_tensor(self.unsharded, self.shard, group=self.group, async_op=True)
        if self.kind is CollectiveKind.REDUCE_SCATTER:
            return dist.reduce_scatter_tensor(self.shard, self.unsharded, group=self.group, async_op=True)
        return dist.all_reduce(self.unsharded, group=self.group, async_op=True)


def comm_events(trace: TraceCtx) -> list[CommEvent]:
    """The issues and waits of ``trace``'s collectives, in trace order."""
    annotated = classify_trace(trace, roles_only=True)
    return [
        CommEvent(node.collective, wait=node.kind is NodeKind.WAIT)
        for node in annotated.nodes
        if node.kind in (NodeKind.COLLECTIVE, NodeKind.WAIT) and node.collective is not None
    ]


def _buffers(trace: TraceCtx, device: torch.device) -> list[_Buffers]:
    annotated = classify_trace(trace, roles_only=True)
    buffers = []
    for coll in annotated.collectives:
        proxy = annotated.nodes[coll.start].bsym.flat_proxy_outs[0]
        dtype = to_torch_dtype(proxy.dtype)
        numel = coll.unsharded_bytes // dtype.itemsize
        world = dist.get_world_size(coll.process_group)
        # Zero-filled once: uninitialised memory may hold denormals that slow CPU reductions.
        unsharded = torch.zeros(numel, dtype=dtype, device=device)
        buffers.append(_Buffers(coll.kind, coll.process_group, unsharded, unsharded.new_zeros(numel // world)))
    return buffers


class CommReplay:
    """One call replays every trace's collectives once, in order; returns a zero "loss"."""

    def __init__(self, traces: list[TraceCtx], device: torch.device) -> None:
        self.device = device
        self.phases = [(comm_events(t), _buffers(t, device)) for t in traces]

    @property
    def bytes_per_step(self) -> int:
        """Unsharded bytes of every replayed collective (all-gather outputs, reduce-scatter inputs)."""
        return sum(b.unsharded.nbytes for _, buffers in self.phases for b in buffers)

    def __call__(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        for events, buffers in self.phases:
            in_flight: dict[int, dist.Work] = {}
            for event in events:
                if event.wait:
                    in_flight.pop(event.collective).wait()
                else:
                    in_flight[event.collective] = buffers[event.collective].issue()
            for work in in_flight.values():  # collectives the trace never waits on
                work.wait()
        return torch.zeros((), device=self.device)
