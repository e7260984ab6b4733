"""Selective unsharding: which units (blocks, or buckets) keep their gathered parameters from the
forward to the backward, within a per-rank memory budget ([Note: selective unsharding] in
docs/design.md).

A kept unit is not re-gathered in the backward (ZeRO2 for it); the others are (ZeRO3). Units are
kept in the order the backward needs them, first needed first: its first re-gather is the one no
compute hides, and a unit kept longer in the forward holds memory longer in the backward too.
The predicted just-in-time peak mostly grows with the units kept (not always: a kept unit also
spares its re-gather), so the longest prefix of that order within the budget is found by
bisection. Memory a kept unit takes is memory prefetching no longer has: where the budget holds
prefetching back, the shorter prefixes are scheduled and simulated too, and the fastest is kept.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from thunder.core.trace import TraceCtx

from thunder_overlap._analysis.classify import classify_trace
from thunder_overlap._analysis.layout import NO_BUCKETS, BucketLayouts
from thunder_overlap._scheduling.limits import JUST_IN_TIME_LIMITS
from thunder_overlap._scheduling.scheduler import OverlapScheduler

__all__ = ["MemoryBudgetTooSmall", "StepPrediction", "UnshardingChoice", "choose_kept_units", "just_in_time_step_peak"]

logger = logging.getLogger(__name__)

_MIB = 1 << 20
# Where the budget holds back prefetching, the most prefixes scheduled and simulated before the
# search narrows to neighbours: every one for up to this many units.
_MOST_PROBES = 16


class MemoryBudgetTooSmall(ValueError):
    """Even ZeRO3, which keeps no unit, is predicted over the memory budget."""


@dataclass(frozen=True)
class StepPrediction:
    """A forward and backward as the scheduler orders them within the budget: the memory
    estimator's peak and the simulator's step time."""

    peak_bytes: int
    step_ms: float
    # Collectives the budget kept from being prefetched further ahead.
    held_by_memory: int = 0


@dataclass(frozen=True)
class UnshardingChoice:
    """What sharding "auto" chose, with the predictions behind it (bytes per rank; the step's
    traces as the memory estimator predicts them, buckets and their pool included)."""

    budget_bytes: int
    # Every unit, in the order they are kept (the backward's first need first).
    candidates: tuple[str, ...]
    kept: tuple[str, ...]
    # Just-in-time peaks (every collective right before its use: the least memory each needs)
    # of the choice, of ZeRO3 (no unit kept) and of ZeRO2 (every unit kept; None: not estimated,
    # ZeRO3 was over the budget).
    peak_bytes: int
    zero3_peak_bytes: int
    zero2_peak_bytes: int | None
    # The choice and ZeRO3 as scheduled within the budget, prefetching included (None: not
    # predicted, there was nothing to choose between).
    scheduled: StepPrediction | None
    zero3_scheduled: StepPrediction | None
    # Unsharded bytes each rank no longer re-gathers per backward.
    regather_bytes_saved: int
    # What this rank would have kept alone, where another rank had less room (else None).
    kept_alone: tuple[str, ...] | None = None

    def describe(self) -> str:
        zero2 = f"{self.zero2_peak_bytes / _MIB:.1f}" if self.zero2_peak_bytes is not None else "-"
        line = (
            f"kept {len(self.kept)} of {len(self.candidates)} units unsharded to the backward "
            f"({', '.join(self.kept) or 'none'}) within a budget of {self.budget_bytes / _MIB:.1f} MiB: predicted peak "
            f"{self.peak_bytes / _MIB:.1f} MiB just in time (ZeRO3 {self.zero3_peak_bytes / _MIB:.1f}, ZeRO2 {zero2})"
        )
        if self.scheduled is not None and self.zero3_scheduled is not None:
            line += (
                f", {self.scheduled.peak_bytes / _MIB:.1f} MiB and {self.scheduled.step_ms:.1f} ms a step as scheduled "
                f"(ZeRO3 {self.zero3_scheduled.peak_bytes / _MIB:.1f} MiB, {self.zero3_scheduled.step_ms:.1f} ms)"
            )
        line += f"; {self.regather_bytes_saved / _MIB:.1f} MiB fewer re-gathered per step"
        if self.kept_alone is not None:
            line += f"; {len(self.kept_alone)} alone, fewer to agree with the other ranks"
        return line


def just_in_time_step_peak(forward: TraceCtx, backward: TraceCtx, layouts: BucketLayouts = NO_BUCKETS) -> int:
    """Predicted peak bytes of a step that runs ``forward`` then ``backward`` (bucketed traces
    with their buckets' ``layouts``) with every collective just in time: the least memory any
    schedule of them has, the scheduler's own baseline."""
    peak, after = 0, None
    for trace in (forward, backward):
        scheduler = OverlapScheduler(classify_trace(trace, layouts), JUST_IN_TIME_LIMITS, memory_after=after)
        _, after = scheduler.estimate_baseline_memory()
        peak = max(peak, after.peak_bytes)
    return peak


def choose_kept_units(
    candidates: Sequence[str],
    unit_bytes: Mapping[str, int],
    peak_of: Callable[[tuple[str, ...]], int],
    budget_bytes: int,
    predict: Callable[[tuple[str, ...]], StepPrediction] | None = None,
) -> UnshardingChoice:
    """A prefix of ``candidates``: the longest whose just-in-time step peak (``peak_of(prefix)``)
    is within ``budget_bytes`` (where the peak grows with it); where the budget then holds back
    its prefetching, the shorter prefix ``predict`` (the step as scheduled within the budget)
    finds fastest, ZeRO3's included. Raises :class:`MemoryBudgetTooSmall` where even no unit is over
    the budget itself."""
    candidates = tuple(candidates)
    zero3 = peak_of(())
    if zero3 > budget_bytes:
        raise MemoryBudgetTooSmall(
            f"thunder_overlap sharding 'auto': memory_budget_bytes={budget_bytes} ({budget_bytes / _MIB:.1f} MiB) is below "
            f"the predicted peak of ZeRO3 itself, {zero3} B ({zero3 / _MIB:.1f} MiB), which keeps no block unsharded; "
            "raise the budget, or shrink the batch, the sequence or the model per rank"
        )
    peaks = {0: zero3}
    predictions: dict[int, StepPrediction] = {}

    def peak(kept: int) -> int:
        if kept not in peaks:
            peaks[kept] = peak_of(candidates[:kept])
            logger.debug("keeping %d units: predicted just-in-time peak %d B against %d B", kept, peaks[kept], budget_bytes)
        return peaks[kept]

    def prediction(kept: int) -> StepPrediction:
        if kept not in predictions:
            predictions[kept] = predict(candidates[:kept])
            logger.debug("keeping %d units: predicted step %.3f ms", kept, predictions[kept].step_ms)
        return predictions[kept]

    zero2 = peak(len(candidates))
    fits = len(candidates) if zero2 <= budget_bytes else 0
    over = len(candidates)  # invariant, while bisecting: candidates[:fits] fit, candidates[:over] do not
    while over - fits > 1:
        middle = (fits + over) // 2
        if peak(middle) <= budget_bytes:
            fits = middle
        else:
            over = middle
    kept, scheduled, zero3_scheduled = fits, None, None
    if predict is not None and candidates:
        if prediction(fits).held_by_memory:
            # [Note: selective unsharding]: what a kept unit takes, prefetching no longer has.
            stride = -(-fits // _MOST_PROBES)
            probes = sorted({*range(0, fits, stride), fits})
            kept = min(probes, key=lambda k: (prediction(k).step_ms, -k))
            for direction in (-1, 1):  # between probes, while faster
                while 0 <= kept + direction <= fits and prediction(kept + direction).step_ms < prediction(kept).step_ms:
                    kept += direction
        scheduled, zero3_scheduled = prediction(kept), prediction(0)
    return UnshardingChoice(
        budget_bytes=budget_bytes,
        candidates=candidates,
        kept=candidates[:kept],
        peak_bytes=peak(kept),
        zero3_peak_bytes=zero3,
        zero2_peak_bytes=zero2,
        scheduled=scheduled,
        zero3_scheduled=zero3_scheduled,
        regather_bytes_saved=sum(unit_bytes[unit] for unit in candidates[:kept]),
    )
