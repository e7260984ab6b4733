"""Peak memory per rank, measured the same way for every implementation on a device type.

- CUDA: ``torch.cuda.max_memory_allocated()`` over the timed iterations.
- CPU: bytes held between steps (local parameter shards, optimizer state, and thunder_overlap's
  bucket pool) plus the most that one extra, untimed training step adds on top, counted by
  :class:`thunder_overlap.memory.LiveMemoryTracker` (every tensor storage alive at once).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn as nn

from thunder_overlap.testing.live_memory import LiveMemoryTracker

__all__ = ["CUDA_METHOD", "CPU_METHOD", "persistent_bytes", "cpu_peak_bytes"]

CUDA_METHOD = "torch.cuda.max_memory_allocated over the timed iterations"
CPU_METHOD = "parameters + optimizer state + LiveMemoryTracker peak of one untimed step"


def _local(t: torch.Tensor) -> torch.Tensor:
    # FSDP2 parameters are DTensors; what this rank holds is their local shard.
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _tensors(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> Iterable[torch.Tensor]:
    yield from model.parameters()
    yield from model.buffers()
    yield from _bucket_buffers(model)
    if optimizer is not None:
        for state in optimizer.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))


def _bucket_buffers(model: nn.Module) -> Iterable[torch.Tensor]:
    """thunder_overlap's bucket pool: allocated in the first step and held from then on, so a
    later step reuses it without allocating (the tracker would not see it). Gradient shards are
    not held: allocated in each step, as gradients, they are given back by zero_grad."""
    from thunder.core.module import ThunderModule

    from thunder_overlap import BucketingTransform

    bucketing = BucketingTransform.of(model) if isinstance(model, ThunderModule) else None
    if bucketing is None:
        return
    yield from bucketing.pool.buffers


def persistent_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of the distinct storages of parameters, buffers and optimizer state on this rank."""
    storages = {}
    for t in _tensors(model, optimizer):
        storage = _local(t).untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def cpu_peak_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None, run_step: Callable[[], object]) -> int:
    """Persistent bytes plus the peak that ``run_step()`` adds (run once, under the tracker)."""
    held = persistent_bytes(model, optimizer)
    with LiveMemoryTracker() as tracker:
        run_step()
    return held + tracker.peak_bytes
