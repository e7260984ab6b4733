"""Sharding "auto"'s search (choose_kept_units) on peaks and step times given as functions of the
number of units kept: the longest prefix within the budget, or, where the budget holds back its
prefetching, the fastest prefix as scheduled, never one ZeRO3 beats."""

from __future__ import annotations

import pytest

from thunder_overlap._scheduling.unsharding import MemoryBudgetTooSmall, StepPrediction, choose_free_units, choose_kept_units

MIB = 1 << 20


def _units(count: int) -> list[str]:
    return [f"blocks.{i}" for i in range(count)]


class _Step:
    """Peaks and step times by number of units kept; records what was priced."""

    def __init__(self, peaks: list[int], step_ms: list[float] | None = None, bound: list[bool] | None = None) -> None:
        self.peaks, self.step_ms = peaks, step_ms
        self.bound = bound if bound is not None else [True] * len(peaks)
        self.peaked: list[int] = []
        self.predicted: list[int] = []

    def peak_of(self, kept: tuple[str, ...]) -> int:
        self.peaked.append(len(kept))
        return self.peaks[len(kept)]

    def predict(self, kept: tuple[str, ...]) -> StepPrediction:
        self.predicted.append(len(kept))
        return StepPrediction(self.peaks[len(kept)], self.step_ms[len(kept)], self.bound[len(kept)])

    def choose(self, budget: int, units: list[str]):
        predict = self.predict if self.step_ms is not None else None
        return choose_kept_units(units, dict.fromkeys(units, MIB), self.peak_of, budget, predict)


def test_without_predictions_the_longest_prefix_within_the_budget_is_kept():
    units = _units(8)
    step = _Step([100 + 10 * k for k in range(9)])
    choice = step.choose(155, units)
    assert choice.kept == tuple(units[:5]) and choice.peak_bytes == 150
    assert (choice.zero3_peak_bytes, choice.zero2_peak_bytes) == (100, 180)
    assert choice.regather_bytes_saved == 5 * MIB and choice.scheduled is None
    # Bisection: ZeRO3, ZeRO2, then log2(8) probes, each prefix priced once.
    assert len(step.peaked) == len(set(step.peaked)) <= 2 + 3


def test_a_peak_that_falls_with_the_first_units_kept_still_gives_a_prefix_priced_within_the_budget():
    # Keeping the blocks the backward needs first spares their re-gathers at its peak.
    units = _units(6)
    step = _Step([262, 262, 260, 261, 265, 269, 269])
    choice = step.choose(266, units)
    assert choice.kept == tuple(units[:4]) and choice.peak_bytes == 265 <= 266


def test_where_prefetching_is_not_held_back_the_longest_prefix_is_kept_whatever_the_times():
    units = _units(6)
    # Times that would favour fewer units: the model's noise, not a trade the budget forces.
    step = _Step([100 + 10 * k for k in range(7)], step_ms=[50, 40, 41, 42, 43, 44, 45], bound=[False] * 7)
    choice = step.choose(1000, units)
    assert choice.kept == tuple(units)
    assert sorted(set(step.predicted)) == [0, 6]  # the choice and ZeRO3, for the report
    assert choice.scheduled == StepPrediction(160, 45) and choice.zero3_scheduled == StepPrediction(100, 50)


def test_where_the_budget_holds_prefetching_back_the_fastest_prefix_is_kept():
    units = _units(6)
    # Not unimodal: a walk back from the longest prefix would stop at 4.
    step_ms = [100, 95, 90, 97, 96, 99, 80]
    step = _Step([100 + 10 * k for k in range(7)], step_ms)
    choice = step.choose(155, units)  # the longest within the budget keeps 5
    assert choice.kept == tuple(units[:2])
    assert choice.scheduled.step_ms == 90 and choice.zero3_scheduled.step_ms == 100
    assert 6 not in step.predicted  # over the budget: never scheduled


def test_zero3_is_kept_where_it_is_predicted_fastest():
    units = _units(4)
    step = _Step([100, 110, 120, 130, 140], step_ms=[90, 95, 96, 97, 98])
    assert step.choose(135, units).kept == ()


def test_equal_times_keep_more_units():
    units = _units(4)
    step = _Step([100, 110, 120, 130, 140], step_ms=[90, 90, 90, 90, 80])
    assert step.choose(135, units).kept == tuple(units[:3])


def test_many_units_are_searched_from_at_most_sixteen_probes_then_neighbours():
    units = _units(80)
    best = 37  # between probes (a stride of 5 from 0)
    step_ms = [100 + abs(k - best) for k in range(81)]
    step = _Step([100 + k for k in range(81)], step_ms)
    choice = step.choose(100 + 79, units)
    assert choice.kept == tuple(units[:best])
    probes = set(range(0, 79, 5)) | {79}
    assert set(step.predicted) - probes <= {34, 36, 37, 38, 39, 41}  # walked from the best probe, 35 or 40
    assert len(set(step.predicted)) <= len(probes) + 5


def test_a_budget_below_every_peak_is_an_error_naming_zero3s_and_the_least():
    step = _Step([300, 310])
    with pytest.raises(MemoryBudgetTooSmall, match=r"memory_budget_bytes=299 .* ZeRO3 itself, 300 B .* keeping 0 of 1 units, is 300 B"):
        step.choose(299, _units(1))
    # The least found between the ends: a dip where no prefix fits.
    step = _Step([300, 299, 298, 301, 305])
    with pytest.raises(MemoryBudgetTooSmall, match=r"the least, keeping 2 of 4 units, is 298 B"):
        step.choose(297, _units(4))


