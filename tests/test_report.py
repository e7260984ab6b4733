"""Report object and ``report`` command: smoke tests with the fake process group (8 ranks)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import thunder_overlap
from thunder_overlap.analysis.classify import NodeKind
from thunder_overlap.tools.tiny_models import TinyGPT, TinyGPTConfig
from thunder_overlap.report.report import report
from thunder_overlap.report.cli import main

# The command creates (and destroys) its own fake process group, so its tests come first,
# before the module's group for report() exists.


def test_cli_on_a_two_layer_llama_at_world_size_8(tmp_path, capsys):
    rc = main(["--model", "llama-2-7b", "--n-layer", "2", "--world-size", "8", "--seq-len", "256", "--out", str(tmp_path), "--steps", "5"])
    assert rc == 0
    out, err = capsys.readouterr()
    assert "thunder_overlap" in out and "potentially hideable" in out
    assert "tracing forward and backward at world size 8" in err
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["world_size"] == 8
    forward = data["passes"]["forward"]
    # 2 blocks of 7 weights (two norms, qkv, proj, three MLP), the embedding, the final norm and
    # the head: one all-gather each.
    assert forward["thunder"]["collectives"] == forward["thunder_overlap"]["collectives"] == 2 * 7 + 3
    assert forward["thunder_overlap"]["predicted_ms"] <= forward["thunder"]["predicted_ms"]
    assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "report.trace.json").read_text())["traceEvents"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "gpt-17"], "unknown model 'gpt-17'"),
        (["--world-size", "0"], "--world-size 0 is impossible"),
        (["--n-layer", "0"], "--n-layer 0 is impossible"),
        (["--sharding", "zero4"], "sharding_strategy='zero4'"),
        (["--bucketing", "blocks"], "bucketing_strategy='blocks'"),
        (["--network", "carrier-pigeon"], "unknown network 'carrier-pigeon'"),
        (["--device-profile", "tpu"], "unknown device profile 'tpu'"),
        (["--model", "tiny-gpt", "--seq-len", "1000"], "--seq-len 1000"),
    ],
)
def test_cli_errors_name_the_bad_value(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------

MODEL = TinyGPTConfig(n_layer=2, n_embd=32)


@pytest.fixture(scope="module")
def jitted():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    torch.manual_seed(0)
    jm = thunder_overlap.fsdp(TinyGPT(MODEL), device="cpu", sharding_strategy="zero3")
    jm(torch.randint(0, MODEL.vocab_size, (2, 16))).sum().backward()
    dist.destroy_process_group()  # report() reads the traces only; the CLI tests need no group alive
    yield jm


def test_report_compares_thunder_order_with_thunder_overlap(jitted):
    # A slow network (1 GB/s) so that communication matters at this size.
    result = report(jitted, device_profile="h100", network="custom:5:1")
    assert result.world_size == 8
    for p in result.passes:
        assert p.baseline.collectives == p.overlap.collectives > 0
        assert p.overlap.predicted_ms <= p.baseline.predicted_ms + 1e-9
        assert p.overlap.hidden >= p.baseline.hidden
        assert p.overlap.compute_ms == pytest.approx(p.baseline.compute_ms)  # same work, other order
        # Communication differs only by latency saved where like collectives go out together:
        # at most 7 ring steps of 5 us (custom:5:1 on 8 ranks) per collective.
        latency_ms = 7 * 5e-3 * len(p.overlap.annotated.collectives)
        assert abs(p.overlap.communication_ms - p.baseline.communication_ms) <= latency_ms
        assert p.overlap.predicted_ms >= p.overlap.bound_ms - 1e-9
        assert p.overlap.exposed_ms == pytest.approx(p.overlap.predicted_ms - p.overlap.compute_ms)
    # The baseline is Thunder's order: every forward all-gather is issued before any compute.
    baseline = result["forward"].baseline.annotated
    first_compute = next(n.index for n in baseline.nodes if n.kind is NodeKind.COMPUTE)
    assert all(c.start < first_compute for c in baseline.collectives)
    text = str(result)
    assert "forward   thunder " in text and "backward  thunder_overlap" in text
    assert "hides" in text


def test_report_exports(jitted, tmp_path):
    result = report(jitted)
    data = result.to_json(tmp_path / "r.json")
    assert json.loads((tmp_path / "r.json").read_text()) == json.loads(json.dumps(data))
    assert set(data["passes"]) == {"forward", "backward"}
    result.to_chrome_trace(tmp_path / "t.json")
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert {e["ph"] for e in events} >= {"X", "C", "M"}
    assert {e["tid"] for e in events if e["ph"] == "X"} == {0, 1}  # compute and one comm stream
    table = result["backward"].step_table(max_rows=40)
    assert "issue RS" in table or "issue AG" in table
    assert len(table.splitlines()) == 42  # header, 40 rows, "... more steps"


def test_policy_comparison_puts_every_policy_side_by_side(jitted):
    from thunder_overlap.config import OverlapConfig
    from thunder_overlap.analysis.cost_model import CostModel
    from thunder_overlap.report.policies import COMPARED_POLICIES, compare_policies

    cost_model = CostModel.named("h100", "custom:5:1")
    # A budget with no slack at all: memory_aware may not exceed the just-in-time peak.
    tight = OverlapConfig(memory_slack_bytes=0, memory_slack_ratio=0.0)
    comparison = compare_policies(jitted, cost_model=cost_model, config=tight)
    for pass_name in ("forward", "backward"):
        rows = {p: comparison.result(p, pass_name) for p in COMPARED_POLICIES}
        jit = rows["just_in_time"]
        assert rows["memory_aware"].summary.budget_bytes == rows["memory_aware"].summary.baseline_peak_bytes
        assert rows["memory_aware"].summary.peak_bytes <= rows["memory_aware"].summary.budget_bytes
        # Overlap buys time: every overlapping policy hides more than the just-in-time order.
        for policy in ("heuristic", "greedy", "memory_aware"):
            assert rows[policy].report.hidden >= jit.report.hidden
            assert rows[policy].report.predicted_ms <= jit.report.predicted_ms + 1e-9
    backward = {p: comparison.result(p, "backward").report for p in COMPARED_POLICIES}
    assert backward["greedy"].peak_bytes > backward["just_in_time"].peak_bytes
    assert backward["memory_aware"].hidden > backward["just_in_time"].hidden
    text = str(comparison)
    assert all(p in text for p in COMPARED_POLICIES) and "vs JIT" in text
