"""The bucket object the traces name: what the bucket operators of ``_ops.py`` call.

:class:`~thunder_overlap._transforms.BucketingTransform` makes one per bucket and keeps them: the
state lives with its owner, and the traces hold a reference to the object (a context object of
the trace), so no registry is needed. The work is in ``gather.py`` (all-gather paths) and
``reduction.py`` (reduce-scatter paths, hybrid sharding's all-reduce, no_sync); the buffers in
``state.py`` and ``pool.py``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from thunder_overlap._bucketing import gather, reduction
from thunder_overlap._bucketing.pool import PendingCollective
from thunder_overlap._bucketing.state import BucketState

__all__ = ["BucketBuffers"]


class BucketBuffers(BucketState):
    """One bucket's persistent buffers and its collectives (``_ops.BucketRuntime``)."""

    def __repr__(self) -> str:
        return f"BucketBuffers({self.plan.label!r}, {len(self.plan.slots)} tensors, {self.layout.gather.value}, {self.layout.reduce.value})"

    # --- all-gather (gather.py) -------------------------------------------------------------

    def start_all_gather(self, shards: list[torch.Tensor], slots: tuple[int, ...]) -> PendingCollective:
        pending = self.prepare_all_gather(shards, slots)
        pending.work = self.launch_all_gather(pending, async_op=True)
        return pending

    def prepare_all_gather(self, shards: list[torch.Tensor], slots: tuple[int, ...]) -> PendingCollective:
        return gather.prepare(self, shards, slots)

    def launch_all_gather(self, pending: PendingCollective, *, async_op: bool):
        return gather.launch(self, pending, async_op=async_op)

    def finish_all_gather(self, pending: PendingCollective, slots: tuple[int, ...]) -> list[torch.Tensor]:
        pending.work.wait()
        pending.settle()
        return gather.copy_out(self, pending.result, slots)

    def gathered_views(self, pending: PendingCollective, slots: tuple[int, ...]) -> list[torch.Tensor]:
        """After a coalesced launch's wait."""
        return gather.copy_out(self, pending.result, slots)

    # --- reduce-scatter, all-reduce and no_sync (reduction.py) --------------------------------

    def start_reduce_scatter(self, grads: list[torch.Tensor], divisor: float | None) -> PendingCollective:
        pending = self.prepare_reduce_scatter(grads, divisor)
        pending.work = self.launch_reduce_scatter(pending, async_op=True)
        return pending

    def prepare_reduce_scatter(self, grads: list[torch.Tensor], divisor: float | None) -> PendingCollective:
        return reduction.prepare(self, grads, divisor)

    def launch_reduce_scatter(self, pending: PendingCollective, *, async_op: bool):
        return reduction.launch(self, pending, async_op=async_op)

    def finish_reduce_scatter(self, pending: PendingCollective, slots: tuple[int, ...]) -> list[torch.Tensor]:
        pending.work.wait()
        pending.settle()
        return reduction.reduced_views(self, pending, slots)

    def reduced_views(self, pending: PendingCollective, slots: tuple[int, ...]) -> list[torch.Tensor]:
        """After a coalesced launch's wait."""
        return reduction.reduced_views(self, pending, slots)

    def start_all_reduce(self, reduced: list[torch.Tensor], group: dist.ProcessGroup, divisor: float) -> PendingCollective:
        return reduction.start_all_reduce(self, reduced, group, divisor)

    def finish_all_reduce(self, pending: PendingCollective, slots: tuple[int, ...]) -> list[torch.Tensor]:
        return reduction.finish_all_reduce(self, pending, slots)

    def accumulate_unsynced(self, grads: list[torch.Tensor], slots: tuple[int, ...]) -> list[torch.Tensor]:
        return reduction.accumulate_unsynced(self, grads, slots)
