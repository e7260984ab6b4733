"""Which pass of a training step a trace is: what schedules, agreements and summaries are kept by."""

from __future__ import annotations

from enum import Enum

from thunder.core.trace import TraceCtx, TraceTag

__all__ = ["Pass"]


class Pass(str, Enum):
    """The forward or the backward. A member equals its name as a string, which messages, logs
    and JSON show and results from rank processes are indexed by."""

    FORWARD = "forward"
    BACKWARD = "backward"

    @staticmethod
    def of(trace: TraceCtx) -> Pass:
        """The pass ``trace`` (an execution trace Thunder tagged) runs."""
        return Pass.BACKWARD if TraceTag.BACKWARD in trace.tags else Pass.FORWARD

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)
