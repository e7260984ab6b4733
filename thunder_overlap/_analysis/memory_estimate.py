"""Predicted memory of an execution trace.

:func:`estimate_memory` walks a trace once and follows *storages*, not proxies: a view, a reshape
that needs no copy, ``shallow_copy``, a collective's wait and an in-place op (``copy_``, ``add_``)
bind their output to the storage of their input, so an alias is counted once and the storage dies
with its last alias (a ``del``, or the clearing of the collection that held it). Strides are
followed symbolically, so a reshape of a transposed tensor is known to copy, as PyTorch does.
Collectives allocate their output when issued and keep their input alive as long as their future
(NCCL and gloo hold it in the ``Work`` the future owns); a reduce-scatter's unsharded gradient is
therefore released with the future, deleted right after its wait, not at its own ``del``.
Persistent tensors (parameters; the forward's inputs) are counted once and never freed. Passing
the forward's estimate to the backward's makes tensors saved for backward keep their storage
sharing and persistence across the two traces.

Bucketed collectives run on the bucket pool's buffers, each busy for as long as its path keeps it
(:mod:`~thunder_overlap._analysis.memory_books`, :mod:`~thunder_overlap._analysis.layout`); the
estimate records each buffer's live interval on the step's timeline, plans the pool's slots from
them (:mod:`~thunder_overlap._analysis.pool_slots`) and counts the plan as persistent, for the
whole step, as the pool holds it. Under mixed precision each bucket also holds its cast shard (what
its all-gather sends) for the module's life: counted as persistent too.

(``thunder_overlap.testing.memory_check`` runs a trace and compares what it measures with this
estimate.)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from thunder.core import prims
from thunder.core.devices import to_torch_device
from thunder.core.proxies import CollectionProxy, FutureTensorProxy, Proxy, TensorProxy
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx, TraceTag
from thunder.executors import pythonex

from thunder_overlap import _ops as ops
from thunder_overlap._analysis.aliasing import alias_source, contiguous_strides
from thunder_overlap._analysis.layout import NO_BUCKETS, BucketLayouts
from thunder_overlap._analysis.memory_books import DONE, StorageBooks, run_bucket_op
from thunder_overlap._analysis.pool_slots import PoolInterval, ReduceScatterIssue, SlotPlan, plan_slots
from thunder_overlap._backends import backend_of

__all__ = ["CUDA_ALLOCATION_GRANULARITY", "HandedOver", "MemoryEstimate", "BackendCopy", "backend_copy", "estimate_memory"]

# The CUDA caching allocator rounds every block up to a multiple of 512 bytes (kMinBlockSize in
# c10/cuda/CUDACachingAllocator.cpp); estimates compared with CUDA counters round the same way.
CUDA_ALLOCATION_GRANULARITY = 512

_UNPACK_IDS = (prims.PrimIDs.UNPACK_TRIVIAL, prims.PrimIDs.UNPACK_SEQUENCE)


@dataclass(frozen=True)
class HandedOver:
    """A tensor alive at the end of one trace, as the next trace receives it."""

    storage: int
    nbytes: int
    persistent: bool
    strides: tuple[int, ...] | None
    # A bucket pool buffer still busy: its use so far (its end is the handing trace's end).
    pool_use: PoolInterval | None = None


def _received_as(previous: HandedOver, proxy: TensorProxy) -> bool:
    """Whether ``proxy`` can be the tensor the previous trace handed over under its name: as many
    dimensions as it had (bytes may differ: an expanded view is larger than its storage)."""
    return previous.strides is None or len(previous.strides) == len(proxy.shape)


@dataclass
class MemoryEstimate:
    """Predicted live bytes around each bound symbol of ``trace`` (indices into
    ``trace.bound_symbols``)."""

    trace: TraceCtx
    # Bytes alive before the first bound symbol: the inputs.
    input_bytes: int
    # Inputs (and storages they share) that are never freed: parameters.
    persistent_bytes: int
    allocated: list[int]
    freed: list[int]
    # Live bytes once each bound symbol has run, and while it runs (its outputs allocated, its
    # inputs not yet released).
    live_after: list[int]
    peak_during: list[int]
    # What each name alive at the end holds, for the trace that receives it (the backward).
    final_storages: dict[str, HandedOver] = field(default_factory=dict, repr=False)
    # The step's timeline so far: this trace's bound symbols follow those of ``after``'s.
    timeline_start: int = 0
    # Every bucket pool buffer's use in the step so far (those still busy end with this trace),
    # and the pool they need. Its bytes are included in every figure above, as persistent.
    pool_intervals: list[PoolInterval] = field(default_factory=list, repr=False)
    pool: SlotPlan = field(default_factory=SlotPlan)
    # The uses among them that are over (those still busy continue in the next trace).
    pool_intervals_done: list[PoolInterval] = field(default_factory=list, repr=False)
    # The buckets' cast shards (mixed precision), held all along as the pool is, and included in
    # every figure above like it.
    cast_shard_bytes: int = 0
    # This trace's lone bucketed reduce-scatters not yet in place in the pool, for
    # :func:`~thunder_overlap._analysis.pool_slots.plan_shards_in_pool`.
    reduce_scatter_issues: list[ReduceScatterIssue] = field(default_factory=list, repr=False)

    @property
    def peak_bytes(self) -> int:
        return max(self.peak_during, default=self.input_bytes)

    @property
    def peak_beyond_inputs_bytes(self) -> int:
        """The peak less the persistent inputs this trace holds (parameters, the batch), the
        buckets' own buffers kept (the pool, the cast shards): what a tracker started with the
        step counts, since the step never writes those inputs."""
        return self.peak_bytes - (self.persistent_bytes - self.bucket_buffer_bytes)

    @property
    def bucket_buffer_bytes(self) -> int:
        """Persistent bytes the buckets hold beyond the parameters: the pool and the cast shards."""
        return self.pool.nbytes + self.cast_shard_bytes

    @property
    def timeline_end(self) -> int:
        return self.timeline_start + len(self.live_after)




def _op_name(bsym: BoundSymbol) -> str:
    return bsym.sym.name.removeprefix("overlap_")


def estimate_memory(
    trace: TraceCtx,
    *,
    layouts: BucketLayouts = NO_BUCKETS,
    after: MemoryEstimate | None = None,
    persistent_inputs: Iterable[str] | None = None,
    allocation_granularity: int = 1,
) -> MemoryEstimate:
    """Predicts live bytes around every bound symbol of an execution trace.

    Args:
        trace: a final forward or backward execution trace (with its ``del``s).
        layouts: the layouts of the buckets its bucketed collectives name
            (``BucketingTransform.layouts``).
        after: the estimate of the trace that produced this one's inputs (the forward, for a
            backward): inputs it returned keep their shared storages and persistence.
        persistent_inputs: names of inputs never freed. Default: every tensor argument of a
            forward trace (parameters and batch are held by the caller), none of a backward's.
        allocation_granularity: round every storage up to this many bytes
            (:data:`CUDA_ALLOCATION_GRANULARITY` to compare with CUDA's counters).
    """
    if allocation_granularity < 1:
        raise ValueError(f"allocation_granularity must be a positive byte count, got {allocation_granularity}")
    books = StorageBooks(allocation_granularity)
    timeline_start = after.timeline_end if after is not None else 0
    estimate = MemoryEstimate(trace, 0, 0, [], [], [], [], timeline_start=timeline_start)
    books.now = timeline_start
    persistent = _persistence(trace, persistent_inputs)
    # Every input is alive when the trace starts, wherever its unpacking is written.
    receive = _Receiver(books, after, persistent)
    for bsym in trace.bound_symbols:
        if bsym.sym.id in _UNPACK_IDS:
            _unpack(bsym, books, receive)
    if after is not None and (held := _held_not_received(after, receive.handed_over)):
        # The previous trace's persistent inputs this one does not receive (the parameter
        # shards the module holds, the batch the caller holds) stay allocated all along: without
        # them a backward whose peak is the step's (activation checkpointing moves it there)
        # would be under-counted by the shards.
        books.new_storage(None, persistent=True, nbytes=held)
    estimate.input_bytes = books.live
    for index, bsym in enumerate(trace.bound_symbols):
        books.now = timeline_start + index
        books.allocated = books.freed = 0
        live_before = books.live
        _step(bsym, books, layouts)
        estimate.allocated.append(books.allocated)
        estimate.freed.append(books.freed)
        estimate.live_after.append(books.live)
        estimate.peak_during.append(live_before + books.allocated)
    estimate.persistent_bytes = sum(n for n, p in zip(books.nbytes, books.persistent, strict=True) if p)
    estimate.final_storages = {
        name: HandedOver(s, books.nbytes[s], books.persistent[s], books.strides.get(name), books.pool_use.get(s))
        for name, s in books.storage_of.items()
    }
    estimate.reduce_scatter_issues = books.reduce_scatter_issues
    _count_pool(estimate, books, after)
    estimate.cast_shard_bytes = sum(layout.cast_shard_nbytes for layout in layouts.values())
    _count_persistent(estimate, estimate.cast_shard_bytes)
    return estimate


def _held_not_received(after: MemoryEstimate, received: Mapping[int, int]) -> int:
    """Bytes of ``after``'s persistent storages (the buckets' own aside) that no input of the
    next trace is bound to (``received``: storage ids in ``after`` -> ids in the next trace)."""
    received_bytes = {
        h.storage: h.nbytes for h in after.final_storages.values() if h.storage in received and h.persistent and h.pool_use is None
    }
    return after.persistent_bytes - after.bucket_buffer_bytes - sum(received_bytes.values())


def _persistence(trace: TraceCtx, persistent_inputs: Iterable[str] | None):
    """Whether an input (by name) is never freed: those named, or by default every input of a
    forward (the caller holds parameters and batch) and none of a backward."""
    if persistent_inputs is not None:
        names = set(persistent_inputs)
        return names.__contains__
    forward = TraceTag.BACKWARD not in trace.tags
    return lambda name: forward


class _Receiver:
    """Binds each input of the trace to a storage: the one the previous trace handed over under
    its name (shared storages stay shared, pool buffers stay busy), or a new one."""

    def __init__(self, books: StorageBooks, after: MemoryEstimate | None, persistent) -> None:
        self.books, self.after, self.persistent = books, after, persistent
        self.handed_over: dict[int, int] = {}  # storage id in ``after`` -> storage id here

    def __call__(self, proxy: TensorProxy) -> None:
        books = self.books
        strides = contiguous_strides(tuple(int(s) for s in proxy.shape))
        previous = self.after.final_storages.get(proxy.name) if self.after is not None else None
        if previous is not None and not _received_as(previous, proxy):
            # Names are matched, not identities: a backward can reuse a name the forward gave
            # another tensor (seen with a parameter left out of its bucket). Count it as its own.
            previous = None
        if previous is None:
            books.bind(proxy.name, books.new_storage(proxy, self.persistent(proxy.name)), strides)
            return
        if previous.storage not in self.handed_over and previous.pool_use is not None:
            self.handed_over[previous.storage] = books.resume_pool_storage(previous.pool_use)
        elif previous.storage not in self.handed_over:
            self.handed_over[previous.storage] = books.new_storage(proxy, previous.persistent, previous.nbytes)
        books.bind(proxy.name, self.handed_over[previous.storage], previous.strides)


def _step(bsym: BoundSymbol, books: StorageBooks, layouts: BucketLayouts) -> None:
    if bsym.sym.id is prims.PrimIDs.DEL:
        for p in bsym.flat_proxy_args:
            books.drop_name(p.name)
    elif bsym.sym.id == pythonex.clear_mutable_collection.id:
        books.clear(bsym.flat_proxy_args[0].name)
    elif bsym.sym.id not in _UNPACK_IDS and bsym.sym.id is not prims.PrimIDs.RETURN:
        _run_op(bsym, books, layouts)


def _count_pool(estimate: MemoryEstimate, books: StorageBooks, after: MemoryEstimate | None) -> None:
    """Plans the pool from the step's buffer uses so far and adds it to every figure: the pool
    holds its buffers from before the step starts to after it ends."""
    done_before = after.pool_intervals_done if after is not None else []
    estimate.pool_intervals_done = [*done_before, *books.pool_done]
    still_busy = [replace(use, end=estimate.timeline_end) for use in books.pool_use.values()]
    estimate.pool_intervals = [*estimate.pool_intervals_done, *still_busy]
    estimate.pool = plan_slots(estimate.pool_intervals)
    _count_persistent(estimate, estimate.pool.nbytes)


def _count_persistent(estimate: MemoryEstimate, nbytes: int) -> None:
    """Adds ``nbytes`` held from before the trace to after it to every figure of ``estimate``."""
    estimate.input_bytes += nbytes
    estimate.persistent_bytes += nbytes
    estimate.live_after = [b + nbytes for b in estimate.live_after]
    estimate.peak_during = [b + nbytes for b in estimate.peak_during]


def _unpack(bsym: BoundSymbol, books: StorageBooks, new_input) -> None:
    source = bsym.args[0] if bsym.sym.id is prims.PrimIDs.UNPACK_SEQUENCE else None
    for out in bsym.flat_proxy_outs:
        if isinstance(out, TensorProxy):
            if out.name in books.storage_of:  # a tensor unpacked twice is one local name
                continue
            new_input(out)
            member: int | str = books.storage_of[out.name]
            holders = books.refs
        elif isinstance(out, CollectionProxy):
            books.collection_refs[out.name] = books.collection_refs.get(out.name, 0) + 1
            member, holders = out.name, books.collection_refs
        else:
            continue
        if isinstance(source, Proxy):
            # The collection holds its element too, until it is cleared or dies.
            books.members.setdefault(source.name, []).append(member)
            holders[member] += 1


def _run_op(bsym: BoundSymbol, books: StorageBooks, layouts: BucketLayouts) -> None:
    name = _op_name(bsym)
    args = [a for a in bsym.flat_proxy_args if isinstance(a, (TensorProxy, FutureTensorProxy))]
    first = args[0] if args else None
    is_collective = any(isinstance(o, FutureTensorProxy) for o in bsym.flat_proxy_outs)
    is_wait = not is_collective and len(args) == 1 and isinstance(first, FutureTensorProxy)
    pool_holds = run_bucket_op(bsym, books, layouts)
    if pool_holds is DONE:
        return
    if is_wait and bsym.sym.id == ops.coalesced_wait.id:  # each output is its member's own tensor
        launch = books.storage_of[first.name]
        for out in bsym.flat_proxy_outs:
            books.bind(out.name, books.carve(launch, out), contiguous_strides(tuple(int(s) for s in out.shape)))
        return
    for position, out in enumerate(bsym.flat_proxy_outs):
        if not isinstance(out, (TensorProxy, FutureTensorProxy)) or out.name in books.storage_of:
            continue  # not a tensor, or an op that returns its (same-named) input
        shape = tuple(int(s) for s in out.shape)
        if name == "update_aliases":  # Thunder's in-place bookkeeping: output i is input i
            source = bsym.flat_proxy_args[position].name
            books.bind(out.name, books.storage_of[source], books.strides.get(source))
            continue
        source, strides = alias_source(name, bsym, first, out, shape, books.strides, is_wait)
        if source is None:
            books.bind(out.name, books.new_storage(out), contiguous_strides(shape))
        else:
            books.bind(out.name, books.storage_of[source], strides)
    if is_collective:
        held = [books.storage_of[a.name] for a in args if a.name in books.storage_of] if pool_holds is None else pool_holds
        if (copy := backend_copy(bsym)) is not None:
            copies = [books.new_storage(t) for t in copy.copied_inputs]
            held = [*held, *copies] if copy.keeps_inputs else copies
        for storage in held:
            books.refs[storage] += 1
        for out in bsym.flat_proxy_outs:
            books.held_by_future[out.name] = held


@dataclass(frozen=True)
class BackendCopy:
    """What the backend holds from a reduce-scatter's launch to its wait when it reduces copies of
    the inputs (gloo; see :class:`~thunder_overlap._backends.Backend`): the copies, and the inputs
    themselves only where the launch keeps them too. A plain launch keeps no view of its input (the
    trace may free it at once); a coalesced one's launch object keeps its members' inputs besides
    (_ops.CoalescedLaunch)."""

    copied_inputs: list[TensorProxy]
    keeps_inputs: bool


def backend_copy(bsym: BoundSymbol) -> BackendCopy | None:
    """The copies the backend makes of the inputs of a reduce-scatter of Thunder's (alone, or
    coalesced); None for any other op, or a backend that reduces in place. Bucketed ones are the
    bucket paths' (``memory_books``)."""
    if bsym.sym.id in ops.PLAIN_REDUCE_SCATTERS:
        tensors, group, keeps_inputs = [bsym.args[0]], bsym.args[2], False
    elif bsym.sym.id == ops.coalesced_reduce_scatter.id:
        (group, _, tensors), keeps_inputs = bsym.args[:3], True
    else:
        return None
    if not backend_of(group, to_torch_device(tensors[0].device)).copies_reduce_scatter_input:
        return None
    return BackendCopy(list(tensors), keeps_inputs)
