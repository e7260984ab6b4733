"""How a bucket moves its parameters and gradients: one path per direction.

A bucket's all-gather and reduce-scatter can each take one of a few paths through the bucket
pool's buffers (``_bucketing/buffers.py`` runs them, the memory estimator and the cost model
follow them). Which paths exist depends on the backend (``_backends.py``); which one a bucket
takes is chosen once, at the first compile, and then held by the bucket's owner, the
:class:`~thunder_overlap._transforms.BucketingTransform`. Analysis receives the layouts as a
mapping (:data:`BucketLayouts`) keyed by the bucket object the trace names. Why each path exists
is in ``docs/design.md`` ([Note: bucket paths]).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import Enum
from types import MappingProxyType

from thunder_overlap._backends import Backend

__all__ = ["NO_BUCKETS", "BucketLayout", "BucketLayouts", "GatherPath", "ReducePath", "layout_of"]


class GatherPath(Enum):
    """Where a bucket's all-gather lands."""

    # One tensor, or one rank: the parameters are views of the gathered buffer.
    VIEWS = "views"
    # Each parameter gathered into its place in the buffer: one launch where the backend runs a
    # coalesced launch as one, one launch per parameter otherwise.
    IN_PLACE = "in place"
    # The flat shards gathered rank-major into one buffer, the parameters copied out of it into
    # a second one.
    COPY_OUT = "copy-out"


class ReducePath(Enum):
    """Where a bucket's reduce-scatter reads its gradients and writes the gradient shard."""

    # Each gradient sent where it is, into its slot of a new gradient shard: no pool buffer.
    SEND = "send"
    # The gradients laid out into a pool buffer, which the collective holds until its wait.
    LAID_OUT = "laid out"
    # Laid out, then handed to the backend's own copy of a reduce-scatter's input at the launch:
    # the pool buffer is free at once, the copy (outside the pool) is held until the wait.
    FROM_COPY = "from copy"
    # Laid out and reduced in place: this rank's row of the pool buffer is the gradient shard,
    # so the buffer is busy as long as ``.grad`` holds it.
    IN_POOL = "in pool"


