"""benchmarks/bucket_search.py on the fake process group: its candidates are predicted as a compile
predicts its own plan, and an exhaustive search covers every bucketing."""

from __future__ import annotations

import math

import pytest
from bucket_search import _parser, search_setting


@pytest.mark.slow
def test_auto_plan_is_predicted_as_compiled_and_every_bucketing_is_tried():
    # Two layers of Llama-2-7B at 64 ranks: blocks large enough that auto gives them buckets of
    # their own, five units (embedding, two blocks, final norm, head), 16 bucketings.
    args = _parser().parse_args(["--n-layer", "2", "--seq-len", "256", "--world-size", "64", "--sharding", "zero2"])
    outcome = search_setting(args)
    auto, compiled = outcome.auto, outcome.auto_as_compiled
    assert len(auto.starts) >= 2, auto.labels
    # The same traces rewritten into the same buckets and scheduled as the compile did: the same
    # floating-point sums in the same order, so equal but for rounding.
    for figure in ("step_ms", "bound_ms"):
        assert math.isclose(getattr(auto, figure), getattr(compiled, figure), rel_tol=1e-9), (auto, compiled)
    assert auto.peak_bytes == compiled.peak_bytes and len(auto.labels) == len(compiled.labels)
    assert outcome.units == 5
    assert sorted(c.starts for c in outcome.evaluated) == sorted({c.starts for c in outcome.evaluated})
    assert len(outcome.evaluated) == 2 ** (outcome.units - 1)
    assert all(len(c.labels) == len(c.starts) and c.starts[0] == 0 for c in outcome.evaluated)
    assert outcome.fastest.step_ms <= auto.step_ms
    # One bucket for everything and one per unit bracket the launches: the first pays one
    # latency per pass, the second five.
    by_starts = {c.starts: c for c in outcome.evaluated}
    assert by_starts[(0,)].bound_ms < by_starts[(0, 1, 2, 3, 4)].bound_ms


@pytest.mark.slow
def test_a_start_that_is_no_bucketing_is_refused_naming_what_is_accepted():
    # At 8 ranks over NVLink auto cuts inside blocks: its plan is no candidate of whole blocks, and
    # the climb starts where it is told.
    options = ["--n-layer", "2", "--seq-len", "64", "--world-size", "8", "--search", "climb"]
    args = _parser().parse_args([*options, "--start", "blocks.1.qkv.weight"])
    accepted = r"accepted: \['wte.weight', 'blocks.0.norm_1.weight', 'blocks.1.norm_1.weight', 'norm_f.weight', 'lm_head.weight'\]"
    with pytest.raises(ValueError, match=r"not first parameters: \['blocks.1.qkv.weight'\]\); " + accepted):
        search_setting(args)
