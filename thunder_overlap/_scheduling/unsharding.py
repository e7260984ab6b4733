"""Selective unsharding: which units (blocks, or buckets) keep their gathered parameters from the
forward to the backward, within a per-rank memory budget ([Note: selective unsharding] in
docs/design.md).

A kept unit is not re-gathered in the backward (ZeRO2 for it); the others are (ZeRO3). Units are
kept in the order the backward needs them, first needed first: its first re-gather is the one no
compute hides, and a unit kept longer in the forward holds memory longer in the backward too.
The predicted peak mostly grows with the units kept (not always: a kept unit also spares its
re-gather), so a prefix of that order within the budget is found by bisection, each probe one
estimate of the just-in-time step; the prefix returned is one that was priced within it. Room
for the scheduler's prefetch can be kept free: a kept unit saves one re-gather, while
prefetching hides them all.
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

__all__ = ["MemoryBudgetTooSmall", "UnshardingChoice", "choose_kept_units", "just_in_time_step_peak"]

logger = logging.getLogger(__name__)

_MIB = 1 << 20


class MemoryBudgetTooSmall(ValueError):
    """Even ZeRO3, which keeps no unit, is predicted over the memory budget."""


@dataclass(frozen=True)
class UnshardingChoice:
    """What sharding "auto" chose, with the predictions behind it (bytes per rank, the
    just-in-time step's peak as the memory estimator predicts it, buckets and their pool included)."""

    budget_bytes: int
    # Every unit, in the order they are kept (the backward's first need first).
    candidates: tuple[str, ...]
    kept: tuple[str, ...]
    # Left free for the all-gathers the scheduler prefetches: ``peak_bytes`` + it <= the budget.
    prefetch_reserve_bytes: int
    peak_bytes: int  # with ``kept``
    zero3_peak_bytes: int  # with no unit kept
    zero2_peak_bytes: int | None  # with every unit kept (None: not estimated, ZeRO3 was the bound)
    # Unsharded bytes each rank no longer re-gathers per backward.
    regather_bytes_saved: int
    # What this rank would have kept alone, where another rank had less room (else None).
    kept_alone: tuple[str, ...] | None = None

    def describe(self) -> str:
        zero2 = f"{self.zero2_peak_bytes / _MIB:.1f}" if self.zero2_peak_bytes is not None else "-"
        return (
            f"kept {len(self.kept)} of {len(self.candidates)} units unsharded to the backward "
            f"({', '.join(self.kept) or 'none'}): predicted peak {self.peak_bytes / _MIB:.1f} MiB before prefetching, "
            f"{self.prefetch_reserve_bytes / _MIB:.1f} MiB left for it, within a budget of {self.budget_bytes / _MIB:.1f} MiB "
            f"(ZeRO3 {self.zero3_peak_bytes / _MIB:.1f}, ZeRO2 {zero2}); "
            f"{self.regather_bytes_saved / _MIB:.1f} MiB fewer re-gathered per step"
            + (f"; {len(self.kept_alone)} alone, fewer to agree with the other ranks" if self.kept_alone is not None else "")
        )


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
    prefetch_reserve_bytes: int = 0,
) -> UnshardingChoice:
    """A prefix of ``candidates`` (the longest, where the peak grows with it) whose predicted step
    peak (``peak_of(prefix)``) plus ``prefetch_reserve_bytes`` is within ``budget_bytes``. Raises
    :class:`MemoryBudgetTooSmall` where even no unit is over the budget itself."""
    candidates = tuple(candidates)
    zero3 = peak_of(())
    if zero3 > budget_bytes:
        raise MemoryBudgetTooSmall(
            f"thunder_overlap sharding 'auto': memory_budget_bytes={budget_bytes} ({budget_bytes / _MIB:.1f} MiB) is below "
            f"the predicted peak of ZeRO3 itself, {zero3} B ({zero3 / _MIB:.1f} MiB), which keeps no block unsharded; "
            "raise the budget, or shrink the batch, the sequence or the model per rank"
        )
    room = budget_bytes - prefetch_reserve_bytes
    fits, fits_peak = 0, zero3
    zero2 = peak_of(candidates) if candidates else zero3
    if zero3 > room:
        pass  # ZeRO3 itself leaves less than the reserve: keep nothing, prefetch within what is left
    elif zero2 <= room:
        fits, fits_peak = len(candidates), zero2
    else:
        over = len(candidates)  # invariant: candidates[:fits] fit, candidates[:over] do not
        while over - fits > 1:
            middle = (fits + over) // 2
            peak = peak_of(candidates[:middle])
            logger.debug("keeping %d units: predicted peak %d B against %d B", middle, peak, room)
            if peak <= room:
                fits, fits_peak = middle, peak
            else:
                over = middle
    kept = candidates[:fits]
    return UnshardingChoice(
        budget_bytes=budget_bytes,
        candidates=candidates,
        kept=kept,
        prefetch_reserve_bytes=prefetch_reserve_bytes,
        peak_bytes=fits_peak,
        zero3_peak_bytes=zero3,
        zero2_peak_bytes=zero2,
        regather_bytes_saved=sum(unit_bytes[unit] for unit in kept),
    )

