"""Measured memory: bytes of tensor storages alive while a region of code runs (any device)."""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Callable

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

    ``collective_buffers`` says what to count of the memory collectives hold beyond the tensors
    the code names. gloo's ``reduce_scatter_tensor`` reduces a clone of its whole input, made
    inside the collective where no dispatch mode sees it and held by its work (the caller may
    free the input at once; 200 MB more resident from the launch until the work is released,
    measured); NCCL makes no copy but holds the input itself until the wait.

    - ``"as_run"`` (default): what the backend holds: gloo's clone from the launch until the wait
      starts (the wait's own ops then touch it, and from there on it is followed like any
      storage); on NCCL the input, counted already;
    - ``"as_nccl"``: what NCCL would hold for the same collectives: each reduce-scatter's input
      until its wait, and no copy of gloo's (not even where its wait touches one);
    - ``"seen"``: only what the dispatch mode sees.
    """

    COLLECTIVE_BUFFERS = ("as_run", "as_nccl", "seen")

    def __init__(self, *, collective_buffers: str = "as_run") -> None:
        super().__init__()
        if collective_buffers not in self.COLLECTIVE_BUFFERS:
            raise ValueError(f"collective_buffers must be one of {self.COLLECTIVE_BUFFERS}, got {collective_buffers!r}")
        self.current_bytes = 0
        self.peak_bytes = 0
        self._tracked: set[int] = set()
        # Above 0 while gloo's copies are being touched and must not be counted (as_nccl).
        self._untracked_depth = 0
        as_nccl = collective_buffers == "as_nccl"
        self._backend_copies = contextlib.nullcontext() if collective_buffers == "seen" else _GlooReduceScatterCopies(self, as_nccl=as_nccl)

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
        if key in self._tracked or storage.nbytes() == 0 or self._untracked_depth:
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

    @contextlib.contextmanager
    def not_tracking(self):
        """Storages first seen inside are not counted (gloo's copies, where NCCL has none)."""
        self._untracked_depth += 1
        try:
            yield
        finally:
            self._untracked_depth -= 1


class _HeldCopy:
    """What a backend holds for a reduce-scatter until released (by the wait, or by the work's
    end if nothing waits): gloo's clone, as bytes, or (as NCCL would) the input itself, whose
    storage the tracker counts while this keeps it alive."""

    def __init__(self, tracker: LiveMemoryTracker, reduce_input: torch.Tensor, *, as_nccl: bool) -> None:
        self._tracker = tracker
        self._input = reduce_input if as_nccl else None
        self._nbytes = 0 if as_nccl else reduce_input.nbytes  # the clone is of the tensor, not its storage
        tracker.add_bytes(self._nbytes)

    def release(self) -> None:
        self._tracker.add_bytes(-self._nbytes)
        self._nbytes = 0
        self._input = None


class _WaitReleases(dist.Work):
    """A gloo reduce-scatter's work that stops counting what it holds when waited on."""

    def __init__(self, work: dist.Work, held: _HeldCopy, waiting: Callable[[], contextlib.AbstractContextManager]) -> None:
        super().__init__()
        self._work = work
        self._held = held
        self._waiting = waiting
        weakref.finalize(self, held.release)

    def wait(self, *args, **kwargs) -> bool:
        self._held.release()
        with self._waiting():
            return self._work.wait(*args, **kwargs)

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def is_success(self) -> bool:
        return self._work.is_success()

    def exception(self):
        return self._work.exception()


class _GlooReduceScatterCopies:
    """While entered, gloo's reduce-scatters launched asynchronously count what they hold in
    ``tracker`` until their wait (see :class:`LiveMemoryTracker`): alone, through the work
    returned, and in a ``_coalescing_manager`` launch, through the manager's wait. ``as_nccl``:
    the input itself, and gloo's copy is not counted where its wait or a blocking call touches it."""

    _signature = inspect.signature(dist.reduce_scatter_tensor)

    def __init__(self, tracker: LiveMemoryTracker, *, as_nccl: bool) -> None:
        self.tracker = tracker
        self.as_nccl = as_nccl
        self._saved: tuple | None = None
        # Per coalescing manager being entered: the copies its members hold.
        self._coalescing: list[list[_HeldCopy]] = []

    def __enter__(self) -> _GlooReduceScatterCopies:
        self._saved = (dist.reduce_scatter_tensor, dist._coalescing_manager)
        reduce_scatter, coalescing_manager = self._saved

        def counted_reduce_scatter(*args, **kwargs):
            call = self._signature.bind(*args, **kwargs)
            call.apply_defaults()
            is_gloo = dist.get_backend(call.arguments["group"]) == "gloo"
            blocking = not call.arguments["async_op"] and not self._coalescing
            with self._waiting() if is_gloo and blocking else contextlib.nullcontext():
                work = reduce_scatter(*args, **kwargs)
            if is_gloo and self._coalescing:
                self._coalescing[-1].append(self._held(call.arguments["input"]))
            elif is_gloo and work is not None and not blocking:
                return _WaitReleases(work, self._held(call.arguments["input"]), self._waiting)
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
                _release_on_wait(manager, held, self._waiting)
            else:  # nothing to count, or the manager waited on leaving
                _release_all(held)

        dist.reduce_scatter_tensor = counted_reduce_scatter
        dist._coalescing_manager = counted_coalescing_manager
        return self

    def __exit__(self, *exc) -> None:
        dist.reduce_scatter_tensor, dist._coalescing_manager = self._saved

    def _held(self, reduce_input: torch.Tensor) -> _HeldCopy:
        return _HeldCopy(self.tracker, reduce_input, as_nccl=self.as_nccl)

    def _waiting(self) -> contextlib.AbstractContextManager:
        """Where gloo's wait touches its copy: not counted as NCCL would hold it."""
        return self.tracker.not_tracking() if self.as_nccl else contextlib.nullcontext()


def _release_on_wait(manager, held: list[_HeldCopy], waiting: Callable[[], contextlib.AbstractContextManager]) -> None:
    # A subclass rather than a wait assigned to the instance: a closure over the manager would
    # be a reference cycle, keeping its works (and their tensors) alive until the next gc.
    manager.__class__ = _CountedCoalescingManager
    manager.held_copies = held
    manager.waiting = waiting
    weakref.finalize(manager, _release_all, held)


def _release_all(held: list[_HeldCopy]) -> None:
    for copy in held:
        copy.release()


class _CountedCoalescingManager(dist.distributed_c10d._CoalescingManager):
    """A coalescing manager whose wait stops counting what its members hold."""

    held_copies: list[_HeldCopy]
    waiting: Callable[[], contextlib.AbstractContextManager]

    def wait(self) -> None:
        _release_all(self.held_copies)
        with self.waiting():
            super().wait()
