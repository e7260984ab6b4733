"""Report object and ``report`` command: smoke tests with the fake process group (8 ranks)."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import thunder_overlap
from thunder_overlap.__main__ import main as package_main
from thunder_overlap._analysis.classify import NodeKind
from thunder_overlap._analysis.cost_model import CostModel
from thunder_overlap._analysis.simulator import CollectiveTiming, Simulation
from thunder_overlap.config import OverlapConfig, Tuning
from thunder_overlap.report import _device_choice as device_choice
from thunder_overlap.report._builtin_models import TinyGPT, TinyGPTConfig
from thunder_overlap.report._cli import DEFAULT_OUT, main
from thunder_overlap.report._models import trace_model
from thunder_overlap.report._report import BASELINE, LEGEND, OVERLAP, UNSCHEDULED, longest_waits, report, speed_change
from thunder_overlap.report._schedule_view import schedule_stats
from thunder_overlap.report._thunder_baseline import ThunderFSDPTraces

# The command creates (and destroys) its own fake process group; the module's traced model
# (the ``jitted`` fixture) destroys its group before the tests read it, so any order works.


@pytest.mark.slow
def test_cli_on_a_two_layer_llama_at_world_size_8(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default --out is relative to the working directory
    rc = main(["--model", "llama-2-7b", "--n-layer", "2", "--world-size", "8", "--seq-len", "256", "--steps", "5"])
    assert rc == 0
    out, err = capsys.readouterr()
    assert "thunder_overlap" in out and "potentially hideable" in out and LEGEND in out
    assert "tracing forward and backward at world size 8" in err
    assert f"to {tmp_path / DEFAULT_OUT} (the default --out)" in err
    tmp_path = tmp_path / DEFAULT_OUT
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["world_size"] == 8
    forward, backward = data["passes"]["forward"], data["passes"]["backward"]
    assert BASELINE == "thunder 0.2.6" and set(data["step_ms"]) == {BASELINE, UNSCHEDULED, OVERLAP}
    # 2 blocks of 7 weights (two norms, qkv, proj, three MLP), the embedding, the final norm and
    # the head: one all-gather each.
    assert forward[BASELINE]["collectives"] == forward[UNSCHEDULED]["collectives"] == forward[OVERLAP]["collectives"] == 2 * 7 + 3
    assert forward[OVERLAP]["predicted_ms"] <= forward[BASELINE]["predicted_ms"]
    # ZeRO3 (the default): Thunder keeps the unsharded parameters, so its backward only
    # reduce-scatters; thunder_overlap re-gathers each parameter before it reduce-scatters.
    kinds = {order: [c["kind"] for c in backward[order]["collective_timings"]] for order in (BASELINE, OVERLAP)}
    assert kinds[BASELINE].count("reduce_scatter") == kinds[OVERLAP].count("reduce_scatter") == 2 * 7 + 3
    assert "all_gather" not in kinds[BASELINE] and kinds[OVERLAP].count("all_gather") > 0
    assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "report.trace.json").read_text())["traceEvents"]


@pytest.mark.slow
def test_cli_with_auto_buckets_prints_the_plan(tmp_path, capsys):
    argv = ["--model", "tiny-gpt", "--n-layer", "2", "--world-size", "64", "--bucketing", "auto", "--out", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    # 64 ranks: InfiniBand, 63 ring steps of 10 us per launch; every bucket's share is printed.
    assert re.search(r"^auto buckets on 64 ranks over infiniband \(630 us per launch\), saturating at", out, re.M)
    assert re.search(r"^  blocks\.1.* MiB  latency +\d+\.\d%  (end|block boundary|cap|saturated)$", out, re.M), out


@pytest.mark.slow
def test_cli_with_sharding_auto_prints_and_writes_the_choice(tmp_path, capsys):
    argv = ["--model", "tiny-gpt", "--n-layer", "2", "--world-size", "8", "--bucketing", "block", "--out", str(tmp_path)]
    assert main([*argv, "--sharding", "auto", "--memory-budget", "1TiB"]) == 0
    out = capsys.readouterr().out
    choice = json.loads((tmp_path / "report.json").read_text())["unsharding"]
    # A budget no step reaches keeps every unit: ZeRO2's schedule, and its peak is the choice's.
    assert choice["budget_bytes"] == 1 << 40 and choice["kept"] == choice["candidates"] and len(choice["kept"]) > 2
    assert choice["peak_bytes"] == choice["zero2_peak_bytes"] > choice["zero3_peak_bytes"]
    kept = len(choice["kept"])
    assert re.search(rf"^sharding auto: kept {kept} of {kept} units unsharded to the backward", out, re.M), out


@pytest.mark.slow
def test_cli_with_a_budget_nothing_fits_says_so_in_one_line(tmp_path, capsys):
    argv = ["--model", "tiny-gpt", "--n-layer", "2", "--world-size", "8", "--out", str(tmp_path)]
    assert main([*argv, "--sharding", "auto", "--memory-budget", "1KiB"]) == 1
    err = capsys.readouterr().err
    assert re.search(r"^error: thunder_overlap sharding .auto.: memory_budget_bytes=1024 \(0\.0 MiB\) is below the predicted", err, re.M)
    assert "Traceback" not in err and not (tmp_path / "report.json").exists()


@pytest.mark.slow
def test_cli_with_mixed_precision_gathers_half_the_bytes_and_says_so(tmp_path, capsys):
    def run(*precision: str) -> tuple[str, dict]:
        out_dir = tmp_path / "-".join(precision)
        # One block: the bytes each collective moves halve or not whatever the depth.
        argv = ["--model", "tiny-gpt", "--n-layer", "1", "--world-size", "8", "--bucketing", "block", "--out", str(out_dir)]
        assert main([*argv, *precision]) == 0
        return capsys.readouterr().out, json.loads((out_dir / "report.json").read_text())

    def moved(data: dict, kind: str) -> int:
        passes = data["passes"].values()
        return sum(c["bytes"] for p in passes for c in p[OVERLAP]["collective_timings"] if c["kind"] == kind)

    mixed_out, mixed = run("--param-dtype", "bf16", "--reduce-dtype", "fp32")
    fp32_out, fp32 = run("--dtype", "fp32")
    assert "thunder_overlap collectives move: all-gathers bfloat16, reduce-scatters float32" in mixed_out
    assert "thunder_overlap collectives move: all-gathers float32, reduce-scatters float32" in fp32_out
    assert mixed["collective_dtypes"] == {"all_gather": ["bfloat16"], "reduce_scatter": ["float32"]}
    assert moved(mixed, "all_gather") * 2 == moved(fp32, "all_gather") > 0
    assert moved(mixed, "reduce_scatter") == moved(fp32, "reduce_scatter") > 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "gpt-17"], "unknown model 'gpt-17'"),
        (["--world-size", "0"], "--world-size 0 is impossible"),
        (["--n-layer", "0"], "--n-layer 0 is impossible"),
        (["--sharding", "zero4"], "--sharding must be zero2, zero3 or auto (got 'zero4')"),
        (["--bucketing", "blocks"], "--bucketing must be none, layer, block or auto (got 'blocks')"),
        (["--network", "carrier-pigeon"], "unknown network 'carrier-pigeon'"),
        (["--device-profile", "tpu"], "unknown device profile 'tpu'"),
        (["--model", "tiny-gpt", "--seq-len", "1000"], "--seq-len 1000"),
    ],
)
def test_cli_errors_name_the_bad_value(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv", [[], ["--help"], ["-h"]])
def test_package_help_lists_every_command_and_exits_0(argv, capsys):
    assert package_main(argv) == 0
    out = capsys.readouterr().out
    assert re.search(r"^  demo +\S.*$", out, re.M) and re.search(r"^  report +\S.*$", out, re.M)


def test_package_version_and_unknown_command(capsys):
    assert package_main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"thunder_overlap {thunder_overlap.__version__}"
    assert package_main(["reprot"]) == 2
    assert "unknown command 'reprot'; accepted: demo, report" in capsys.readouterr().err


def _waited(collective: int, kind: str, mib: float, exposed_ms: float) -> CollectiveTiming:
    return CollectiveTiming(collective, kind, 0, int(mib * 2**20), 0.0, 0.0, 1.0, 1.0, exposed_ms, True, 0.0)


def test_longest_waits_are_the_three_longest_in_trace_order():
    launches = [
        _waited(0, "all_gather", 8.0, 4.0),
        _waited(1, "all_gather", 4.0, 0.5),
        _waited(2, "all_gather", 4.0, 0.0),
        _waited(3, "reduce_scatter", 16.0, 1.0),
        _waited(4, "reduce_scatter", 8.0, 2.0),
    ]
    simulation = Simulation(ops=[], collectives=launches, step_ms=20.0, compute_ms=12.5, communication_ms=10.0)
    assert longest_waits("backward", simulation) == (
        f"backward: {OVERLAP}'s compute waits 7.500 ms for collectives, longest at: all-gather launch 1 of 5 (8.0 MiB) 4.000 ms; "
        "reduce-scatter launch 4 of 5 (16.0 MiB) 1.000 ms; reduce-scatter launch 5 of 5 (8.0 MiB) 2.000 ms"
    )
    hidden = Simulation(ops=[], collectives=[_waited(0, "all_gather", 8.0, 0.0)], step_ms=5.0, compute_ms=5.0, communication_ms=1.0)
    assert longest_waits("forward", hidden) == f"forward: {OVERLAP}'s compute never waits for a collective"


def test_speed_change_is_a_ratio_and_a_share_of_time():
    assert speed_change(1.52, 1.0) == "1.52x faster (34% less time)"
    assert speed_change(1.0, 1.1) == "1.10x slower (10% more time)"
    assert speed_change(2.0, 2.0) == "the same time"


class _Group:
    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


@pytest.mark.parametrize(
    ("device", "backend", "size", "expected"),
    [
        ("cpu", "gloo", 2, ("cpu", "gloo-loopback", "the model's parameters are on cpu and its process group is gloo")),
        ("meta", "nccl", 8, ("h100", "nvlink", "with 8 ranks, which fits in one node of 8 GPUs")),
        ("meta", "nccl", 16, ("h100", "infiniband", "with 16 ranks, which spans nodes of 8 GPUs")),
    ],
)
def test_profile_follows_the_model_device_and_process_group(device, backend, size, expected, monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(device_choice.dist, "get_backend", lambda group: backend)
    model = torch.nn.Linear(2, 2, device=device)
    traces = [SimpleNamespace(process_group=_Group(size))]  # annotated traces of that group
    choice = device_choice.choose_profile(model, traces)
    assert (choice.device_profile, choice.network) == expected[:2]
    assert expected[2] in choice.reason
    given = device_choice.choose_profile(model, traces, device_profile="a100", network="custom:5:1")
    assert (given.device_profile, given.network) == ("a100", "custom:5:1")


# ---------------------------------------------------------------------------------------------

MODEL = TinyGPTConfig(n_layer=2, n_embd=32)


@pytest.fixture(scope="module")
def jitted():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    torch.manual_seed(0)
    # Separate launches: these tests judge overlap, and at 8 ranks over loopback gloo latency
    # dominates this tiny model, so the default would coalesce most all-gathers into an exposed
    # launch (faster by the cost model, less overlapped; see test_coalescing_trades_overlap_for_latency).
    jm = thunder_overlap.fsdp(TinyGPT(MODEL), device="cpu", sharding_strategy="zero3", config=OverlapConfig(_tuning=Tuning(coalesce=False)))
    jm(torch.randint(0, MODEL.vocab_size, (2, 16))).sum().backward()
    dist.destroy_process_group()  # report() reads the traces only; the CLI tests need no group alive
    yield jm


@pytest.fixture(scope="module")
def reported(jitted):
    """``jitted``'s report on a slow network (1 GB/s, so that communication matters at this
    size), with no baseline given: the report traces Thunder's own FSDP of the same model."""
    return report(jitted, device_profile="h100", network="custom:5:1")


