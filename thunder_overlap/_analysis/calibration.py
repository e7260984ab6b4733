"""Measured compute times per op shape, which the cost model prefers to its roofline.

Each distinct ``(op, shapes, constant arguments)`` of an execution trace is run on the real device
on random inputs and timed; the times are kept in memory and, with a path, on disk.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch
from thunder.core import dtypes
from thunder.core.proxies import TensorProxy
from thunder.core.symbol import BoundSymbol

__all__ = ["METADATA_OPS", "Calibration", "random_tensor"]

# Ops whose output aliases their input: no bytes move (see memory_estimate for the full rules).
METADATA_OPS = {
    "reshape", "torch_prims_reshape_impl", "view", "permute", "transpose", "unsqueeze", "squeeze",
    "expand", "broadcast_in_dim", "torch_slice_prim_impl", "split", "shallow_copy", "detach", "flatten",
    "unflatten", "python_del", "clear_mutable_collection", "unpack_trivial", "unpack_sequence",
    "python_return", "comment",
}  # fmt: skip


def random_tensor(proxy: TensorProxy, device: torch.device | str) -> torch.Tensor:
    """A tensor shaped like ``proxy``: random floats, zeros for integers (valid indices for any
    embedding or gather), ones for booleans."""
    dtype = dtypes.to_torch_dtype(proxy.dtype)
    shape = tuple(int(s) for s in proxy.shape)
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, dtype=dtype, device=device)
    if dtype is torch.bool:
        return torch.ones(shape, dtype=dtype, device=device)
    return torch.zeros(shape, dtype=dtype, device=device)


def _shape_key(bsym: BoundSymbol) -> str:
    """Identifies an op and its shapes for calibration: the same key times the same."""
    args = [f"{t.dtype}{list(t.shape)}" if isinstance(t, TensorProxy) else repr(t) for t in bsym.flat_args]
    return f"{bsym.sym.name}({', '.join(args)})"



class Calibration:
    """Measured milliseconds per op shape on a real device, cached in memory and on disk.

    ``measure(bsym)`` runs the op once to warm up, then ``repeats`` times, on random inputs of
    the right shapes, and keeps the median; each distinct ``(op, shapes, constant arguments)``
    is timed once.
    """

    def __init__(self, device: torch.device | str = "cpu", *, path: str | Path | None = None, repeats: int = 3) -> None:
        self.device = torch.device(device)
        self.path = Path(path) if path is not None else None
        self.repeats = repeats
        self.times_ms: dict[str, float] = {}
        if self.path is not None and self.path.exists():
            self.times_ms.update(json.loads(self.path.read_text()))

    def lookup(self, bsym: BoundSymbol) -> float | None:
        return self.times_ms.get(_shape_key(bsym))

    def measure(self, bsym: BoundSymbol) -> float:
        key = _shape_key(bsym)
        if key not in self.times_ms:
            self.times_ms[key] = self._time(bsym)
        return self.times_ms[key]

    def calibrate(self, trace) -> int:
        """Times every compute op of an execution trace whose shape is not cached yet; returns
        how many were timed. Collectives are left to the network model."""
        from thunder_overlap._analysis.classify import NodeKind, classify_trace

        before = len(self.times_ms)
        for node in classify_trace(trace).nodes:
            if node.kind in (NodeKind.COMPUTE, NodeKind.PROLOGUE, NodeKind.EPILOGUE) and node.name not in METADATA_OPS:
                self.measure(node.bsym)
        return len(self.times_ms) - before

    def save(self) -> None:
        if self.path is None:
            raise ValueError("this Calibration has no path to save to; pass path=... when creating it")
        self.path.write_text(json.dumps(self.times_ms, indent=1, sort_keys=True))

    def _time(self, bsym: BoundSymbol) -> float:
        from thunder.core.codeutils import SigInfo
        from thunder.core.trace import tracectx
        from thunder.transforms.constant_folding import (
            make_trace_executable,
            trace_from_bsym_or_bsyms,
        )

        # A one-op trace, claimed by the torch executor (a no-op for ops it already runs).
        trace = trace_from_bsym_or_bsyms(bsym)
        # Thunder names the trace's function after the op, and a name like
        # "torch.ops.aten.embedding_backward" is no Python identifier.
        with tracectx(trace):
            trace._siginfo = SigInfo.from_name_and_args("timed_op", trace.args)
        fn = make_trace_executable(trace)
        args = [random_tensor(a, self.device) if isinstance(a, TensorProxy) else a for a in trace.args]
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        times_ms = []
        with torch.no_grad():
            fn(*args)
            sync()
            for _ in range(self.repeats):
                start = time.perf_counter()
                fn(*args)
                sync()
                times_ms.append((time.perf_counter() - start) * 1e3)
        # The median: one slow call (a page fault, the first use of a kernel) does not count.
        return statistics.median(times_ms)
