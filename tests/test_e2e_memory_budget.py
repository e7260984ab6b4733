"""Training under a memory budget tight enough to bind still matches the single-process
reference on two gloo ranks (the budget only moves collectives and waits)."""

from __future__ import annotations

import torch

from thunder_overlap import OverlapConfig
from thunder_overlap.report._builtin_models import TinyGPTConfig
from thunder_overlap.testing.local_ranks import run_local_ranks
from thunder_overlap.testing.training import TrainSetup, shard_of, train_rank, train_reference

MODEL = TinyGPTConfig(n_layer=4, n_embd=64)
# No slack: the budget is the just-in-time order's own predicted peak.
TIGHT = OverlapConfig(memory_slack_bytes=0, memory_slack_ratio=0.0)


def test_training_under_a_tight_budget_matches_the_reference():
    setup = TrainSetup(sharding="zero3", model=MODEL, steps=2, config=TIGHT, measure_memory=False)
    ranks = run_local_ranks(train_rank, 2, (setup,))
    reference_losses, reference_state = train_reference(setup, 2)
    mean_losses = [sum(r.losses[i] for r in ranks) / 2 for i in range(setup.steps)]
    torch.testing.assert_close(torch.tensor(mean_losses), torch.tensor(reference_losses), rtol=1e-5, atol=1e-5)
    for r in ranks:
        for name, shard in r.shards.items():
            expected, rows = shard_of(reference_state[name], r.rank, 2)
            torch.testing.assert_close(shard[:rows], expected, rtol=1e-5, atol=1e-6, msg=f"{name} on rank {r.rank}")
