"""One bucket's persistent state: its flat shard (the parameters are views of it), its shapes, its
layout, and the gradient shards it has handed out.

``flat_shard`` lives for the life of the module: the optimizer updates it in place and the
all-gather sends it with no copy-in. With mixed precision the all-gather sends ``gather_shard``
instead, a second persistent buffer in the gather dtype that each gather first casts the flat
shard into: one cast per bucket, nothing allocated per step. Each step a reduce-scatter writes into a new gradient shard
that ``.grad`` alone owns (``zero_grad(set_to_none=True)`` gives it back, as it does an
unbucketed gradient), see ``docs/memory.md`` ("What buckets cost"). The layout is set by the
bucket's owner, :class:`~thunder_overlap._transforms.BucketingTransform`, and read here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef

from thunder_overlap._analysis.layout import BucketLayout
from thunder_overlap._bucketing.plan import BucketPlan
from thunder_overlap._bucketing.pool import BufferPool

__all__ = ["BucketState"]


class BucketState:
    """The buffers and shapes one bucket's collectives run on (``gather.py``, ``reduction.py``)."""

    def __init__(
        self,
        plan: BucketPlan,
        flat_shard: torch.Tensor,
        process_group: dist.ProcessGroup,
        pool: BufferPool,
        layout: BucketLayout,
        gather_dtype: torch.dtype | None = None,
    ) -> None:
        self.plan = plan
        self.flat_shard = flat_shard
        self.process_group = process_group
        self.world_size = process_group.size()
        self.pool = pool
        self.layout = layout
        # Each parameter's shard, made once: views taken during a step would be aten ops on the
        # parameters' storage in every step (memory trackers would count them as new).
        self.shard_pieces = [flat_shard[s.offset : s.offset + s.numel] for s in plan.slots]
        # What the all-gather sends: the flat shard itself, or its cast (mixed precision).
        self.gather_shard = flat_shard
        if gather_dtype is not None and gather_dtype != flat_shard.dtype:
            self.gather_shard = torch.empty_like(flat_shard, dtype=gather_dtype)
        self.gather_pieces = [self.gather_shard[s.offset : s.offset + s.numel] for s in plan.slots]
        # The gradient shards handed out, weakly (data pointer -> reference to the storage):
        # ``.grad`` owns them. A weak reference to the tensor would not do: its Python object
        # dies while views keep the storage alive.
        self._grad_shards: dict[int, StorageWeakRef] = {}
        # Gradients summed under no_sync, laid out like a reduce-scatter input; the next
        # reduce-scatter adds them and lets go.
        self.unsynced_grads: torch.Tensor | None = None

    @property
    def label(self) -> str:
        return self.plan.label

    def gathered_numel(self) -> int:
        """Elements of one unsharded buffer: every rank's flat shard."""
        return self.world_size * self.plan.shard_numel

    def shard_numel(self) -> int:
        return self.plan.shard_numel

    def unsharded_shape(self, slot: int) -> tuple[int, ...]:
        rows, *rest = self.plan.slots[slot].shard_shape
        return (rows * self.world_size, *rest)

    def shard_shape(self, slot: int) -> tuple[int, ...]:
        return self.plan.slots[slot].shard_shape

    def shard_view(self, slot: int) -> torch.Tensor:
        s = self.plan.slots[slot]
        return self.flat_shard[s.offset : s.offset + s.numel].view(s.shard_shape)

    def slot_views(self, flat: torch.Tensor, slots: tuple[int, ...]) -> list[torch.Tensor]:
        return [flat[s.offset : s.offset + s.numel].view(s.shard_shape) for s in (self.plan.slots[i] for i in slots)]

    @property
    def gather_dtype(self) -> torch.dtype:
        return self.gather_shard.dtype

    @property
    def reduce_dtype(self) -> torch.dtype:
        return self.flat_shard.dtype

    def cast_for_gather(self) -> None:
        """Casts the flat shard into the gather shard (mixed precision); nothing otherwise. Only
        this bucket's next gather writes it again, after this one's wait."""
        if self.gather_shard is not self.flat_shard:
            self.gather_shard.copy_(self.flat_shard)

    def acquire(self, purpose: str, *, gathered: bool = False) -> torch.Tensor:
        """A pool buffer of one unsharded bucket, named ``<label> <purpose>`` in the pool's slots:
        in the gather dtype for a ``gathered`` buffer, in the parameters' otherwise."""
        flat = self.gather_shard if gathered else self.flat_shard
        return self.pool.acquire(self.gathered_numel(), flat.dtype, flat.device, f"{self.plan.label} {purpose}")

    def new_grad_shard(self) -> torch.Tensor:
        """A new gradient shard, owned by whoever keeps it (``.grad``). Every element is written by
        the reduce-scatter; the padding past the last slot is never read."""
        shard = torch.empty_like(self.flat_shard)
        self.grad_shard_storages()  # forgets the expired
        self._grad_shards[shard.data_ptr()] = StorageWeakRef(shard.untyped_storage())
        return shard.view(-1)

    def grad_shard_storages(self) -> set[int]:
        """Data pointers of the gradient shards still alive (each of ``flat_shard``'s size)."""
        self._grad_shards = {ptr: ref for ptr, ref in self._grad_shards.items() if not ref.expired()}
        return set(self._grad_shards)

    def check_is_flat_shard(self, shards: list[torch.Tensor], slots: tuple[int, ...]) -> None:
        # Pointer arithmetic rather than shard_view: a view made here would be an aten op on the
        # parameters' storage in every step.
        base, itemsize = self.flat_shard.data_ptr(), self.flat_shard.element_size()
        for t, slot in zip(shards, slots, strict=True):
            if t.data_ptr() != base + self.plan.slots[slot].offset * itemsize:
                name = self.plan.slots[slot].name
                raise RuntimeError(
                    f"thunder_overlap bucketing: parameter {name!r} no longer lives in bucket "
                    f"{self.plan.label!r}'s flat buffer (was it replaced, e.g. by load_state_dict(assign=True)?). "
                    "Load with assign=False (the default), which copies into the existing parameters."
                )

    def check_gradient_count(self, grads: list[torch.Tensor]) -> None:
        if len(grads) != len(self.plan.slots):
            raise RuntimeError(
                f"thunder_overlap bucketing: bucket {self.plan.label!r} expects {len(self.plan.slots)} gradients, got {len(grads)}"
            )