@pytest.fixture(scope="module")
def thunder_fsdp(reported) -> ThunderFSDPTraces:
    """Thunder's own FSDP traces of the same model, as the report traced them, for the tests
    that pass them (tracing them takes as long as compiling the model)."""
    return ThunderFSDPTraces(reported["forward"].baseline.trace, reported["backward"].baseline.trace, reported.world_size, "zero3")


@pytest.mark.slow
def test_coalescing_trades_overlap_for_latency(jitted, thunder_fsdp):
    from thunder_overlap.report._policies import compare_policies

    cost_model = CostModel.named("cpu", "gloo-loopback")
    separate = compare_policies(
        jitted, cost_model=cost_model, config=OverlapConfig(_tuning=Tuning(coalesce=False)), policies=("greedy",), thunder_fsdp=thunder_fsdp
    )
    coalesced = compare_policies(jitted, cost_model=cost_model, policies=("greedy",), thunder_fsdp=thunder_fsdp)
    for pass_name in ("forward", "backward"):
        one_by_one, together = separate.result("greedy", pass_name), coalesced.result("greedy", pass_name)
        assert one_by_one.summary.coalesced_launches == 0
        assert together.report.collectives == one_by_one.report.collectives
        assert together.report.predicted_ms <= one_by_one.report.predicted_ms + 1e-9
    forward = coalesced.result("greedy", "forward")
    assert forward.summary.coalesced_launches >= 1
    assert forward.report.communication_ms < separate.result("greedy", "forward").report.communication_ms
    # Without the baseline: the same rows less Thunder's own FSDP's, for the same ranks.
    alone = compare_policies(jitted, cost_model=cost_model, policies=("greedy",), baseline=False)
    assert [(r.policy, r.pass_name, r.report.predicted_ms) for r in alone.results] == [
        (r.policy, r.pass_name, r.report.predicted_ms) for r in coalesced.results if r.policy != BASELINE
    ]
    assert alone.world_size == coalesced.world_size == 8
    with pytest.raises(ValueError, match="thunder_fsdp= with baseline=False"):
        compare_policies(jitted, cost_model=cost_model, baseline=False, thunder_fsdp=thunder_fsdp)


