"""The memory estimator's bookkeeping while it walks a trace: storages and their references,
collections and what they hold, what each collective's future keeps alive, and the bucket pool's
buffers with the interval each use keeps one busy (``_bucketing/buffers.py`` runs the same paths)."""

from __future__ import annotations

from dataclasses import replace

from thunder.core.proxies import FutureTensorProxy, TensorProxy
from thunder.core.symbol import BoundSymbol

from thunder_overlap import _ops as ops
from thunder_overlap._analysis.aliasing import contiguous_strides, is_contiguous
from thunder_overlap._analysis.layout import BucketLayout, BucketLayouts, GatherPath, ReducePath, layout_of
from thunder_overlap._analysis.pool_slots import PoolInterval, ReduceScatterIssue

__all__ = ["DONE", "StorageBooks", "run_bucket_op"]


class StorageBooks:
    """Reference counts of storages and collections while the trace is walked."""

    def __init__(self, granularity: int) -> None:
        self.granularity = granularity
        self.storage_of: dict[str, int] = {}
        self.strides: dict[str, tuple[int, ...] | None] = {}
        self.nbytes: list[int] = []
        self.refs: list[int] = []
        self.persistent: list[bool] = []
        self.members: dict[str, list[int | str]] = {}
        self.collection_refs: dict[str, int] = {}
        self.held_by_future: dict[str, list[int]] = {}
        self.live = 0
        self.allocated = 0
        self.freed = 0
        # Bucket pool buffers: their use while busy, and the uses already over. The pool holds
        # their bytes for the whole step, so they are not in ``live``.
        self.pool_use: dict[int, PoolInterval] = {}
        self.pool_done: list[PoolInterval] = []
        # A coalesced bucket all-gather's members, for its wait: (layout, gather buffer, outputs).
        self.coalesced_gathers: dict[str, list[tuple[BucketLayout, int, int]]] = {}
        # Lone bucketed reduce-scatters that could run in place in the pool (plan_shards_in_pool).
        self.reduce_scatter_issues: list[ReduceScatterIssue] = []
        self.now = 0  # the bound symbol being walked, on the step's timeline

    def new_storage(self, proxy: TensorProxy | FutureTensorProxy | None, persistent: bool = False, nbytes: int | None = None) -> int:
        if nbytes is None:
            # From the shape: FSDP's sharded proxies keep the unsharded ``numel``.
            nbytes = ops.numel(proxy) * proxy.dtype.bytes
        nbytes = -(-nbytes // self.granularity) * self.granularity
        self.nbytes.append(nbytes)
        self.refs.append(0)
        self.persistent.append(persistent)
        self.live += nbytes
        self.allocated += nbytes
        return len(self.nbytes) - 1

    def new_pool_storage(self, layout: BucketLayout, purpose: str, *, gathered: bool = False) -> int:
        """A pool buffer of ``layout``'s size for ``purpose``, busy from now until its last
        reference goes: in the gather dtype for a ``gathered`` buffer (an all-gather's, a
        copy-out's), in the parameters' otherwise."""
        dtype, itemsize = (layout.gather_dtype, layout.gather_itemsize) if gathered else (layout.dtype, layout.itemsize)
        use = PoolInterval(f"{layout.label} {purpose}", layout.unsharded_numel, dtype, itemsize, self.now, self.now)
        return self.resume_pool_storage(use)

    def resume_pool_storage(self, use: PoolInterval) -> int:
        """A pool buffer busy since ``use.start`` (one the forward handed over)."""
        self.nbytes.append(use.numel * use.itemsize)
        self.refs.append(0)
        self.persistent.append(False)
        self.pool_use[len(self.nbytes) - 1] = use
        return len(self.nbytes) - 1

    def release_pool_storage(self, storage: int) -> None:
        """A pool buffer busy for the op being walked only."""
        self.pool_done.append(replace(self.pool_use.pop(storage), end=self.now + 1))

    def carve(self, storage: int, proxy: TensorProxy) -> int:
        """A storage for ``proxy`` made of bytes that ``storage`` held: a coalesced launch's
        future stands for every member's output, and each output is freed on its own. Nothing
        is allocated or freed."""
        own = ops.numel(proxy) * proxy.dtype.bytes
        nbytes = min(self.nbytes[storage], -(-own // self.granularity) * self.granularity)
        self.nbytes[storage] -= nbytes
        self.nbytes.append(nbytes)
        self.refs.append(0)
        self.persistent.append(self.persistent[storage])
        return len(self.nbytes) - 1

    def bind(self, name: str, storage: int, strides: tuple[int, ...] | None) -> None:
        self.storage_of[name] = storage
        self.strides[name] = strides
        self.refs[storage] += 1

    def decref(self, storage: int) -> None:
        self.refs[storage] -= 1
        if self.refs[storage] == 0 and storage in self.pool_use:
            self.pool_done.append(replace(self.pool_use.pop(storage), end=self.now))
        elif self.refs[storage] == 0 and not self.persistent[storage]:
            self.live -= self.nbytes[storage]
            self.freed += self.nbytes[storage]

    def drop_name(self, name: str) -> None:
        if name in self.storage_of:
            self.decref(self.storage_of.pop(name))
            self.strides.pop(name, None)
            # A future owns its collective's Work, which holds the collective's input.
            for storage in self.held_by_future.pop(name, ()):
                self.decref(storage)
        elif name in self.collection_refs:
            self.drop_collection_ref(name)

    def drop_collection_ref(self, collection: str) -> None:
        self.collection_refs[collection] -= 1
        if self.collection_refs[collection] == 0:
            self.clear(collection)

    def clear(self, collection: str) -> None:
        """Releases what ``collection`` holds: storages (ints) and collections (names)."""
        for member in self.members.pop(collection, ()):
            if isinstance(member, int):
                self.decref(member)
            else:
                self.drop_collection_ref(member)


# run_bucket_op's answer when it has bound every output itself.
DONE: list[int] = []


def _bind_all(outs, books: StorageBooks, storage: int) -> None:
    for out in outs:
        books.bind(out.name, storage, contiguous_strides(tuple(int(s) for s in out.shape)))


def run_bucket_op(bsym: BoundSymbol, books: StorageBooks, layouts: BucketLayouts) -> list[int] | None:
    """Pool buffers of a bucketed collective (``_bucketing/buffers.py`` runs the same paths).

    Binds what runs on pool buffers and returns what the collective's future holds (None: as
    any collective, its tensor inputs); ``DONE`` when every output is bound."""
    outs = [o for o in bsym.flat_proxy_outs if isinstance(o, (TensorProxy, FutureTensorProxy))]
    op = bsym.sym.id
    if op == ops.bucket_all_gather.id:
        _bind_all(outs, books, books.new_pool_storage(layout_of(layouts, bsym.args[0]), "all-gather", gathered=True))
        return None
    if op == ops.bucket_all_gather_wait.id:
        _bind_all(outs, books, _gathered_views(layout_of(layouts, bsym.args[1]), books.storage_of[bsym.args[0].name], books))
        return DONE
    if op == ops.bucket_reduce_scatter.id:
        return _reduce_scatter(bsym, books, layout_of(layouts, bsym.args[0]), outs)
    if op == ops.coalesced_bucket_all_gather.id:
        members = [layout_of(layouts, bucket) for bucket, _, _ in bsym.args[1]]
        (future,) = outs
        _bind_all([future], books, books.new_storage(future, nbytes=0))
        gathered = [books.new_pool_storage(layout, "all-gather", gathered=True) for layout in members]
        books.coalesced_gathers[future.name] = [
            (layout, storage, len(wait_slots)) for layout, storage, (_, _, wait_slots) in zip(members, gathered, bsym.args[1], strict=True)
        ]
        shards = [books.storage_of[t.name] for member in bsym.args[2] for t in member if t.name in books.storage_of]
        return shards + gathered
    if op == ops.coalesced_wait.id and bsym.args[0].name in books.coalesced_gathers:
        position = 0
        for layout, gathered, count in books.coalesced_gathers.pop(bsym.args[0].name):
            _bind_all(outs[position : position + count], books, _gathered_views(layout, gathered, books))
            position += count
        return DONE
    if op == ops.coalesced_bucket_reduce_scatter.id:
        members = zip((layout_of(layouts, bucket) for bucket, _, _ in bsym.args[1]), bsym.args[2], strict=True)
        return [s for layout, grads in members for s in _reduce_scatter_input(layout, grads, books, coalesced=True)[0]]
    if op == ops.bucket_accumulate_grads.id:
        # The lay-out is summed into the kept gradients at once: busy for this op only.
        books.release_pool_storage(books.new_pool_storage(layout_of(layouts, bsym.args[0]), "no_sync lay-out"))
    return None


def _gathered_views(layout: BucketLayout, gathered: int, books: StorageBooks) -> int:
    """The storage the parameters of a finished gather are views of: a copy-out's, or the gather's."""
    return books.new_pool_storage(layout, "copy-out", gathered=True) if layout.gather is GatherPath.COPY_OUT else gathered


def _reduce_scatter(bsym: BoundSymbol, books: StorageBooks, layout: BucketLayout, outs) -> list[int]:
    if layout.reduce is ReducePath.IN_POOL:
        # Laid out into a pool buffer whose row becomes the gradient shard: the buffer is busy
        # until the shard's last view dies, the gradients are free to go.
        buffer = books.new_pool_storage(layout, "reduce-scatter in place")
        _bind_all(outs, books, buffer)
        return [buffer]
    held, pool_user = _reduce_scatter_input(layout, bsym.args[2], books)
    books.reduce_scatter_issues.append(ReduceScatterIssue(bsym.args[0], layout, books.now, pool_user))
    return held


def _reduce_scatter_input(layout: BucketLayout, grads, books: StorageBooks, *, coalesced: bool = False) -> tuple[list[int], str | None]:
    """What a bucketed reduce-scatter sends, held by its future: the gradients where they are (a
    dense copy of a strided one), or a pool buffer they are laid out into (they are then free to
    go); where the backend copies a reduce-scatter's input, that copy too, unless a lone laid-out
    bucket all-reduces its own buffer in place. With the user name of the lay-out's pool interval
    (None: no lay-out)."""
    grads = [g for g in grads if isinstance(g, TensorProxy)]
    sends = layout.reduce is ReducePath.SEND
    from_copy = layout.reduce is ReducePath.FROM_COPY and not coalesced
    held = []
    if layout.backend.copies_reduce_scatter_input and (sends or coalesced or from_copy):
        held.append(books.new_storage(None, nbytes=layout.nbytes))
    if not sends:
        laid_out = books.new_pool_storage(layout, "reduce-scatter")
        user = books.pool_use[laid_out].user
        if from_copy:  # the backend copies it at the launch: busy for the launch only
            books.release_pool_storage(laid_out)
            return held, user
        return [*held, laid_out], user
    for g in grads:
        if g.name not in books.storage_of:
            continue
        strides = books.strides.get(g.name)
        dense = strides is None or is_contiguous(tuple(int(s) for s in g.shape), strides)
        held.append(books.storage_of[g.name] if dense else books.new_storage(g))
    return held, None