def test_where_zero3_is_over_the_budget_and_zero2_fits_every_unit_is_kept():
    # At small batches a kept unit spares more (its re-gather) than it holds: ZeRO2 below ZeRO3.
    units = _units(6)
    step = _Step([320, 318, 316, 314, 312, 310, 308])
    choice = step.choose(315, units)
    assert choice.kept == tuple(units) and choice.peak_bytes == 308 <= 315
    assert (choice.zero3_peak_bytes, choice.zero2_peak_bytes) == (320, 308)


def test_where_zero3_is_over_the_budget_prefetch_is_traded_only_among_prefixes_that_fit():
    units = _units(6)
    # Fits from 3 units on; 1 and 2 would be fastest but are over the budget.
    step = _Step([320, 318, 316, 314, 312, 310, 308], step_ms=[80, 70, 71, 90, 85, 86, 95])
    choice = step.choose(315, units)
    assert choice.kept == tuple(units[:4]) and choice.peak_bytes <= 315
    assert not {1, 2} & set(step.predicted) - {0}  # over the budget: never scheduled


def test_where_only_some_middle_prefixes_fit_the_longest_of_them_is_kept():
    units = _units(40)
    # Over at both ends, within from 10 to 25 units kept: found from the probes, then widened.
    peaks = [300 if 10 <= k <= 25 else 320 for k in range(41)]
    choice = _Step(peaks).choose(310, units)
    assert choice.kept == tuple(units[:25]) and choice.peak_bytes == 300


# Plain ZeRO3 ([Note: ZeRO3 keeps what is free]): a head and a norm, then blocks last to first.
FREE_CANDIDATES = ["lm_head", "norm_f", "blocks.2", "blocks.1", "blocks.0"]
BLOCK_UNITS = {"blocks.0", "blocks.1", "blocks.2"}


@pytest.mark.parametrize(
    ("peaks", "kept"),
    [
        # Free all the way: up to the first block and that block, never the blocks its compute hides.
        ([100, 100, 100, 100, 90, 90], ("lm_head", "norm_f", "blocks.2")),
        # The first block would raise the peak: the head and the norm alone.
        ([100, 100, 100, 101, 100, 100], ("lm_head", "norm_f")),
        # A unit that is not free stops the scan, even where a longer prefix would be free again.
        ([100, 100, 101, 100, 100, 100], ("lm_head",)),
        ([100, 104, 100, 100, 100, 100], ()),
    ],
)
def test_zero3_keeps_what_its_backward_needs_up_to_its_first_block_where_free(peaks, kept):
    step = _Step(peaks)
    choice = choose_free_units(FREE_CANDIDATES, dict.fromkeys(FREE_CANDIDATES, MIB), step.peak_of, BLOCK_UNITS)
    assert choice.free and choice.kept == kept
    assert choice.peak_bytes == choice.zero3_peak_bytes == choice.budget_bytes == 100
    assert choice.zero2_peak_bytes == peaks[-1] and choice.regather_bytes_saved == len(kept) * MIB


@pytest.mark.parametrize(
    ("step_ms", "kept", "predicted"),
    [
        # Keeping a block can hold the backward's prefetching back: the fastest free prefix is kept.
        ([400.0, 395.0, 390.0, 450.0], ("lm_head", "norm_f"), [0, 1, 2, 3]),
        ([400.0, 410.0, 420.0, 430.0], (), [0, 1, 2, 3]),
        ([400.0, 390.0, 380.0, 400.0 * (1 + 1e-3)], ("lm_head", "norm_f"), [0, 1, 2, 3]),
        # No slower than keeping none (to rounding): every free unit, the prefixes between unpriced.
        ([400.0, 390.0, 380.0, 400.0 * (1 + 1e-9)], ("lm_head", "norm_f", "blocks.2"), [0, 3]),
        ([400.0, 300.0, 300.0, 390.0], ("lm_head", "norm_f", "blocks.2"), [0, 3]),
    ],
)
def test_zero3_keeps_every_free_unit_unless_that_step_is_predicted_slower_than_keeping_none(step_ms, kept, predicted):
    # Every unit up to the first block is free; only the predicted steps differ.
    step = _Step([100] * 6, step_ms + [500.0, 500.0])
    choice = choose_free_units(FREE_CANDIDATES, dict.fromkeys(FREE_CANDIDATES, MIB), step.peak_of, BLOCK_UNITS, step.predict)
    assert choice.free and choice.kept == kept
    # Each prefix priced at most once; the units past the first block never.
    assert sorted(step.predicted) == predicted
    assert choice.scheduled.step_ms == step_ms[len(kept)] and choice.zero3_scheduled.step_ms == step_ms[0]


def test_zero3_keeps_every_free_unit_where_the_budget_does_not_bind_that_step():
    # A kept unit costs time only through the budget: keeping none is not even priced.
    step = _Step([100] * 6, [400.0, 300.0, 300.0, 450.0, 500.0, 500.0], bound=[True, True, True, False, True, True])
    choice = choose_free_units(FREE_CANDIDATES, dict.fromkeys(FREE_CANDIDATES, MIB), step.peak_of, BLOCK_UNITS, step.predict)
    assert choice.kept == ("lm_head", "norm_f", "blocks.2") and step.predicted == [3]
    assert choice.scheduled.step_ms == 450.0 and choice.zero3_scheduled is None


def test_zero3_predicts_nothing_where_nothing_is_free():
    step = _Step([100, 104, 100, 100, 100, 100], [400.0] * 6)
    choice = choose_free_units(FREE_CANDIDATES, dict.fromkeys(FREE_CANDIDATES, MIB), step.peak_of, BLOCK_UNITS, step.predict)
    assert choice.kept == () and step.predicted == [] and choice.scheduled is None
