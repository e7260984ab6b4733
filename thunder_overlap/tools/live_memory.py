"""Measured memory: bytes of tensor storages alive while a region of code runs (any device)."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["LiveMemoryTracker"]


class LiveMemoryTracker(TorchDispatchMode):
    """Counts every storage created by an aten op inside the ``with`` block until it is freed.

    Storages are followed through their Python objects, which PyTorch keeps for as long as the
    storage lives, so views, autograd-saved tensors and tensors held by collectives are counted
    once and released exactly when the last reference goes. Storages that existed before the
    block (parameters, inputs) are not counted: ``peak_bytes`` is what the block added at most.
    """

    def __init__(self) -> None:
        super().__init__()
        self.current_bytes = 0
        self.peak_bytes = 0
        self._tracked: set[int] = set()

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
        self.current_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        weakref.finalize(storage, self._release, key, nbytes)

    def _release(self, key: int, nbytes: int) -> None:
        self._tracked.discard(key)
        self.current_bytes -= nbytes

    def track(self, tensor: torch.Tensor) -> None:
        """Counts ``tensor``'s storage from now on, like one created inside the block (for a
        trace's inputs, whose release the caller wants to see)."""
        self._track(tensor.untyped_storage())

    def reset_peak(self) -> None:
        """Starts a new peak from the current bytes (to measure one step at a time)."""
        self.peak_bytes = self.current_bytes
