"""Reduce-scatters handed to gloo's copy of their input where holding the lay-out would cost the pool a buffer.

Over gloo a bucket lays its gradients out into a pool buffer and all-reduces that buffer in
place: no copy beyond the lay-out, but the buffer is busy from the launch to the wait. In ZeRO3's
backward that is a third block buffer beside the block computing and the next one arriving, and
the pool keeps it for the whole step, so it costs its bytes at the activations' peak early in the
backward, long before any reduce-scatter. gloo's own ``reduce_scatter_tensor`` copies its whole
input at the launch, in the calling thread, and keeps no view of it: handed the laid-out buffer,
it frees the buffer for the next gather at once, and its copy, outside the pool, is held only
while the collective is in flight, later in the backward, when the activations are gone
(``BucketLayout.reduce_scatter_from_copy``). The cost is that copy, one more pass over the bucket.

:data:`REDUCE_FROM_COPY` is the change for :func:`~thunder_overlap._bucketing.path_choice.choose_buckets`:
the fewest lone laid-out reduce-scatters over such a backend whose lay-out, busy for the launch
only, leaves the pool as small as all of them would
(:func:`~thunder_overlap._analysis.pool_slots.fewest_reduce_scatters_from_copy`), taken only where
the step peaks lower and the simulator, charging the copy, predicts the step at most
``OverlapConfig.reduce_from_copy_max_slowdown`` slower.
"""

from __future__ import annotations

from dataclasses import replace

from thunder_overlap._analysis.memory_estimate import MemoryEstimate
from thunder_overlap._analysis.pool_slots import BucketLayout, fewest_reduce_scatters_from_copy
from thunder_overlap._bucketing.path_choice import BucketChange, Layouts

__all__ = ["REDUCE_FROM_COPY"]


def _laid_out_over_copying_backend(layouts: Layouts, backward: MemoryEstimate) -> list[str]:
    """Buckets whose lone reduce-scatter holds a laid-out pool buffer, on a backend that copies
    a reduce-scatter's input (a coalesced launch's members keep their buffers: gloo's copies
    there are made when the launch ends)."""
    return [
        issue.layout.label
        for issue in backward.reduce_scatter_issues
        if issue.pool_user is not None and issue.layout.reduce_scatter_copies_input and not issue.layout.reduces_in_pool
    ]


def _reduced_from_copy(layout: BucketLayout) -> BucketLayout:
    return replace(layout, reduce_scatter_from_copy=True)


REDUCE_FROM_COPY = BucketChange(
    "reduced from gloo's copy", _laid_out_over_copying_backend, fewest_reduce_scatters_from_copy, _reduced_from_copy
)