@pytest.mark.slow
def test_report_compares_thunder_fsdp_with_thunder_overlap(reported):
    result = reported
    assert result.world_size == 8
    for p in result.passes:
        # thunder_overlap's traces before and after scheduling: the same work in another order.
        assert p.unscheduled.collectives == p.overlap.collectives > 0
        assert p.overlap.predicted_ms <= p.unscheduled.predicted_ms + 1e-9
        assert p.overlap.hidden >= p.unscheduled.hidden
        assert p.overlap.compute_ms == pytest.approx(p.unscheduled.compute_ms)
        # Communication differs only by latency saved where like collectives go out together:
        # at most 7 ring steps of 5 us (custom:5:1 on 8 ranks) per collective.
        latency_ms = 7 * 5e-3 * len(p.overlap.annotated.collectives)
        assert abs(p.overlap.communication_ms - p.unscheduled.communication_ms) <= latency_ms
        assert p.overlap.predicted_ms >= p.overlap.bound_ms - 1e-9
        assert p.overlap.exposed_ms == pytest.approx(p.overlap.predicted_ms - p.overlap.compute_ms)
    # The baseline is Thunder's own FSDP: every forward all-gather is issued before any compute,
    # one per parameter, and its ZeRO3 backward gathers nothing (it kept the unsharded
    # parameters), where thunder_overlap's re-gathers every parameter.
    forward, backward = result["forward"], result["backward"]
    baseline = forward.baseline.annotated
    first_compute = next(n.index for n in baseline.nodes if n.kind is NodeKind.COMPUTE)
    assert all(c.start < first_compute for c in baseline.collectives)
    assert forward.baseline.collectives == forward.overlap.collectives
    assert {c.kind.value for c in backward.baseline.annotated.collectives} == {"reduce_scatter"}
    assert "all_gather" in {c.kind.value for c in backward.overlap.annotated.collectives}
    text = str(result)
    assert "forward   thunder 0.2.6 " in text and "backward  unscheduled " in text and "backward  thunder_overlap" in text
    assert "hides" in text and text.endswith(LEGEND)
    # Each pass names where its compute waits longest (the line's content:
    # test_longest_waits_are_the_three_longest_in_trace_order); on 1 GB/s this tiny model's
    # compute cannot hide everything.
    for p in result.passes:
        assert p.overlap.exposed_ms > 0
        assert longest_waits(p.name, p.overlap.simulation) in text.splitlines()
    assert re.search(
        r"thunder 0\.2\.6 [0-9.]+ ms, unscheduled [0-9.]+ ms, thunder_overlap [0-9.]+ ms: thunder_overlap against "
        r"thunder 0\.2\.6: \d+\.\d\dx (faster \(\d+% less|slower \(\d+% more) time\)",
        text,
    )


