"""Running an execution trace one bound symbol at a time, on real (or meta) tensors.

Thunder runs a trace as one generated Python function, so nothing can be observed between two of
its bound symbols. :class:`TraceStepper` compiles each top-level bound symbol's own line of that
function separately and runs them in order in one namespace, so a caller can look at memory or
time after every step. ``del`` and ``clear_mutable_collection`` run as written, so tensors die
exactly where they die in Thunder's function.

Collective inputs are held for as long as the collective's future, as NCCL keeps them alive in the
``Work`` object the future owns (the ``fake`` process group may not, and the memory verifier must
see what a real backend does), except where the backend copies them at the launch and keeps no
view (gloo's reduce-scatters of Thunder's: ``memory_estimate.backend_copy``; the
tracker counts the copy).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import thunder
import torch
from thunder.core import prims
from thunder.core.proxies import FutureTensorProxy, Proxy, TensorProxy
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx, tracectx

from thunder_overlap._analysis.calibration import random_tensor
from thunder_overlap._analysis.memory_estimate import backend_copy

__all__ = ["TraceStepper", "materialize_inputs", "random_tensor"]

_HEADER_IDS = (prims.PrimIDs.UNPACK_TRIVIAL,)
_UNPACK_IDS = (prims.PrimIDs.UNPACK_TRIVIAL, prims.PrimIDs.UNPACK_SEQUENCE)


def _unpacked_contents(trace: TraceCtx) -> dict[str, list[Proxy]]:
    """Collection name -> the proxies an ``unpack_sequence`` takes out of it."""
    contents: dict[str, list[Proxy]] = {}
    for bsym in trace.bound_symbols:
        if bsym.sym.id is prims.PrimIDs.UNPACK_SEQUENCE and isinstance(bsym.args[0], Proxy):
            contents[bsym.args[0].name] = list(bsym.flat_proxy_outs)
    return contents


def _argument_names(trace: TraceCtx) -> list[str]:
    return [name for name, _ in trace.siginfo().args]


def materialize_inputs(trace: TraceCtx, device: torch.device | str, known: dict[str, torch.Tensor] | None = None) -> list[Any]:
    """Values for the trace's positional arguments: tensors from ``known`` by proxy name, random
    tensors otherwise; collections (a backward's ``saved_for_backward``) become fresh lists that
    the trace may clear, shaped by the trace's own unpacking."""
    known = known or {}
    contents = _unpacked_contents(trace)
    tensors = {p.name: p for bsym in trace.bound_symbols if bsym.sym.id in _UNPACK_IDS for p in bsym.flat_proxy_outs}

    def build(name: str) -> Any:
        proxy = tensors.get(name)
        if name in known:
            return known[name]
        if name in contents:
            return [build(q.name) if isinstance(q, Proxy) else q for q in contents[name]]
        if isinstance(proxy, TensorProxy):
            return random_tensor(proxy, device)
        return []  # a collection the trace never unpacks

    return [build(name) for name in _argument_names(trace)]


def _launch_keeps_no_view(bsym: BoundSymbol) -> bool:
    """A launch whose backend reduces copies of its inputs and keeps no view of them (gloo)."""
    copy = backend_copy(bsym)
    return copy is not None and not copy.keeps_inputs


def _collective_inputs(bsym: BoundSymbol, namespace: dict[str, Any]) -> dict[str, list[Any]]:
    inputs = [namespace[a.name] for a in bsym.flat_proxy_args if isinstance(a, TensorProxy)]
    return {out.name: inputs for out in bsym.flat_proxy_outs}


class TraceStepper:
    """Runs ``trace`` bound symbol by bound symbol; see the module docstring.

    Usage::

        stepper = TraceStepper(trace)
        for index, bsym in stepper.run(args):
            ...  # bsym ``index`` of trace.bound_symbols has just run
        result = stepper.result
    """

    def __init__(self, trace: TraceCtx) -> None:
        self.trace = trace
        self._code: list[Any] = []
        self._globals: dict[str, Any] = {"thunder": thunder}
        with tracectx(trace):
            for bsym in trace.bound_symbols:
                self._code.append(self._compile(bsym))
                # Printing names the objects (process groups) a line refers to; collect them after.
                for ctx in bsym.gather_ctxs():
                    self._globals.update(ctx)
        self.result: Any = None
        self.namespace: dict[str, Any] = {}

    @staticmethod
    def _compile(bsym: BoundSymbol):
        if bsym.sym.id in _HEADER_IDS:
            return None  # a comment: the argument is bound by ``run``
        source = "\n".join(line for line in bsym.python(indent=0, print_depth=1) if not line.lstrip().startswith("#"))
        if bsym.sym.id is prims.PrimIDs.RETURN:
            source = source.replace("return ", "__result__ = ", 1)
        return compile(source, f"<{bsym.sym.name}>", "exec") if source.strip() else None

    def run(self, args: list[Any]) -> Iterator[tuple[int, BoundSymbol]]:
        """Runs the trace on ``args`` (consumed: keep no other reference to what the trace should
        free) and yields after each bound symbol."""
        names = _argument_names(self.trace)
        if len(args) != len(names):
            raise ValueError(f"trace takes {len(names)} arguments ({names[:4]}...), got {len(args)}")
        namespace = dict(zip(names, args, strict=True))
        args.clear()
        self.namespace = namespace
        held: dict[str, list[Any]] = {}  # future name -> collective inputs, kept while it lives
        with torch.no_grad():
            for index, (bsym, code) in enumerate(zip(self.trace.bound_symbols, self._code, strict=True)):
                if code is not None:
                    exec(code, self._globals, namespace)  # noqa: S102 - the trace's own generated line
                if any(isinstance(o, FutureTensorProxy) for o in bsym.flat_proxy_outs) and not _launch_keeps_no_view(bsym):
                    # No local variable: one would keep the last collective's input alive.
                    held.update(_collective_inputs(bsym, namespace))
                elif bsym.sym.id is prims.PrimIDs.DEL:
                    for a in bsym.flat_proxy_args:
                        held.pop(a.name, None)
                yield index, bsym
        self.result = namespace.pop("__result__", None)
        namespace.clear()
