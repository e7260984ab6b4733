"""Runs an execution trace and checks the memory estimator against what really stays alive.

:func:`measure_memory` runs a trace one bound symbol at a time and records the bytes really alive
after each one (CPU: every storage followed by :class:`LiveMemoryTracker`; CUDA: the caching
allocator's counters), and :func:`compare_memory` names the first bound symbol where prediction
and measurement part.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from thunder.core.trace import TraceCtx, tracectx

from thunder_overlap._analysis.memory_estimate import CUDA_ALLOCATION_GRANULARITY, MemoryEstimate
from thunder_overlap.testing.live_memory import LiveMemoryTracker
from thunder_overlap.testing.trace_runner import TraceStepper, materialize_inputs

__all__ = ["MemoryComparison", "MemoryMeasurement", "compare_memory", "measure_memory", "measure_step", "run_measured"]

@dataclass
class MemoryMeasurement:
    """Bytes really alive after each bound symbol, and at most while it ran."""

    device: str
    input_bytes: int
    live_after: list[int]
    peak_during: list[int]

    @property
    def peak_bytes(self) -> int:
        return max(self.peak_during, default=self.input_bytes)


@dataclass(frozen=True)
class MemoryComparison:
    predicted_peak_bytes: int
    measured_peak_bytes: int
    # First bound symbol after which predicted and measured live bytes differ, and its code.
    first_divergence: int | None
    first_divergence_code: str | None
    predicted_at_divergence: int | None = None
    measured_at_divergence: int | None = None

    @property
    def peak_error(self) -> float:
        """(predicted - measured) / measured peak."""
        return (self.predicted_peak_bytes - self.measured_peak_bytes) / max(self.measured_peak_bytes, 1)


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def measure_memory(trace: TraceCtx, args: list | None = None, *, device: torch.device | str = "cpu") -> MemoryMeasurement:
    """Runs ``trace`` on ``args`` (default: random inputs on ``device``) one bound symbol at a
    time and records the bytes alive after each, counting the inputs it was given.

    ``args`` is consumed: tensors it alone holds can be freed by the trace, as in Thunder's
    runtime; keep a reference to those that must persist (parameters)."""
    measurement, _ = run_measured(trace, args, device=device)
    return measurement


def run_measured(trace: TraceCtx, args: list | None = None, *, device: torch.device | str = "cpu", held: list | None = None):
    """:func:`measure_memory`, also returning what the trace returned. ``held``: tensors alive
    all along besides the inputs (a forward's parameters and batch, during its backward), counted
    as inputs are."""
    device = torch.device(device)
    args = materialize_inputs(trace, device) if args is None else args
    held = held or []
    stepper = TraceStepper(trace)
    live_after: list[int] = []
    peak_during: list[int] = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        input_bytes = sum({t.untyped_storage().data_ptr(): _rounded(t) for t in _tensors([args, held])}.values())
        for _ in stepper.run(args):
            live_after.append(torch.cuda.memory_allocated(device) - base + input_bytes)
            peak_during.append(torch.cuda.max_memory_allocated(device) - base + input_bytes)
            torch.cuda.reset_peak_memory_stats(device)
        return MemoryMeasurement(str(device), input_bytes, live_after, peak_during), stepper.result
    with LiveMemoryTracker() as tracker:
        _track_all(tracker, [args, held])  # in a function: a loop variable here would keep a tensor alive
        input_bytes = tracker.current_bytes
        for _ in stepper.run(args):
            live_after.append(tracker.current_bytes)
            peak_during.append(tracker.peak_bytes)
            tracker.reset_peak()
    return MemoryMeasurement(str(device), input_bytes, live_after, peak_during), stepper.result


def _track_all(tracker: LiveMemoryTracker, args: list) -> None:
    for t in _tensors(args):
        tracker.track(t)


def _rounded(t: torch.Tensor) -> int:
    nbytes = t.untyped_storage().nbytes()
    return -(-nbytes // CUDA_ALLOCATION_GRANULARITY) * CUDA_ALLOCATION_GRANULARITY


def compare_memory(estimate: MemoryEstimate, measurement: MemoryMeasurement, *, tolerance_bytes: int = 0) -> MemoryComparison:
    """Compares live bytes after every bound symbol; the first one off by more than
    ``tolerance_bytes`` is named. Peaks compare the estimate's peak with the measured one, which
    also counts temporaries an op allocates and frees inside itself."""
    if len(estimate.live_after) != len(measurement.live_after):
        raise ValueError(
            f"the estimate has {len(estimate.live_after)} steps and the measurement {len(measurement.live_after)}: not of the same trace"
        )
    first = None
    for i, (p, m) in enumerate(zip(estimate.live_after, measurement.live_after, strict=True)):
        if abs(p - m) > tolerance_bytes:
            first = i
            break
    code = None
    if first is not None:
        with tracectx(estimate.trace):
            code = " ".join(estimate.trace.bound_symbols[first].python(indent=0, print_depth=1)).strip()
    return MemoryComparison(
        predicted_peak_bytes=estimate.peak_bytes,
        measured_peak_bytes=measurement.peak_bytes,
        first_divergence=first,
        first_divergence_code=code,
        predicted_at_divergence=None if first is None else estimate.live_after[first],
        measured_at_divergence=None if first is None else measurement.live_after[first],
    )


def measure_step(forward: TraceCtx, backward: TraceCtx) -> tuple[MemoryMeasurement, MemoryMeasurement]:
    """Runs an FSDP forward trace on random inputs kept alive (the module holds its parameters),
    then its backward on what the forward saved, as Thunder's runtime hands it over, with the
    forward's inputs still alive; returns what was measured in each."""
    args = materialize_inputs(forward, "cpu")
    parameters = list(args)
    measured_forward, result = run_measured(forward, args)
    saved = [list(result[1][0]), list(result[1][1])]
    del result
    backward_args = materialize_inputs(backward, "cpu")
    backward_args[0] = saved
    del saved
    measured_backward, _ = run_measured(backward, backward_args, held=parameters)
    del parameters
    return measured_forward, measured_backward
