"""Training under a memory budget tight enough to bind still matches the float64 single-process
reference on two gloo ranks, step by step (the budget only moves collectives and waits)."""

from __future__ import annotations

import pytest

from thunder_overlap import OverlapConfig
from thunder_overlap.report._builtin_models import TinyGPTConfig
from thunder_overlap.testing.training import TrainSetup, check_against_reference, train_rank

pytestmark = pytest.mark.ranks

MODEL = TinyGPTConfig(n_layer=3, n_embd=64)
# No slack: the budget is the just-in-time order's own predicted peak.
TIGHT = OverlapConfig(memory_slack_bytes=0, memory_slack_ratio=0.0)


def test_training_under_a_tight_budget_matches_the_reference(local_ranks):
    setup = TrainSetup(sharding="zero3", model=MODEL, steps=2, config=TIGHT, measure_memory=False)
    ranks = local_ranks(train_rank, 2, (setup,))
    check = check_against_reference(setup, 2, ranks)
    check.assert_mean_losses([r.losses for r in ranks])
    # Every step, rank, parameter and element against float64, within float32's rounding bounds.
    check.mismatches.assert_none()