@pytest.mark.slow
def test_report_of_a_cpu_model_simulates_its_device_and_says_why(thunder_fsdp):
    # The process group must be alive for report() to read its backend, so this test traces
    # its own model instead of the module's (whose group is gone before the tests run); Thunder's
    # FSDP of the same model is the module's.
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        torch.manual_seed(0)
        jm = thunder_overlap.fsdp(TinyGPT(MODEL), device="cpu", sharding_strategy="zero3")
        jm(torch.randint(0, MODEL.vocab_size, (2, 16))).sum().backward()
        result = report(jm, thunder_fsdp=thunder_fsdp)  # TinyGPT on cpu, fake process group of 8 ranks
    finally:
        dist.destroy_process_group()
    assert (result.device, result.network) == ("cpu", "gloo-loopback")
    assert str(result).startswith(
        "world size 8, device cpu, network gloo-loopback (the model's parameters are on cpu and its process group is fake)"
    )
    explicit = report(jm, device_profile="h100", network="custom:5:1", thunder_fsdp=thunder_fsdp)
    assert (explicit.device, explicit.network) == ("h100", "custom:5:1")


@pytest.mark.slow
def test_one_definition_of_hidden_thunder_forward_hides_almost_nothing(jitted, thunder_fsdp):
    # 8 ranks on a link of 5 us per ring step: Thunder issues every all-gather before any compute,
    # so they queue behind each other while the rank stands at their waits; only the last few in
    # the queue run beside compute. thunder_overlap prefetches each behind the compute before its
    # first use. The old rule (any op between issue and wait) called all of Thunder's overlapped.
    cost_model = CostModel.named("cpu", "custom:5:1")
    forward = report(jitted, cost_model=cost_model, thunder_fsdp=thunder_fsdp)["forward"]
    thunder_stats = schedule_stats(forward.baseline.trace, cost_model)
    overlap_stats = schedule_stats(forward.overlap.trace, cost_model)
    assert thunder_stats.allgathers == 28
    assert thunder_stats.allgathers_overlapped == forward.baseline.hidden <= 28 // 4
    assert overlap_stats.allgathers_overlapped == forward.overlap.hidden
    assert overlap_stats.allgather_overlap_fraction >= 0.9
    # On loopback gloo (350 us of latency per launch) communication outlasts this model's compute:
    # every launch pays its latency, so no order hides an all-gather, and none is said to.
    loopback = CostModel.named("cpu", "gloo-loopback")
    assert schedule_stats(forward.baseline.trace, loopback).allgathers_overlapped == 0
    assert schedule_stats(forward.overlap.trace, loopback).allgathers_overlapped == 0
    # With no cost model given, schedule_stats judges a cpu trace by the loopback profile (Thunder's
    # baseline is traced on the meta device, so ask thunder_overlap's cpu trace).
    assert schedule_stats(forward.unscheduled.trace) == schedule_stats(forward.unscheduled.trace, loopback)


