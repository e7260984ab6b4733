"""Counting what a region of code allocates and copies, op by op (any device).

:class:`OpCensus` is a dispatch mode: every aten op run inside it is recorded with the storages
it read and wrote. Tests use it to prove that bucketing allocates nothing after the first step
and copies each bucket at most once per direction; the buffer benchmark uses it to count
allocations and bytes copied per iteration.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["COPY_OPS", "OpCensus", "OpRecord"]

# Ops whose purpose is to move bytes from one layout to another (the output is the input's data).
COPY_OPS = frozenset(
    {
        "copy_",
        "cat",
        "_chunk_cat",
        "split_with_sizes_copy",
        "constant_pad_nd",
        "clone",
        "_to_copy",
        "_foreach_copy_",
        "_unsafe_view_copy",
        "contiguous",
    }
)


def _storages(values) -> dict[int, int]:
    """data_ptr -> nbytes of every tensor storage among ``values``."""
    found = {}
    for t in tree_leaves(values):
        if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > 0:
            storage = t.untyped_storage()
            found[storage.data_ptr()] = storage.nbytes()
    return found


@dataclass(frozen=True)
class OpRecord:
    name: str
    # Storages (data_ptr) the op was given and the ones it returned.
    inputs: frozenset[int]
    outputs: frozenset[int]
    # Bytes of returned storages the op created (not one of its inputs).
    allocated_bytes: int
    # For copy ops, bytes written: the size of what it returned.
    copied_bytes: int


@dataclass
class OpCensus(TorchDispatchMode):
    """Records every aten op run inside the ``with`` block."""

    records: list[OpRecord] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__init__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        inputs = _storages((args, kwargs))
        outputs = _storages(out)
        allocated = sum(n for ptr, n in outputs.items() if ptr not in inputs)
        copied = 0
        if name in COPY_OPS:
            copied = sum(t.numel() * t.element_size() for t in tree_leaves(out) if isinstance(t, torch.Tensor))
            if name.endswith("_") or "out" in kwargs:
                # In-place and out= copies return what they wrote into.
                copied = copied or sum(
                    t.numel() * t.element_size() for t in tree_leaves(kwargs.get("out", ())) if isinstance(t, torch.Tensor)
                )
        self.records.append(OpRecord(name, frozenset(inputs), frozenset(outputs), allocated, copied))
        return out

    def count(self, name: str) -> int:
        return sum(r.name == name for r in self.records)

    @property
    def allocations(self) -> int:
        return sum(r.allocated_bytes > 0 for r in self.records)

    @property
    def allocated_bytes(self) -> int:
        return sum(r.allocated_bytes for r in self.records)

    @property
    def copies(self) -> list[OpRecord]:
        return [r for r in self.records if r.name in COPY_OPS]

    @property
    def copied_bytes(self) -> int:
        return sum(r.copied_bytes for r in self.records)

    def touching(self, storages: set[int]) -> list[OpRecord]:
        """Records that read or wrote any of ``storages`` (data_ptrs)."""
        return [r for r in self.records if (r.inputs | r.outputs) & storages]
