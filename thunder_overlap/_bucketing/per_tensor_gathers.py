"""Buckets gathered per parameter where their copy-out would cost the pool a buffer the step can spare.

Over a backend that runs a coalesced launch one collective at a time (gloo), a bucket of several
parameters gathers its flat shard rank-major into one pool buffer and copies the parameters out
into a second: one launch, paid for with a copy and a buffer. The pool keeps every buffer for the
whole step, so where those copy-outs make more buffers busy at once than the schedule otherwise
needs, each costs its bytes at the step's peak, wherever the peak is: ZeRO2's last block, whose
rank-major buffer would sit idle from the end of the forward to the end of the step, is the
usual case. As on NCCL, such a bucket can instead gather each parameter straight into its place
(``BucketLayout.per_tensor_gather``): no copy and no second buffer, one launch latency per
parameter (on loopback gloo, 12 gathers of a block's parameters took 1.4x one of the block).

Reduce-scatters stay laid out: sent per gradient, each is a gloo reduce-scatter, an all-reduce of
a copy of its input with its fixed cost (12 of a block's gradients took 5.4x the laid-out buffer's
all-reduce on loopback, and collectives run per tensor made the slow-link step 8.8% slower),
and the gradients and gloo's copies are then held until the wait (a laid-out buffer that would
cost the pool a buffer goes to gloo's copy instead: :mod:`~thunder_overlap._bucketing.reduce_from_copy`).

:data:`GATHER_PER_TENSOR` is the change for :func:`~thunder_overlap._bucketing.path_choice.choose_buckets`:
the fewest buckets that copy out whose gathering in place leaves the pool as small as gathering
all in place would (:func:`~thunder_overlap._analysis.pool_slots.fewest_per_tensor_gathers`),
taken only where the step peaks lower and the simulator, charging each parameter's launch,
predicts the step at most ``OverlapConfig.per_tensor_gather_max_slowdown`` slower.
"""

from __future__ import annotations

from dataclasses import replace

from thunder_overlap._analysis.memory_estimate import MemoryEstimate
from thunder_overlap._analysis.pool_slots import BucketLayout, fewest_per_tensor_gathers
from thunder_overlap._bucketing.path_choice import BucketChange, Layouts

__all__ = ["GATHER_PER_TENSOR"]


def _copying_out(layouts: Layouts, backward: MemoryEstimate) -> list[str]:
    return [layout.label for layout in layouts.values() if layout.copies_out]


def _gathered_in_place(layout: BucketLayout) -> BucketLayout:
    return replace(layout, per_tensor_gather=True)


GATHER_PER_TENSOR = BucketChange("gathered per parameter", _copying_out, fewest_per_tensor_gathers, _gathered_in_place)