@dataclass(frozen=True)
class BucketLayout:
    """One bucket's sizes, its backend, and the path each of its collectives takes."""

    label: str
    # Elements of one unsharded buffer: world size x the flat shard, padding included.
    unsharded_numel: int
    # The parameters' dtype: the flat shard's, and the reduce-scatter's buffers'.
    dtype: str
    itemsize: int
    # What the all-gather moves and its buffers hold: the dtype above, or mixed precision's
    # param_dtype, into which the flat shard is cast once per gather (the gradients then come in
    # it too: see [Note: mixed precision]).
    gather_dtype: str
    gather_itemsize: int
    tensors: int
    world_size: int
    backend: Backend
    # Whether some parameter's rows are padded to a multiple of the world size: the gradients
    # then need laying out to be reduce-scattered.
    padded: bool
    gather: GatherPath
    reduce: ReducePath

    def __post_init__(self) -> None:
        single = self.tensors == 1 or self.world_size == 1
        if (self.gather is GatherPath.VIEWS) != single:
            raise ValueError(
                f"bucket {self.label!r}: gather path {self.gather.value!r} with {self.tensors} tensors on {self.world_size} ranks"
            )
        if self.reduce is ReducePath.SEND and not self.can_send_gradients:
            raise ValueError(
                f"bucket {self.label!r}: its gradients cannot be sent where they are (padded, or several on {self.backend.name})"
            )
        if self.reduce is ReducePath.FROM_COPY and not self.backend.copies_reduce_scatter_input:
            # Handing the buffer back at the launch would let the next use overwrite it in flight.
            raise ValueError(f"bucket {self.label!r}: {self.backend.name} reads a reduce-scatter's input in flight, it keeps no copy")

    @classmethod
    def default(
        cls,
        label: str,
        *,
        unsharded_numel: int,
        dtype: str,
        itemsize: int,
        tensors: int,
        world_size: int,
        backend: Backend,
        padded: bool,
        gather_dtype: str | None = None,
        gather_itemsize: int | None = None,
    ) -> BucketLayout:
        """The paths a bucket takes until a choice changes them: no copy where the backend allows.
        The gather dtype defaults to ``dtype`` (no mixed precision)."""
        if gather_dtype is None:
            gather_dtype, gather_itemsize = dtype, itemsize
        elif gather_itemsize is None:
            raise ValueError(f"bucket {label!r}: gather dtype {gather_dtype} given without its itemsize")
        if tensors == 1 or world_size == 1:
            gather = GatherPath.VIEWS
        else:
            gather = GatherPath.IN_PLACE if backend.runs_coalesced_launch_as_one else GatherPath.COPY_OUT
        sendable = not padded and (tensors == 1 or backend.runs_coalesced_launch_as_one)
        reduce = ReducePath.SEND if sendable else ReducePath.LAID_OUT
        sizes = (unsharded_numel, dtype, itemsize, gather_dtype, gather_itemsize)
        return cls(label, *sizes, tensors, world_size, backend, padded, gather, reduce)

    def as_on(self, backend: Backend) -> BucketLayout:
        """This bucket's default paths on ``backend`` (to run NCCL's paths over gloo, for real)."""
        names = ("unsharded_numel", "dtype", "itemsize", "gather_dtype", "gather_itemsize", "tensors", "world_size", "padded")
        fields = {name: getattr(self, name) for name in names}
        return BucketLayout.default(self.label, backend=backend, **fields)

    def with_paths(self, *, gather: GatherPath | None = None, reduce: ReducePath | None = None) -> BucketLayout:
        return replace(self, gather=gather or self.gather, reduce=reduce or self.reduce)

    @property
    def can_send_gradients(self) -> bool:
        return not self.padded and (self.tensors == 1 or self.backend.runs_coalesced_launch_as_one)

    def reduce_scatter_holds_pool_buffer(self, *, coalesced: bool = False) -> bool:
        """Whether the reduce-scatter keeps a pool buffer busy from its launch to its wait (a
        coalesced launch hands nothing to the backend's copy: its members keep their buffers)."""
        return self.reduce is ReducePath.LAID_OUT or (coalesced and self.reduce is ReducePath.FROM_COPY)

    def gather_launches(self) -> int:
        """Launches the backend pays a latency for to gather the bucket."""
        in_place_per_tensor = self.gather is GatherPath.IN_PLACE and not self.backend.runs_coalesced_launch_as_one
        return self.tensors if in_place_per_tensor else 1

    @property
    def nbytes(self) -> int:
        """Bytes of one unsharded buffer in the parameters' dtype (a reduce-scatter's)."""
        return self.unsharded_numel * self.itemsize

    @property
    def gather_nbytes(self) -> int:
        """Bytes of one gathered buffer (an all-gather's, a copy-out's)."""
        return self.unsharded_numel * self.gather_itemsize

    @property
    def casts_for_gather(self) -> bool:
        """Whether each gather first casts the flat shard into the bucket's cast shard."""
        return self.gather_dtype != self.dtype

    @property
    def cast_shard_nbytes(self) -> int:
        """Bytes of the cast shard a casting bucket holds for the module's life (0 without a cast)."""
        return self.gather_nbytes // self.world_size if self.casts_for_gather else 0


# The layouts of a trace's buckets, keyed by the bucket object its operators name.
BucketLayouts = Mapping[object, BucketLayout]
NO_BUCKETS: BucketLayouts = MappingProxyType({})


def layout_of(layouts: BucketLayouts, bucket: object) -> BucketLayout:
    """The layout of the bucket a trace operator names; a clear error where the caller did not
    pass it (analysis of a bucketed trace needs ``BucketingTransform.of(model).layouts``)."""
    layout = layouts.get(bucket)
    if layout is None:
        raise ValueError(
            f"thunder_overlap: the trace runs bucket {getattr(bucket, 'label', bucket)!r}, whose layout was not given: "
            "pass layouts=BucketingTransform.of(model).layouts"
        )
    return layout
