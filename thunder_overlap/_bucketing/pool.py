"""The bucket pool: flat unsharded buffers reused once no view of theirs is alive, and the
handle of a bucketed collective in flight, which keeps its buffers busy until it is settled.

A buffer counts as busy for exactly as long as some view of it is alive, read from its storage's
use count, so any use (a gather's output, a copy-out, a lay-out) may take any idle buffer of its
size and dtype. The pool never frees a buffer: it holds as many of a size as were ever busy at
once, and after the first step it allocates nothing. The memory estimator plans the same buffers
from the final traces (``_analysis/pool_slots.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from thunder_overlap._analysis.pool_slots import PoolSlot, describe_slots

__all__ = ["BufferPool", "PendingCollective", "all_reduce_in_place"]


def _storage_users(t: torch.Tensor) -> int:
    """How many tensors (views included) share ``t``'s storage."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def all_reduce_in_place(tensor: torch.Tensor, group: dist.ProcessGroup) -> dist.Work:
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
