"""The one definition of a *hidden* (overlapped) collective, used by the simulator, the report
and ``schedule_stats``.

A collective is hidden when the compute stream is busy computing for the time the collective
runs on its communication stream (all but ``HIDDEN_UNCOVERED_FRACTION`` of it); any op of the
compute stream counts, the collectives' own pads and pre-averaging included. With an idle
stream and no stall at other waits in between, that is exactly
``sum(cost_model.compute_ms(op) for op between issue and wait) >= cost_model.collective_ms(c)``.

The two-stream simulator (:mod:`thunder_overlap._analysis.simulator`) is where it is measured: it
knows when each collective runs (from when its stream is free until its estimated time later)
and when the compute stream computes. Time the rank spends stalled at *any* wait covers nothing:
a collective that runs while the rank is blocked on another one was not overlapped with compute,
even though its own wait then costs nothing. So Thunder's forward, which issues every all-gather
before the first op and waits for them after the few small ops that build the attention mask,
hides only what runs beside those ops: nothing once the first collective outlasts them.

Predicted time and this judgement come from the same simulation: a collective that ends before
its wait while the rank computed throughout its run is hidden, and the stall at its own wait is
then zero; a collective whose wait stalls the rank for more than 1% of its duration was
uncovered for at least that long and is never counted hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["HIDDEN_UNCOVERED_FRACTION", "Coverage"]

# A collective still counts as hidden when at most this fraction of its run is left uncovered:
# float rounding and sub-microsecond gaps are not overlap failures.
HIDDEN_UNCOVERED_FRACTION = 0.01


@dataclass(frozen=True)
class Coverage:
    """How much of one collective's run the compute stream spent computing."""

    # The collective's own estimated time on its stream (queueing before it starts excluded).
    duration_ms: float
    # Compute-stream computing time inside the collective's run (stalls excluded).
    covered_ms: float

    @property
    def uncovered_ms(self) -> float:
        return max(0.0, self.duration_ms - self.covered_ms)

    @property
    def hidden(self) -> bool:
        return self.uncovered_ms <= HIDDEN_UNCOVERED_FRACTION * self.duration_ms