@pytest.mark.slow
def test_report_exports(jitted, thunder_fsdp, tmp_path):
    result = report(jitted, thunder_fsdp=thunder_fsdp)
    data = result.to_json(tmp_path / "r.json")
    assert json.loads((tmp_path / "r.json").read_text()) == json.loads(json.dumps(data))
    assert set(data["passes"]) == {"forward", "backward"}
    result.to_chrome_trace(tmp_path / "t.json")
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert {e["ph"] for e in events} >= {"X", "C", "M"}
    assert {e["tid"] for e in events if e["ph"] == "X"} == {0, 1}  # compute and one comm stream
    processes = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert processes == {f"{order} order" for order in (BASELINE, UNSCHEDULED, OVERLAP)}
    table = result["backward"].step_table(max_rows=40)
    assert "issue RS" in table or "issue AG" in table
    assert len(table.splitlines()) == 42  # header, 40 rows, "... more steps"


@pytest.mark.slow
def test_policy_comparison_puts_every_policy_side_by_side(jitted, thunder_fsdp):
    from thunder_overlap._analysis.cost_model import CostModel
    from thunder_overlap.config import OverlapConfig
    from thunder_overlap.report._policies import COMPARED_POLICIES, POLICY_LEGEND, compare_policies

    cost_model = CostModel.named("h100", "custom:5:1")
    # A budget with no slack at all: memory_aware may not exceed the just-in-time peak. Separate
    # launches, as this compares overlap (coalescing: test_coalescing_trades_overlap_for_latency).
    tight = OverlapConfig(memory_slack_bytes=0, memory_slack_ratio=0.0, _tuning=Tuning(coalesce=False))
    comparison = compare_policies(jitted, cost_model=cost_model, config=tight, thunder_fsdp=thunder_fsdp)
    for pass_name in ("forward", "backward"):
        rows = {p: comparison.result(p, pass_name) for p in COMPARED_POLICIES}
        jit = rows["just_in_time"]
        assert rows["memory_aware"].summary.budget_bytes == rows["memory_aware"].summary.baseline_peak_bytes
        assert rows["memory_aware"].summary.peak_bytes <= rows["memory_aware"].summary.budget_bytes
        # Overlap buys time: every overlapping policy hides more than the just-in-time order.
        for policy in ("heuristic", "greedy", "memory_aware"):
            assert rows[policy].report.hidden >= jit.report.hidden
            assert rows[policy].report.predicted_ms <= jit.report.predicted_ms + 1e-9
    backward = {p: comparison.result(p, "backward").report for p in (BASELINE, *COMPARED_POLICIES)}
    # Thunder's own FSDP is the first row of each pass; its ZeRO3 backward gathers nothing.
    assert [r.policy for r in comparison.results][:2] == [BASELINE, "stock"]
    assert {c.kind.value for c in backward[BASELINE].annotated.collectives} == {"reduce_scatter"}
    assert backward["stock"].collectives > backward[BASELINE].collectives
    assert backward["greedy"].peak_bytes > backward["just_in_time"].peak_bytes
    assert backward["memory_aware"].hidden > backward["just_in_time"].hidden
    text = str(comparison)
    assert all(p in text for p in COMPARED_POLICIES) and "vs JIT" in text
    assert re.search(r"^  memory_aware against thunder 0\.2\.6: \d+\.\d\dx (faster|slower)", text, re.M)
    assert text.endswith(f"{POLICY_LEGEND}\n{LEGEND}")


