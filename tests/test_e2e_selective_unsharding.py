"""Sharding "auto" on two gloo ranks, 8 blocks: with a budget halfway between ZeRO3's and ZeRO2's
measured peaks, the backward re-gathers some blocks and not others, the step's measured peak stays
within the budget, and training matches the float64 single-process reference step by step."""

from __future__ import annotations

import pytest

from thunder_overlap import OverlapConfig
from thunder_overlap.report._builtin_models import TinyGPTConfig
from thunder_overlap.testing.training import TrainSetup, check_against_reference, train_rank

pytestmark = pytest.mark.ranks

MODEL = TinyGPTConfig(n_layer=8, n_embd=64)


def _measured_step_peak(rank) -> int:
    """The step's peak in the budget's units: what it allocated plus the inputs it held."""
    return rank.peak_step_bytes + rank.held_inputs_bytes


def test_a_budget_between_zero3_and_zero2_is_kept_and_trains_like_the_reference(local_ranks):
    # Block buckets: a kept block's bucket buffer stays out of the pool until its backward
    # (unbucketed runs are checked on the fake group, tests/test_selective_unsharding_fake_group.py).
    bucketing = "block"
    peaks, backward_all_gathers = {}, {}
    for sharding in ("zero2", "zero3"):
        ranks = local_ranks(train_rank, 2, (TrainSetup(sharding=sharding, bucketing=bucketing, model=MODEL, steps=1),))
        peaks[sharding] = max(_measured_step_peak(r) for r in ranks)
        backward_all_gathers[sharding] = ranks[0].backward_stats.allgathers
    budget = (peaks["zero3"] + peaks["zero2"]) // 2
    setup = TrainSetup(sharding="auto", bucketing=bucketing, model=MODEL, steps=2, config=OverlapConfig(memory_budget_bytes=budget))
    ranks = local_ranks(train_rank, 2, (setup,))

    assert backward_all_gathers["zero2"] < ranks[0].backward_stats.allgathers < backward_all_gathers["zero3"]
    for rank in ranks:
        assert _measured_step_peak(rank) <= budget * 1.05, (rank.rank, _measured_step_peak(rank), budget, peaks)
        assert rank.collectives == ranks[0].collectives  # one choice on both ranks
    check = check_against_reference(setup, 2, ranks)
    check.assert_mean_losses([r.losses for r in ranks])
    check.mismatches.assert_none()
