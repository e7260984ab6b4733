"""Persistent bucket buffers and the bucketed collectives that run on them.

Each bucket (see :mod:`thunder_overlap._bucketing.plan`) owns ``flat_shard`` for the life of the
module: this rank's shards back to back. The module's parameters are views of it, so the
optimizer updates it in place and the all-gather sends it with no copy-in.

Each step, a bucket's reduce-scatter writes into a new gradient shard, and its views become
``.grad`` (autograd keeps the tensor it is given when ``.grad`` is None). The shard is the
gradient, so it lives as long as ``.grad`` does: ``zero_grad(set_to_none=True)`` gives it back to
the allocator between steps, as it does an unbucketed reduce-scatter's output. Kept by the bucket
from one step to the next, it would cost a whole gradient (all of this rank's) at the next step's
activation peak, which comes before any gradient is reduced. It is the one allocation a bucket
makes per step, the gradient's own. A bucket whose reduce-scatter comes when a pool buffer would
sit idle to the end of the step (ZeRO2's gathered buffers once their block's backward is done)
reduces in place in that buffer instead, and its row is the gradient shard
(``BucketLayout.reduces_in_pool``); the buffer is busy while ``.grad`` aliases it, so a gradient
kept across steps makes the pool grow rather than be overwritten.

Unsharded buffers come from a :class:`BufferPool` shared by the module's buckets. Where the
backend runs a coalesced launch as one (NCCL: ``BucketLayout.launches_coalesced_as_one``), a
bucket gathers each parameter straight into its place in one buffer, whose views are the
parameters, and reduce-scatters each unpadded gradient where it is, straight into its slot of
the gradient shard: one launch each way, no copy and no buffer but the gathered one. gloo runs
such a launch one collective after another, each paying its latency, so there a bucket gathers
its flat shard rank-major into one buffer and copies it out parameter by parameter into a
second (unless the memory estimate chose it to gather per parameter, where that second buffer
would make the pool larger than the step needs: ``BucketLayout.per_tensor_gather``), and lays
its gradients out into a third with one ``_chunk_cat`` (so does a bucket whose gradients need
padding, on any backend), all-reduced in place there until the wait, or, where holding that
buffer to the wait would make the pool larger than the step needs, handed to gloo's own copy of
a reduce-scatter's input at the launch (``BucketLayout.reduce_scatter_from_copy``). A buffer is handed out again
only when no tensor of its storage is alive anymore. ZeRO2 keeps every gathered bucket alive
until backward, so the pool holds one buffer per bucket; ZeRO3 frees each after its last use,
so the pool holds no more than were alive at once. After the first step the pool allocates nothing.
The memory estimator plans the same buffers from the final traces
(:mod:`thunder_overlap._analysis.pool_slots`).

Under no_sync a bucket's gradients are laid out the same way but summed into
``unsynced_grads`` (unsharded, as in any data parallelism that skips the reduction) instead of
being reduce-scattered; the next reduce-scatter of the bucket adds the sum in and frees it.

The functions at the bottom are the implementations of the trace operators that
:class:`~thunder_overlap._transforms.BucketingTransform` puts in place of the per-parameter
collectives. Their first argument is a bucket id, looked up in a registry, because a trace can
only carry constants and proxies.
"""

from __future__ import annotations

import itertools
import time
import weakref
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef

from thunder_overlap._analysis.pool_slots import BucketLayout, PoolSlot, describe_slots
from thunder_overlap._bucketing.plan import BucketPlan

__all__ = [
    "BucketBuffers",
    "BufferPool",
    "PendingCollective",
    "PoolSlot",
    "bucket_layout",
    "lookup_bucket",
    "register_bucket",
    "runs_coalesced_launches_as_one",
]