@pytest.mark.slow
def test_policy_comparison_reports_the_compiled_policy_from_the_traces_that_run(jitted, thunder_fsdp):
    import thunder

    from thunder_overlap.report._policies import compare_policies

    # Scheduled anew, the compiled policy could differ from what runs (a backward's bucket paths
    # and agreed order come from the compile): its rows are the module's own final traces.
    compiled = thunder_overlap.OverlapScheduleTransform.of(jitted).config
    cost_model = CostModel.named("cpu", "gloo-loopback")
    comparison = compare_policies(jitted, cost_model=cost_model, config=compiled, thunder_fsdp=thunder_fsdp)
    runs = {"forward": thunder.last_traces(jitted)[-1], "backward": thunder.last_backward_traces(jitted)[-1]}
    for pass_name, trace in runs.items():
        assert comparison.result(compiled.policy.value, pass_name).report.annotated.trace is trace
        assert comparison.result("greedy", pass_name).report.annotated.trace is not trace


@pytest.mark.slow
def test_baseline_is_thunder_fsdp_per_parameter_even_with_block_buckets():
    # Thunder 0.2.6 stores its bucketing strategy and never reads it: the baseline has one
    # all-gather per parameter where thunder_overlap's traces have one per bucket, and no bucket
    # operator (so none of their copies).
    with torch.device("meta"):
        model = TinyGPT(MODEL)
    cost_model = CostModel.named("h100", "nvlink")
    jm = trace_model(model, world_size=8, sharding="zero3", bucketing="block", idx_shape=(2, 16))
    result = report(jm, cost_model=cost_model)
    forward, backward = result["forward"], result["backward"]
    assert forward.baseline.order == "thunder 0.2.6" and forward.unscheduled.order == "unscheduled"
    assert forward.baseline.collectives == 28 > forward.unscheduled.collectives == forward.overlap.collectives
    assert {c.kind.value for c in backward.baseline.annotated.collectives} == {"reduce_scatter"}
    assert "all_gather" in {c.kind.value for c in backward.unscheduled.annotated.collectives}
    for p in result.passes:
        assert not any(n.name.startswith("bucket_") for n in p.baseline.annotated.nodes)
        assert any(n.name.startswith("bucket_") for n in p.overlap.annotated.nodes)
    # The buckets' copies are compute-stream work of thunder_overlap's traces.
    copies = [cost_model.local_copy_ms(n.bsym, p.overlap.annotated.layouts) for p in result.passes for n in p.overlap.annotated.nodes]
    assert sum(copies) > 0
