"""Nsight Systems support: NVTX ranges and the cudaProfilerStart/Stop capture window.

Everything here is a no-op unless CUDA is in use, so CPU (gloo) runs take the same code path.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist

__all__ = ["NsysWindow", "nvtx_range", "nvtx_collectives"]

# The torch.distributed entry points FSDP implementations call: Thunder's torch executor and
# FSDP2 both look them up on the module at call time, so wrapping the module attribute reaches both.
_COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")


@contextmanager
def _range(name: str) -> Iterator[None]:
    torch.cuda.nvtx.range_push(name)
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()


def nvtx_range(name: str, enabled: bool):
    """An NVTX range named ``name`` when ``enabled`` (CUDA runs), else nothing."""
    return _range(name) if enabled else nullcontext()


@contextmanager
def nvtx_collectives(enabled: bool) -> Iterator[None]:
    """Wraps each collective's *issue* in an NVTX range named after it (for instance
    ``all_gather_into_tensor``); restores the originals on exit. The transfer itself shows up
    as NCCL kernels on the GPU rows of the timeline."""
    if not enabled:
        yield
        return
    originals = {name: getattr(dist, name) for name in _COLLECTIVES}

    def wrap(name, fn):
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            with _range(name):
                return fn(*args, **kwargs)

        return wrapped

    try:
        for name, fn in originals.items():
            setattr(dist, name, wrap(name, fn))
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


class NsysWindow:
    """On rank 0 of a CUDA run with ``enabled``: cudaProfilerStart before iteration ``start`` and
    cudaProfilerStop after iteration ``stop`` (inclusive), so that
    ``nsys profile --capture-range=cudaProfilerApi`` records only those iterations."""

    def __init__(self, enabled: bool, start: int, stop: int, rank: int) -> None:
        self.active = enabled and rank == 0 and torch.cuda.is_available()
        self.start, self.stop = start, stop

    def before_iteration(self, i: int) -> None:
        if self.active and i == self.start:
            print("=====Start NSYS Profiling======", flush=True)
            torch.cuda.cudart().cudaProfilerStart()

    def after_iteration(self, i: int) -> None:
        if self.active and i == self.stop:
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
            print("=====Stop NSYS Profiling======", flush=True)