def runs_coalesced_launches_as_one(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether a coalesced launch of several collectives costs about one launch on ``group``.

    NCCL groups them into one kernel. gloo runs them one after another (12 small reduce-scatters
    took 8x the time of one of their total on two CPU ranks), so gloo buckets keep gathering
    rank-major and laying their gradients out. The fake backend stands for NCCL: it is what
    predictions trace on.
    """
    backend = dist.get_backend(group)
    return backend == "fake" or (device.type == "cuda" and "nccl" in backend)


def _storage_users(t: torch.Tensor) -> int:
    """How many tensors (views included) share ``t``'s storage."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def _all_reduce_in_place(tensor: torch.Tensor, group: dist.ProcessGroup) -> dist.Work:
    """An async all-reduce of ``tensor`` whose release :meth:`PendingCollective.settle` can see.

    gloo's all-reduce work keeps the very tensor it is handed until its worker thread lets go,
    which may be after ``wait`` returns; a handle to a tensor the caller holds adds no storage
    user, so the buffer would turn idle by that thread's timing. Handed a view of its own, the
    work's hold is one storage user, released when the work is.
    """
    return dist.all_reduce(tensor.view(-1), group=group, async_op=True)


class _Reusable:
    """A buffer and the number of storage users it has when nothing outside holds a view."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer
        self.idle_users = _storage_users(buffer)
        # What it has held, in first-use order ("blocks.3 all-gather", ...).
        self.users: dict[str, None] = {}

    def is_idle(self) -> bool:
        return _storage_users(self.buffer) == self.idle_users


@dataclass
class BufferPool:
    """Flat buffers, reused once no view of theirs is alive.

    ``acquire`` returns a view: a buffer counts as busy for exactly as long as some view of it
    (the returned one, or any taken from it) is alive. Any use may take any idle buffer of its
    size and dtype, so all-gather outputs, copy-outs and reduce-scatter inputs share buffers.
    """

    allocations: int = 0
    allocated_bytes: int = 0
    _buffers: list[_Reusable] = field(default_factory=list)

    def acquire(self, numel: int, dtype: torch.dtype, device: torch.device, user: str = "") -> torch.Tensor:
        """A view of an idle buffer of ``numel`` x ``dtype`` (allocated when none is idle);
        ``user`` names the use in :attr:`slots`."""
        for entry in self._buffers:
            b = entry.buffer
            if b.numel() == numel and b.dtype == dtype and b.device == device and entry.is_idle():
                entry.users[user] = None
                return b.view(-1)
        buffer = torch.empty(numel, dtype=dtype, device=device)
        entry = _Reusable(buffer)
        entry.users[user] = None
        self._buffers.append(entry)
        self.allocations += 1
        self.allocated_bytes += numel * buffer.element_size()
        return buffer.view(-1)

    @property
    def buffers(self) -> list[torch.Tensor]:
        return [entry.buffer for entry in self._buffers]

    @property
    def slots(self) -> list[PoolSlot]:
        """Every buffer the pool holds, with what used it: the pool is as large as the most
        buffers of one size that were ever busy at once."""
        return [
            PoolSlot(e.buffer.numel(), str(e.buffer.dtype), e.buffer.numel() * e.buffer.element_size(), tuple(e.users))
            for e in self._buffers
        ]

    def __str__(self) -> str:
        return describe_slots("bucket pool (held for the module's life)", self.slots)


@dataclass
class PendingCollective:
    """What a bucketed collective's start returns and its wait consumes."""

    # None between prepare and launch, and for members of a coalesced launch (its manager waits).
    work: dist.Work | dist.distributed_c10d._CoalescingManager | None
    result: torch.Tensor
    # A view of the collective's input while it runs, so that its pool buffer stays busy.
    source: torch.Tensor | None = None
    # Storage users of result and source just before the launch (see settle).
    users_at_launch: tuple[int, int | None] | None = None
    # A reduce-scatter that reads the gradients where they are: (piece of result, gradient) per
    # tensor, sent as one launch; source is then None.
    sends: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    # Divides the result in place once complete (the average of a reduce-scatter that sends the
    # gradients themselves, which are the backward's tensors and not ours to change).
    divide_by: float | None = None
    # A laid-out input all-reduced in place (see launch_reduce_scatter): the wait copies this
    # rank's row of source into result.
    row_of_source: int | None = None

    def mark_launch(self) -> None:
        """Records how many tensors use the buffers before the backend takes its own views."""
        source_users = None if self.source is None else _storage_users(self.source)
        self.users_at_launch = (_storage_users(self.result), source_users)

    def settle(self, timeout_s: float = 1.0) -> None:
        """After the wait: returns once the backend has let go of the buffers' storage.

        gloo's worker thread still holds the finished work, and the views of our buffers it
        made, for a moment after ``wait`` returns. The pool reads "busy" from the storage's users,
        so without this a buffer would be busy or idle by that thread's timing, and the pool's
        assignment of uses to buffers (and at worst its size) would vary from step to step.
        After ``timeout_s`` it gives up: the pool then grows rather than anything hanging.
        """
        self.work = None
        if self.users_at_launch is None:
            return
        deadline = time.monotonic() + timeout_s
        pairs = [(self.result, self.users_at_launch[0]), (self.source, self.users_at_launch[1])]
        for tensor, users in pairs:
            while tensor is not None and _storage_users(tensor) > users and time.monotonic() < deadline:
                time.sleep(0)  # yield to the backend's thread


class BucketBuffers:
    """One bucket's persistent buffers and its collectives."""

    def __init__(
        self,
        plan: BucketPlan,
        flat_shard: torch.Tensor,
        process_group: dist.ProcessGroup,
        pool: BufferPool,
    ) -> None:
        self.plan = plan
        self.flat_shard = flat_shard
        self.process_group = process_group
        self.world_size = process_group.size()
        self.pool = pool
        # Its sizes, and the rules for when a copy-out or a lay-out is needed, which the
        # memory estimator follows too.
        self.layout = BucketLayout(
            label=plan.label,
            unsharded_numel=self.world_size * plan.shard_numel,
            dtype=str(flat_shard.dtype),
            itemsize=flat_shard.element_size(),
            tensors=len(plan.slots),
            world_size=self.world_size,
            launches_coalesced_as_one=runs_coalesced_launches_as_one(process_group, flat_shard.device),
            reduce_scatter_copies_input=dist.get_backend(process_group) == "gloo",
        )
        # Each parameter's shard, made once: views taken during a step would be aten ops on the
        # parameters' storage in every step (memory trackers would count it as new).
        self._shard_pieces = [flat_shard[s.offset : s.offset + s.numel] for s in plan.slots]
        # The gradient shards handed out, weakly (data pointer -> reference to the storage):
        # ``.grad`` owns them. A weak reference to the tensor would not do: its Python object
        # dies while views keep the storage alive.
        self._grad_shards: dict[int, StorageWeakRef] = {}
        # Gradients summed under no_sync, laid out like a reduce-scatter input; the next
        # reduce-scatter adds them and lets go.
        self.unsynced_grads: torch.Tensor | None = None

    def grad_shard_storages(self) -> set[int]:
        """Data pointers of the gradient shards still alive (each of ``flat_shard``'s size):
        those some ``.grad`` (or a pending collective) holds."""
        self._grad_shards = {ptr: ref for ptr, ref in self._grad_shards.items() if not ref.expired()}
        return set(self._grad_shards)

    # --- shapes -----------------------------------------------------------------------------


    def unsharded_shape(self, slot: int) -> tuple[int, ...]:
        rows, *rest = self.plan.slots[slot].shard_shape
        return (rows * self.world_size, *rest)

    def shard_view(self, slot: int) -> torch.Tensor:
        s = self.plan.slots[slot]
        return self.flat_shard[s.offset : s.offset + s.numel].view(s.shard_shape)

    def _check_is_flat_shard(self, shards: list[torch.Tensor], slots: tuple[int, ...]) -> None:
        # Pointer arithmetic rather than shard_view: a view made here would be an aten op on
        # the parameters' storage in every step (memory trackers would count it as new).
        base, itemsize = self.flat_shard.data_ptr(), self.flat_shard.element_size()
        for t, slot in zip(shards, slots, strict=True):
            if t.data_ptr() != base + self.plan.slots[slot].offset * itemsize:
                name = self.plan.slots[slot].name
                raise RuntimeError(
                    f"thunder_overlap bucketing: parameter {name!r} no longer lives in bucket "
                    f"{self.plan.label!r}'s flat buffer (was it replaced, e.g. by load_state_dict(assign=True)?). "
                    "Load with assign=False (the default), which copies into the existing parameters."
                )

    # --- all-gather -------------------------------------------------------------------------

    def start_all_gather(self, shards: list[torch.Tensor], slots: tuple[int, ...]) -> PendingCollective:
        pending = self.prepare_all_gather(shards, slots)
        pending.work = self.launch_all_gather(pending, async_op=True)
        return pending

    def prepare_all_gather(self, shards: list[torch.Tensor], slots: tuple[int, ...]) -> PendingCollective:
        """Everything before the launch: checks the shards and takes an output buffer (no work yet)."""
        self._check_is_flat_shard(shards, slots)
        out = self.pool.acquire(
            self.world_size * self.plan.shard_numel, self.flat_shard.dtype, self.flat_shard.device, f"{self.plan.label} all-gather"
        )
        return PendingCollective(None, out)

    def launch_all_gather(
        self, pending: PendingCollective, *, async_op: bool
    ) -> dist.Work | dist.distributed_c10d._CoalescingManager | None:
        """Issues the prepared all-gather; inside a ``_coalescing_manager`` it only joins that
        launch (``async_op=False``). Gathered in place, it is one all-gather per parameter into
        the parameter's own place, one launch of its own when async."""
        pending.mark_launch()
        group = self.process_group
        if not self.layout.gathers_in_place:
            return dist.all_gather_into_tensor(pending.result, self.flat_shard, group=group, async_op=async_op)
        world = self.world_size
        places = [pending.result[world * s.offset : world * (s.offset + s.numel)] for s in self.plan.slots]
        if async_op:
            with dist._coalescing_manager(group, async_ops=True) as manager:
                for place, shard in zip(places, self._shard_pieces, strict=True):
                    dist.all_gather_into_tensor(place, shard, group=group)
            return manager
        work = None
        for place, shard in zip(places, self._shard_pieces, strict=True):
            work = dist.all_gather_into_tensor(place, shard, group=group, async_op=async_op)
        return work

    def finish_all_gather(self, pending: PendingCollective, slots: tuple[int, ...]) -> list[torch.Tensor]:
        """Waits, then lays the gathered ranks out parameter by parameter (:meth:`copy_out`)."""
        pending.work.wait()
        pending.settle()
        return self.copy_out(pending.result, slots)

    def copy_out(self, gathered: torch.Tensor, slots: tuple[int, ...]) -> list[torch.Tensor]:
        """The unsharded parameters of ``slots`` from a finished gather, with at most one copy.

        A rank-major gather output (every rank's whole flat shard in turn) is copied out, since
        an unsharded parameter needs its rows from every rank next to each other. With one slot,
        or one rank, the two layouts coincide, and a gather in place is parameter-major already:
        views suffice.
        """
        world, plan = self.world_size, self.plan
        unsharded = gathered
        if self.layout.copies_out:
            unsharded = self.pool.acquire(gathered.numel(), gathered.dtype, gathered.device, f"{plan.label} copy-out")
        pieces = [unsharded[world * s.offset : world * (s.offset + s.numel)] for s in plan.slots]
        if unsharded is not gathered:
            torch.split_with_sizes_copy(
                gathered.view(world, plan.shard_numel),
                [s.numel for s in plan.slots],
                dim=1,
                out=[p.view(world, s.numel) for p, s in zip(pieces, plan.slots, strict=True)],
            )
        return [pieces[i].view(self.unsharded_shape(i)) for i in slots]

    # --- reduce-scatter ---------------------------------------------------------------------

    def _new_grad_shard(self) -> torch.Tensor:
        # Every element is written by the reduce-scatter; the padding past the last slot is
        # never read (the optimizer sees the slots' views).
        shard = torch.empty_like(self.flat_shard)
        self.grad_shard_storages()  # forgets the expired
        self._grad_shards[shard.data_ptr()] = StorageWeakRef(shard.untyped_storage())
        return shard.view(-1)

    def _check_gradient_count(self, grads: list[torch.Tensor]) -> None:
        if len(grads) != len(self.plan.slots):
            raise RuntimeError(
                f"thunder_overlap bucketing: bucket {self.plan.label!r} expects {len(self.plan.slots)} gradients, got {len(grads)}"
            )

    def _lay_out(self, grads: list[torch.Tensor], purpose: str = "reduce-scatter") -> torch.Tensor:
        """Copies (and pads) every gradient of the bucket into a pool buffer with one
        ``_chunk_cat``: row r of its (world_size, shard_numel) view is what rank r receives."""
        self._check_gradient_count(grads)
        flat = self.flat_shard
        laid_out = self.pool.acquire(self.world_size * self.plan.shard_numel, flat.dtype, flat.device, f"{self.plan.label} {purpose}")
        torch._chunk_cat(grads, dim=0, num_chunks=self.world_size, out=laid_out.view(self.world_size, self.plan.shard_numel))
        return laid_out

    def _sends_gradients(self, grads: list[torch.Tensor]) -> bool:
        """True when the gradients are sent where they are: the backend runs their launch as one,
        none is padded, nothing is summed under no_sync, and they have the bucket's dtype (the
        memory estimator decides from the layout and the numels)."""
        return (
            self.layout.sends_gradients([g.numel() for g in grads])
            and self.unsynced_grads is None
            and all(g.dtype == self.flat_shard.dtype for g in grads)
        )

    def start_reduce_scatter(self, grads: list[torch.Tensor], divisor: float | None) -> PendingCollective:
        pending = self.prepare_reduce_scatter(grads, divisor)
        pending.work = self.launch_reduce_scatter(pending, async_op=True)
        return pending

    def prepare_reduce_scatter(self, grads: list[torch.Tensor], divisor: float | None) -> PendingCollective:
        """Everything before the launch: takes a new gradient shard to reduce into and, for a
        padded bucket, lays the gradients out (adding those summed under no_sync) and pre-averages.

        Gradients that need no padding are sent where they are, each into its slot of the
        gradient shard, and the shard is averaged once complete: no copy and no pool buffer (the
        backward frees each gradient once the collective is done with it, as without buckets).
        """
        self._check_gradient_count(grads)
        if self.layout.reduces_in_pool:
            return self._prepare_in_pool(grads, divisor)
        shard = self._new_grad_shard()
        if self._sends_gradients(grads):
            pieces = [shard[s.offset : s.offset + s.numel] for s in self.plan.slots]
            # A gradient can come strided (a transposed matmul's); a collective needs it dense.
            sends = [(piece, g.contiguous().view(-1)) for piece, g in zip(pieces, grads, strict=True)]
            return PendingCollective(None, shard, sends=sends, divide_by=divisor)
        reduce_input = self._lay_out(grads)
        if self.unsynced_grads is not None:
            reduce_input.add_(self.unsynced_grads)
            self.unsynced_grads = None
        if divisor is not None:
            reduce_input.div_(divisor)
        return PendingCollective(None, shard, source=reduce_input)

    def _prepare_in_pool(self, grads: list[torch.Tensor], divisor: float | None) -> PendingCollective:
        """The gradients laid out into a pool buffer, reduced in place: this rank's row of it is
        the gradient shard (``BucketLayout.reduces_in_pool``), and keeps the buffer busy until
        the last view of the shard dies."""
        laid_out = self._lay_out(grads, "reduce-scatter in place")
        if self.unsynced_grads is not None:
            laid_out.add_(self.unsynced_grads)
            self.unsynced_grads = None
        if divisor is not None:
            laid_out.div_(divisor)
        own_row = laid_out.view(self.world_size, self.plan.shard_numel)[self.process_group.rank()]
        return PendingCollective(None, own_row, source=laid_out)

    def reduce_in_pool(self) -> None:
        """From the next reduce-scatter on, reduce in place in a pool buffer whose row is the
        gradient shard (chosen from the schedule: :func:`~thunder_overlap._analysis.pool_slots.plan_shards_in_pool`),
        rather than from the backend's copy, if it did."""
        self.layout = replace(self.layout, reduces_in_pool=True, reduce_scatter_from_copy=False)

    def launch_reduce_scatter(
        self, pending: PendingCollective, *, async_op: bool
    ) -> dist.Work | dist.distributed_c10d._CoalescingManager | None:
        """Issues the prepared reduce-scatter; inside a ``_coalescing_manager`` it only joins that
        launch (``async_op=False``). Gradients sent where they are go out as one launch of their own."""
        pending.mark_launch()
        group = self.process_group
        if pending.sends is None and async_op and self.layout.reduce_scatter_from_copy:
            # gloo copies the whole input at the launch, in this thread, and keeps no view of it:
            # the laid-out pool buffer is free for the next use at once, the copy is held to the
            # wait. Chosen where the buffer held to the wait would grow the pool.
            work = dist.reduce_scatter_tensor(pending.result, pending.source, group=group, async_op=True)
            pending.source = None
            return work
        if pending.sends is None and async_op and self.layout.reduce_scatter_copies_input:
            # gloo's reduce-scatter all-reduces a copy of its whole input, held until the wait,
            # then copies out this rank's row. The laid-out buffer is ours to overwrite: the same
            # all-reduce runs on it in place, with no copy. (In a coalesced launch every member
            # must be a reduce-scatter, so there gloo keeps its copy.)
            if not self.layout.reduces_in_pool:  # else the result is that row already
                pending.row_of_source = group.rank()
            return _all_reduce_in_place(pending.source, group)
        if pending.sends is None:
            return dist.reduce_scatter_tensor(pending.result, pending.source, group=group, async_op=async_op)
        if async_op and len(pending.sends) > 1:
            with dist._coalescing_manager(group, async_ops=True) as manager:
                for piece, g in pending.sends:
                    dist.reduce_scatter_tensor(piece, g, group=group)
            return manager
        work = None
        for piece, g in pending.sends:  # one alone, or members of the caller's launch
            work = dist.reduce_scatter_tensor(piece, g, group=group, async_op=async_op)
        return work

    def finish_reduce_scatter(self, pending: PendingCollective, slots: tuple[int, ...]) -> list[torch.Tensor]:
        pending.work.wait()
        pending.settle()
        return self.reduced_views(pending, slots)

    def reduced_views(self, pending: PendingCollective, slots: tuple[int, ...]) -> list[torch.Tensor]:
        """The gradient shards of ``slots`` from a finished reduce-scatter (views, no copy),
        averaged in place if the reduce-scatter sent the gradients themselves."""
        pending.sends = None  # the backward may free the gradients now
        if pending.row_of_source is not None:
            pending.result.copy_(pending.source.view(self.world_size, -1)[pending.row_of_source])
            pending.row_of_source = None
        if pending.divide_by is not None:
            pending.result.div_(pending.divide_by)
            pending.divide_by = None
        return self._slot_views(pending.result, slots)

    def _slot_views(self, flat: torch.Tensor, slots: tuple[int, ...]) -> list[torch.Tensor]:
        return [flat[s.offset : s.offset + s.numel].view(s.shard_shape) for s in (self.plan.slots[i] for i in slots)]

    # --- all-reduce across replicas (hybrid sharding) ----------------------------------------

    def start_all_reduce(self, reduced: list[torch.Tensor], group: dist.ProcessGroup, divisor: float) -> PendingCollective:
        """Sums the bucket's reduced gradient shard over ``group`` in place, pre-divided by
        ``divisor``: one all-reduce on the persistent buffer that ``reduced`` (the views of its
        reduce-scatter's wait) live in."""
        flat = self._grad_shard_holding(reduced[0])
        flat.div_(divisor)
        pending = PendingCollective(None, flat)
        pending.mark_launch()
        pending.work = _all_reduce_in_place(flat, group)
        return pending

    def finish_all_reduce(self, pending: PendingCollective, slots: tuple[int, ...]) -> list[torch.Tensor]:
        pending.work.wait()
        pending.settle()
        return self._slot_views(pending.result, slots)

    def _grad_shard_holding(self, view: torch.Tensor) -> torch.Tensor:
        storage = view.untyped_storage().data_ptr()
        if storage in self.grad_shard_storages():
            # The shard starts its storage (a tensor of its own): its whole flat view.
            return view.new_empty(0).set_(view.untyped_storage(), 0, (self.flat_shard.numel(),))
        if self.layout.reduces_in_pool:
            for buffer in self.pool.buffers:
                if buffer.untyped_storage().data_ptr() == storage:
                    return buffer.view(self.world_size, -1)[self.process_group.rank()]
        raise RuntimeError(f"thunder_overlap bucketing: bucket {self.plan.label!r} holds no gradient shard that this gradient lives in")

    # --- no_sync ----------------------------------------------------------------------------

    def accumulate_unsynced(self, grads: list[torch.Tensor], slots: tuple[int, ...]) -> list[torch.Tensor]:
        """Adds the gradients to :attr:`unsynced_grads` instead of reduce-scattering them.

        Returns this rank's part of the sum, shaped like the shards, only so the trace has its
        gradients to return: Thunder hands autograd None under no_sync.
        """
        laid_out = self._lay_out(grads)
        if self.unsynced_grads is None:
            self.unsynced_grads = laid_out.clone()
        else:
            self.unsynced_grads.add_(laid_out)
        rank = self.process_group.rank()
        own = self.unsynced_grads.view(self.world_size, self.plan.shard_numel)[rank]
        return self._slot_views(own, slots)


# Buckets by id. Values are weak: the BucketingTransform that made them keeps them alive as long
# as its module lives.
_REGISTRY: weakref.WeakValueDictionary[int, BucketBuffers] = weakref.WeakValueDictionary()
_ids = itertools.count()


def register_bucket(bucket: BucketBuffers) -> int:
    bucket_id = next(_ids)
    _REGISTRY[bucket_id] = bucket
    return bucket_id


def lookup_bucket(bucket_id: int) -> BucketBuffers:
    try:
        return _REGISTRY[bucket_id]
    except KeyError:
        raise RuntimeError(f"thunder_overlap bucketing: bucket {bucket_id} belongs to a module that no longer exists") from None


def bucket_layout(bucket_id: int) -> BucketLayout | None:
    """The layout of a live bucket; None for an id no live module holds (a synthetic trace)."""
    bucket = _REGISTRY.get(bucket_id)
    return None if bucket is None else bucket.layout


def all_gather_bucket(bucket_id: int, group: dist.ProcessGroup, shards: list[torch.Tensor], slots: tuple[int, ...]) -> PendingCollective:
    return lookup_bucket(bucket_id).start_all_gather(shards, slots)


def wait_all_gather_bucket(pending: PendingCollective, bucket_id: int, slots: tuple[int, ...]) -> list[torch.Tensor]:
    return lookup_bucket(bucket_id).finish_all_gather(pending, slots)


def reduce_scatter_bucket(
    bucket_id: int, group: dist.ProcessGroup, grads: list[torch.Tensor], divisor: float | None
) -> PendingCollective:
    return lookup_bucket(bucket_id).start_reduce_scatter(grads, divisor)


def wait_reduce_scatter_bucket(pending: PendingCollective, bucket_id: int, slots: tuple[int, ...]) -> list[torch.Tensor]:
    return lookup_bucket(bucket_id).finish_reduce_scatter(pending, slots)


def accumulate_bucket_grads(bucket_id: int, grads: list[torch.Tensor], slots: tuple[int, ...]) -> list[torch.Tensor]:
    return lookup_bucket(bucket_id).accumulate_unsynced(grads, slots)


def all_reduce_bucket(bucket_id: int, group: dist.ProcessGroup, reduced: list[torch.Tensor], divisor: float) -> PendingCollective:
    return lookup_bucket(bucket_id).start_all_reduce(reduced, group, divisor)


def wait_all_reduce_bucket(pending: PendingCollective, bucket_id: int, slots: tuple[int, ...]) -> list[torch.Tensor]:
    return lookup_bucket(bucket_id).finish_all_reduce(pending, slots)
