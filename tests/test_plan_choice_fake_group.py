"""``"auto"``'s bucket plan against block buckets at the first compile ([Note: auto against
block]): the faster predicted plan is the one the final traces run, and its prediction is what
the report simulates of them. In one process on the fake process group (8 ranks)."""

from __future__ import annotations

import pytest
import thunder
import torch

from thunder_overlap import BucketingTransform, CostModel, OverlapConfig
from thunder_overlap._bucketing.buffers import BucketBuffers
from thunder_overlap._ops import BUCKETED_ISSUES
from thunder_overlap.config import Tuning
from thunder_overlap.report._builtin_models import TinyGPT, TinyGPTConfig
from thunder_overlap.report._models import trace_model
from thunder_overlap.report._report import analyze_trace
from thunder_overlap.testing.bucket_census import expected_plan

MODEL = TinyGPTConfig(n_layer=4, vocab_size=104, n_embd=64)
# At 1 ms a launch "auto" merges two blocks a bucket, and halving the launches pays; over
# InfiniBand it cuts at the blocks but merges the embeddings into their neighbours, and block
# buckets, whose first and last buckets are smaller, are predicted a little faster.
SLOW_LAUNCHES, INFINIBAND = "custom:1000:100", "infiniband"
BLOCK_LABELS = ["wte", "wpe (float32, frozen)", *(f"blocks.{i}" for i in range(MODEL.n_layer)), "norm_f"]

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fake_group_8")]


def _traced(sharding: str, network: str, **tuning):
    cost_model = CostModel.named("h100", network)
    with torch.device("meta"):
        model = TinyGPT(MODEL)
    config = OverlapConfig(cost_model=cost_model, _tuning=Tuning(**tuning))
    jm = trace_model(model, world_size=8, sharding=sharding, bucketing="auto", idx_shape=(2, 64), config=config)
    return jm, cost_model


def _buckets_in(args) -> list[BucketBuffers]:
    """The buckets an operator's arguments name (a coalesced launch's, in its members)."""
    if isinstance(args, BucketBuffers):
        return [args]
    if isinstance(args, (list, tuple)):
        return [bucket for arg in args for bucket in _buckets_in(arg)]
    return []


def _simulated_step_ms(jm, cost_model: CostModel) -> float:
    layouts, step_ms, after = BucketingTransform.of(jm).layouts, 0.0, None
    for trace in (thunder.last_traces(jm)[-1], thunder.last_backward_traces(jm)[-1]):
        report = analyze_trace(trace, cost_model, order="final", after=after, layouts=layouts)
        step_ms, after = step_ms + report.predicted_ms, report.memory
    return step_ms


@pytest.mark.parametrize(
    ("sharding", "network", "chosen"),
    # ZeRO3 chooses in its own hook, with each plan's kept units; ZeRO2 in the bucketing
    # transform's, which then buckets its forward again.
    [("zero3", SLOW_LAUNCHES, "auto"), ("zero3", INFINIBAND, "block"), ("zero2", INFINIBAND, "block")],
)
def test_the_first_compile_runs_the_plan_it_predicts_faster(sharding, network, chosen):
    jm, cost_model = _traced(sharding, network)
    bucketing = BucketingTransform.of(jm)
    choice = bucketing.summaries.plan_choice
    assert choice is not None and set(choice.step_ms) == {"auto", "block"}
    assert choice.chosen == chosen == expected_plan(choice), choice
    labels = [plan.label for plan in bucketing.plans]
    assert (labels == BLOCK_LABELS) == (chosen == "block"), labels
    assert bucketing.summaries.plan.strategy == chosen
    # The traces that run name only the buckets laid out now, and the parameters are their views.
    for history in (thunder.last_traces(jm), thunder.last_backward_traces(jm)):
        named = {id(bucket) for b in history[-1].bound_symbols if b.sym.id in BUCKETED_ISSUES for bucket in _buckets_in(b.args)}
        assert named and named <= {id(bucket) for bucket in bucketing.buckets}
    # The choice priced the step the compile then scheduled: the same traces, the same simulator.
    assert _simulated_step_ms(jm, cost_model) == pytest.approx(choice.step_ms[chosen], rel=1e-3)


def test_tuning_can_keep_autos_plan():
    jm, _ = _traced("zero3", INFINIBAND, auto_weighs_block_buckets=False)
    bucketing = BucketingTransform.of(jm)
    assert bucketing.summaries.plan_choice is None and bucketing.summaries.plan.strategy == "auto"
    assert [plan.label for plan in bucketing.plans] != BLOCK_LABELS
