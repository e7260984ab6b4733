"""no_sync without buckets: refused, because Thunder would drop the gradients.

Thunder 0.2.6's FSDP compiles a backward under ``no_sync`` /
``thunder.distributed.skip_data_parallel_grad_sync()`` that still reduce-scatters every gradient,
then hands autograd None for all of them: the micro-batch is silently lost. With
``bucketing_strategy="layer"`` or ``"block"``, :class:`~thunder_overlap._transforms.BucketingTransform`
sums those gradients in the bucket buffers instead, and the next synchronised backward sends them.
Per-parameter collectives have no such buffer, so this transform stops the compilation instead.
"""

from __future__ import annotations

from thunder.core.transform_common import Transform
from thunder.distributed import get_skip_data_parallel_grad_sync

__all__ = ["RefuseNoSyncTransform"]


class RefuseNoSyncTransform(Transform):
    """Raises NotImplementedError when the module is compiled under no_sync."""

    def transform_traces_pre_prologue(self, prologue_trace, computation_trace, epilogue_trace, **kwargs):
        if get_skip_data_parallel_grad_sync():
            raise NotImplementedError(
                "thunder_overlap: no_sync / thunder.distributed.skip_data_parallel_grad_sync() needs "
                "bucketing_strategy='layer', 'block' or 'auto' (got 'none'): the unsynchronised gradients are summed in the "
                "bucket buffers, and Thunder's FSDP alone drops them (every .grad stays None). Use buckets, or "
                "accumulate by calling backward() on each micro-batch outside no_sync (each backward "
                "reduce-scatters and .grad accumulates the shards)."
            )
        return prologue_trace, computation_trace, epilogue_trace
