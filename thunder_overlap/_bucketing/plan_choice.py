"""``"auto"``'s bucket plan against ``"block"``'s, chosen at the first compile ([Note: auto against block]).

``"auto"`` sizes its buckets from the network alone, before any trace exists; whether merging two
blocks to saturate a link pays depends on what the traces then do with the buckets (how many units
ZeRO3 can keep gathered for free, how much compute hides each transfer). Where the two plans
differ, the first compile prices both steps as they would run and keeps the faster; this module
holds the candidate and the record of the choice, :class:`~thunder_overlap._transforms._model_state.ModelState`
lays a candidate out and adopts it.
"""

from __future__ import annotations

from dataclasses import dataclass

from thunder_overlap._bucketing.plan import BucketPlan, BucketPlanSummary
from thunder_overlap.options import MixedPrecision

__all__ = ["PLANS_TIED", "BucketPlanChoice", "PlanCandidate", "same_grouping"]

# Predicted steps of the two plans this close are the same step, and block buckets (the plan
# "auto" must not lose to) run: a compile's prediction leaves out what needs the other ranks, and
# differed from the step as scheduled by 0.8% (Llama-2-7B x8 at 8 ranks) where the plans were
# 0.03% apart.
PLANS_TIED = 1e-3


@dataclass(frozen=True)
class PlanCandidate:
    """A bucketing the first compile may run instead of the one laid out: its plans, why each
    bucket was formed, and what laying it out takes (each parameter's elements before padding and
    its aliases, the dtype each bucket gathers in)."""

    plans: list[BucketPlan]
    summary: BucketPlanSummary
    unsharded_numels: dict[str, int]
    aliases: dict[str, list[str]]
    mixed_precision: MixedPrecision | None = None


@dataclass(frozen=True)
class BucketPlanChoice:
    """Each plan's predicted step (summed over the ranks that agreed, each rank's own where it
    chose alone), the one that runs and the summary of the one that does not."""

    step_ms: dict[str, float]
    chosen: str
    not_run: BucketPlanSummary

    def __str__(self) -> str:
        priced = ", ".join(f"{strategy} {ms:.3f} ms" for strategy, ms in self.step_ms.items())
        return f"bucket plan: {self.chosen}'s runs (predicted steps: {priced})"


def same_grouping(first: list[BucketPlan], second: list[BucketPlan]) -> bool:
    """Whether two plans put the same parameters together, in the same order (labels aside)."""
    return [[s.name for s in p.slots] for p in first] == [[s.name for s in p.slots] for p in second]
