"""Measured memory: bytes of tensor storages alive while a region of code runs (any device)."""

from __future__ import annotations

import contextlib
import inspect
import weakref

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["LiveMemoryTracker"]


class LiveMemoryTracker(TorchDispatchMode):
    """Counts every storage created by an aten op inside the ``with`` block until it is freed.

    Storages are followed through their Python objects, which PyTorch keeps for as long as the
    storage lives, so views, autograd-saved tensors and tensors held by collectives are counted
    once and released exactly when the last reference goes. Storages that existed before the
    block (parameters, inputs) are not counted: ``peak_bytes`` is what the block added at most.

    With ``backend_copies`` (the default) it also counts the one buffer a backend allocates where
    no dispatch mode sees it: gloo's ``reduce_scatter_tensor`` reduces a clone of its whole
    input, made inside the collective and held by its work (the caller may free the input at
    once; 200 MB more resident from the launch until the work is released, measured). The
    clone is counted from the launch until the wait starts; the wait's own ops then touch it,
    so from there on it is followed like any storage. NCCL holds the input itself until the
    wait, which this counts already.
    """

    def __init__(self, *, backend_copies: bool = True) -> None:
        super().__init__()
        self.current_bytes = 0
        self.peak_bytes = 0
        self._tracked: set[int] = set()
        self._backend_copies = _GlooReduceScatterCopies(self) if backend_copies else contextlib.nullcontext()

    def __enter__(self):
        self._backend_copies.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._backend_copies.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t.untyped_storage())
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key in self._tracked or storage.nbytes() == 0:
            return
        self._tracked.add(key)
        nbytes = storage.nbytes()
        self.add_bytes(nbytes)
        weakref.finalize(storage, self._release, key, nbytes)

    def _release(self, key: int, nbytes: int) -> None:
        self._tracked.discard(key)
        self.current_bytes -= nbytes

    def add_bytes(self, nbytes: int) -> None:
        """Counts ``nbytes`` more as alive (negative: freed), for memory no storage shows."""
        self.current_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)

    def track(self, tensor: torch.Tensor) -> None:
        """Counts ``tensor``'s storage from now on, like one created inside the block (for a
        trace's inputs, whose release the caller wants to see)."""
        self._track(tensor.untyped_storage())

    def reset_peak(self) -> None:
        """Starts a new peak from the current bytes (to measure one step at a time)."""
        self.peak_bytes = self.current_bytes


class _HeldCopy:
    """Bytes a backend holds for a collective, counted once until released (by the wait, or by
    the work's end if nothing waits)."""

    def __init__(self, tracker: LiveMemoryTracker, nbytes: int) -> None:
        self._tracker = tracker
        self._nbytes = nbytes
        tracker.add_bytes(nbytes)

    def release(self) -> None:
        self._tracker.add_bytes(-self._nbytes)
        self._nbytes = 0


class _WaitReleases(dist.Work):
    """A gloo reduce-scatter's work that stops counting the backend's clone when waited on."""

    def __init__(self, work: dist.Work, held: _HeldCopy) -> None:
        super().__init__()
        self._work = work
        self._held = held
        weakref.finalize(self, held.release)

    def wait(self, *args, **kwargs) -> bool:
        self._held.release()
        return self._work.wait(*args, **kwargs)

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def is_success(self) -> bool:
        return self._work.is_success()

    def exception(self):
        return self._work.exception()


class _GlooReduceScatterCopies:
    """While entered, gloo's reduce-scatters launched asynchronously count their input's bytes
    (the clone the backend makes) in ``tracker`` until their wait: alone, through the work
    returned, and in a ``_coalescing_manager`` launch, through the manager's wait."""

    _signature = inspect.signature(dist.reduce_scatter_tensor)

    def __init__(self, tracker: LiveMemoryTracker) -> None:
        self.tracker = tracker
        self._saved: tuple | None = None
        # Per coalescing manager being entered: the copies its members hold.
        self._coalescing: list[list[_HeldCopy]] = []

    def __enter__(self) -> _GlooReduceScatterCopies:
        self._saved = (dist.reduce_scatter_tensor, dist._coalescing_manager)
        reduce_scatter, coalescing_manager = self._saved

        def counted_reduce_scatter(*args, **kwargs):
            call = self._signature.bind(*args, **kwargs)
            call.apply_defaults()
            work = reduce_scatter(*args, **kwargs)
            is_gloo = dist.get_backend(call.arguments["group"]) == "gloo"
            nbytes = call.arguments["input"].nbytes  # the clone is of the tensor, not its storage
            if is_gloo and self._coalescing:
                self._coalescing[-1].append(_HeldCopy(self.tracker, nbytes))
            elif is_gloo and work is not None and call.arguments["async_op"]:
                return _WaitReleases(work, _HeldCopy(self.tracker, nbytes))
            return work

        @contextlib.contextmanager
        def counted_coalescing_manager(*args, **kwargs):
            call = inspect.signature(coalescing_manager).bind(*args, **kwargs)
            call.apply_defaults()
            held: list[_HeldCopy] = []
            self._coalescing.append(held)
            try:
                with coalescing_manager(*args, **kwargs) as manager:
                    yield manager
            finally:
                self._coalescing.remove(held)
            if held and call.arguments["async_ops"]:
                _release_on_wait(manager, held)
            else:  # nothing to count, or the manager waited on leaving
                _release_all(held)

        dist.reduce_scatter_tensor = counted_reduce_scatter
        dist._coalescing_manager = counted_coalescing_manager
        return self

    def __exit__(self, *exc) -> None:
        dist.reduce_scatter_tensor, dist._coalescing_manager = self._saved


def _release_on_wait(manager, held: list[_HeldCopy]) -> None:
    # A subclass rather than a wait assigned to the instance: a closure over the manager would
    # be a reference cycle, keeping its works (and their tensors) alive until the next gc.
    manager.__class__ = _CountedCoalescingManager
    manager.held_copies = held
    weakref.finalize(manager, _release_all, held)


def _release_all(held: list[_HeldCopy]) -> None:
    for copy in held:
        copy.release()


class _CountedCoalescingManager(dist.distributed_c10d._CoalescingManager):
    """A coalescing manager whose wait stops counting its members' backend copies."""

    held_copies: list[_HeldCopy]

    def wait(self) -> None:
        _release_all(self.held_copies)
        super().wait()
