"""Selective unsharding: which units (blocks, or buckets) keep their gathered parameters from the
forward to the backward, within a per-rank memory budget ([Note: selective unsharding] in
docs/design.md).

A kept unit is not re-gathered in the backward (ZeRO2 for it); the others are (ZeRO3). Units are
kept in the order the backward needs them, first needed first: its first re-gather is the one no
compute hides, and a unit kept longer in the forward holds memory longer in the backward too.
The predicted just-in-time peak mostly grows with the units kept (not always: a kept unit also
spares its re-gather), so the longest prefix of that order within the budget is found by
bisection; where ZeRO3 itself is over the budget, keeping units is tried too. Memory a kept unit
takes is memory prefetching no longer has: where the budget holds prefetching back, the shorter
prefixes are scheduled and simulated too, and the fastest is kept.
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

__all__ = [
    "MemoryBudgetTooSmall",
    "StepPrediction",
    "UnshardingChoice",
    "choose_free_units",
    "choose_kept_units",
    "just_in_time_step_peak",
]

logger = logging.getLogger(__name__)

_MIB = 1 << 20
# Where the budget holds back prefetching, the most prefixes scheduled and simulated before the
# search narrows to neighbours: every one for up to this many units.
_MOST_PROBES = 16
# Simulated steps this close are the same step (the simulator sums the same costs in another order).
_SAME_STEP = 1e-6


class MemoryBudgetTooSmall(ValueError):
    """Even ZeRO3, which keeps no unit, is predicted over the memory budget."""


@dataclass(frozen=True)
class StepPrediction:
    """A forward and backward as the scheduler orders them within the budget: the memory
    estimator's peak and the simulator's step time."""

    peak_bytes: int
    step_ms: float
    # Whether the budget changed either pass's order (ScheduleSummary.budget_bound).
    budget_bound: bool = False


@dataclass(frozen=True)
class UnshardingChoice:
    """What sharding "auto" chose, with the predictions behind it (bytes per rank; the step's
    traces as the memory estimator predicts them, buckets and their pool included)."""

    budget_bytes: int
    # Every unit, in the order they are kept (the backward's first need first).
    candidates: tuple[str, ...]
    kept: tuple[str, ...]
    # Just-in-time peaks (every collective right before its use: the least memory each needs)
    # of the choice, of ZeRO3 (no unit kept) and of ZeRO2 (every unit kept). Mostly ZeRO3's is the
    # least; at small batches a kept unit spares more (its re-gather) than it holds.
    peak_bytes: int
    zero3_peak_bytes: int
    zero2_peak_bytes: int
    # The choice and ZeRO3 as scheduled within the budget, prefetching included (None: not
    # predicted, there was nothing to choose between).
    scheduled: StepPrediction | None
    zero3_scheduled: StepPrediction | None
    # Unsharded bytes each rank no longer re-gathers per backward.
    regather_bytes_saved: int
    # What this rank would have kept alone, where another rank had less room (else None).
    kept_alone: tuple[str, ...] | None = None
    # Plain ZeRO3's choice: the budget is its own just-in-time peak, so only units that cost no
    # memory are kept ([Note: ZeRO3 keeps what is free]).
    free: bool = False

    @property
    def sharding(self) -> str:
        """The sharding strategy that made the choice."""
        return "zero3" if self.free else "auto"

    def describe(self) -> str:
        within = "at no memory" if self.free else f"within a budget of {self.budget_bytes / _MIB:.1f} MiB"
        line = (
            f"kept {len(self.kept)} of {len(self.candidates)} units unsharded to the backward "
            f"({', '.join(self.kept) or 'none'}) {within}: predicted peak "
            f"{self.peak_bytes / _MIB:.1f} MiB just in time "
            f"(ZeRO3 {self.zero3_peak_bytes / _MIB:.1f}, ZeRO2 {self.zero2_peak_bytes / _MIB:.1f})"
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
    is within ``budget_bytes``; where the budget then holds back its prefetching, the shorter
    prefix within the budget that ``predict`` (the step as scheduled within the budget) finds
    fastest, ZeRO3's included where it fits. Where ZeRO3 itself is over the budget, keeping units
    may still fit (a kept unit spares its re-gather); raises :class:`MemoryBudgetTooSmall` where
    no prefix tried fits, naming the least peak found."""
    candidates = tuple(candidates)
    peaks: dict[int, int] = {}
    predictions: dict[int, StepPrediction] = {}

    def peak(kept: int) -> int:
        if kept not in peaks:
            peaks[kept] = peak_of(candidates[:kept])
            logger.debug("keeping %d units: predicted just-in-time peak %d B against %d B", kept, peaks[kept], budget_bytes)
        return peaks[kept]

    def fits(kept: int) -> bool:
        return peak(kept) <= budget_bytes

    def prediction(kept: int) -> StepPrediction:
        if kept not in predictions:
            predictions[kept] = predict(candidates[:kept])
            logger.debug("keeping %d units: predicted step %.3f ms", kept, predictions[kept].step_ms)
        return predictions[kept]

    fewest, kept = _fitting_prefixes(len(candidates), peak, fits, budget_bytes)
    scheduled, zero3_scheduled = None, None
    if predict is not None and candidates:
        if prediction(kept).budget_bound:
            # [Note: selective unsharding]: what a kept unit takes, prefetching no longer has.
            # Above ZeRO3's peak the prefixes between need not all fit: each is checked.
            checked = fits if fewest > 0 else (lambda k: True)
            stride = -(-(kept - fewest) // _MOST_PROBES)
            probes = [k for k in sorted({*range(fewest, kept, max(stride, 1)), kept}) if checked(k)]
            best = min(probes, key=lambda k: (prediction(k).step_ms, -k))
            for direction in (-1, 1):  # between probes, while faster
                while fewest <= best + direction <= kept and checked(best + direction):
                    if prediction(best + direction).step_ms >= prediction(best).step_ms:
                        break
                    best += direction
            kept = best
        scheduled, zero3_scheduled = prediction(kept), prediction(0)
    return UnshardingChoice(
        budget_bytes=budget_bytes,
        candidates=candidates,
        kept=candidates[:kept],
        peak_bytes=peak(kept),
        zero3_peak_bytes=peak(0),
        zero2_peak_bytes=peak(len(candidates)),
        scheduled=scheduled,
        zero3_scheduled=zero3_scheduled,
        regather_bytes_saved=sum(unit_bytes[unit] for unit in candidates[:kept]),
    )


def choose_free_units(
    candidates: Sequence[str],
    unit_bytes: Mapping[str, int],
    peak_of: Callable[[tuple[str, ...]], int],
    block_units: set[str],
    predict: Callable[[tuple[str, ...]], StepPrediction] | None = None,
) -> UnshardingChoice:
    """Plain ZeRO3's choice ([Note: ZeRO3 keeps what is free]): the ``candidates`` the backward
    needs up to its first block (one of ``block_units``), and that block, for as long as keeping
    each leaves the just-in-time step peak (``peak_of``) at ZeRO3's own. With ``predict`` (the
    step as scheduled): that prefix where the budget did not bind it or it is predicted no
    slower than keeping none, else the longest of the shorter ones predicted no slower than the
    fastest. Every prefix of the choice is free too, so ranks may agree on the common one."""
    zero3_peak = peak_of(())
    kept: tuple[str, ...] = ()
    for unit in candidates:
        if peak_of((*kept, unit)) > zero3_peak:
            break
        kept = (*kept, unit)
        if unit in block_units:
            break
    scheduled, zero3_scheduled = None, None
    if predict is not None and kept:
        predictions = {len(kept): predict(kept)}
        # A kept unit costs time only through the budget: where it did not bind, keep them all.
        if predictions[len(kept)].budget_bound:
            predictions[0] = predict(())
            if predictions[len(kept)].step_ms > predictions[0].step_ms * (1 + _SAME_STEP):
                # Slower than keeping none: a shorter prefix may still pay.
                predictions.update((count, predict(kept[:count])) for count in range(1, len(kept)))
        fastest_ms = min(p.step_ms for p in predictions.values())
        count = max(k for k, p in predictions.items() if p.step_ms <= fastest_ms * (1 + _SAME_STEP))
        kept, scheduled, zero3_scheduled = kept[:count], predictions[count], predictions.get(0)
    return UnshardingChoice(
        budget_bytes=zero3_peak,
        candidates=tuple(candidates),
        kept=kept,
        peak_bytes=peak_of(kept),
        zero3_peak_bytes=zero3_peak,
        zero2_peak_bytes=peak_of(tuple(candidates)),
        scheduled=scheduled,
        zero3_scheduled=zero3_scheduled,
        regather_bytes_saved=sum(unit_bytes[unit] for unit in kept),
        free=True,
    )


def _fitting_prefixes(count: int, peak: Callable[[int], int], fits: Callable[[int], bool], budget_bytes: int) -> tuple[int, int]:
    """(the fewest units kept found within the budget, the most): the peak mostly grows with the
    units kept, so each end is found by bisection from the end that fits. Where neither ZeRO3
    (none kept) nor ZeRO2 (all) fits, at most ``_MOST_PROBES`` prefixes between are tried."""
    if fits(0):
        return 0, _bisect(0, count, fits) if not fits(count) else count
    if fits(count):
        return _bisect(count, 0, fits), count
    between = range(1, count, -(-(count - 1) // _MOST_PROBES) or 1)
    fitting = [k for k in between if fits(k)]
    if not fitting:
        least = min((0, *between, count), key=peak)
        raise MemoryBudgetTooSmall(
            f"thunder_overlap sharding 'auto': memory_budget_bytes={budget_bytes} ({budget_bytes / _MIB:.1f} MiB) is below "
            f"the predicted peak of ZeRO3 itself, {peak(0)} B ({peak(0) / _MIB:.1f} MiB), and of every number of blocks kept "
            f"unsharded that was tried: the least, keeping {least} of {count} units, is {peak(least)} B "
            f"({peak(least) / _MIB:.1f} MiB); raise the budget, or shrink the batch, the sequence or the model per rank"
        )
    fewest, most = min(fitting), max(fitting)
    while fewest > 1 and fits(fewest - 1):
        fewest -= 1
    while most < count - 1 and fits(most + 1):
        most += 1
    return fewest, most


def _bisect(good: int, bad: int, fits: Callable[[int], bool]) -> int:
    """The prefix next to the boundary between ``good`` (fits) and ``bad`` (does not), on
    ``good``'s side: either may be the larger."""
    while abs(bad - good) > 1:
        middle = (good + bad) // 2
        if fits(middle):
            good = middle
        else:
            bad = middle
    return good
