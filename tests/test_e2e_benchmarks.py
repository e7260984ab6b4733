"""Smoke test of benchmarks/benchmark_fsdp.py: 2 gloo ranks under torchrun, tiny model, 2
iterations; plus the testbed's arithmetic, the benchmark's option checks (no processes) and its
CPU peak's held bytes (on the fake group)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import thunder_overlap
from thunder_overlap.report._builtin_models import TinyGPT, TinyGPTConfig

# fsdp_bench is importable through pytest's pythonpath (pyproject.toml), as the scripts import
# it from their own directory.
from fsdp_bench.bench_config import BenchmarkConfig, parse_args
from fsdp_bench.bench_models import build_model
from fsdp_bench.cuda_peak import LiveGroup, step_peak
from fsdp_bench.peak_memory import persistent_bytes
from fsdp_bench.testbed_summary import SlowLinkCalibration, calibrate, format_table, summarize, target_checks

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"

# Compile + 2 iterations of the tiny model take 15-25 s per run alone on a 2-core machine, but
# 75-180 s inside make test: beside the other worker's ranks, each of the run's many small
# collectives waits until both of its ranks get a time slice. The limit only guards against a hang.
RUN_TIMEOUT_S = 600
# Transformer blocks by implementation. One where the run compiles: the smoke runs check the
# JSON's fields, which a second block (a longer compile) changes nothing about. One block is no
# stack of blocks, so thunder_overlap's run buckets by layer, which still gives several buckets and
# collectives each way. FSDP2 wraps the repeated blocks, so two.
N_LAYERS = {"thunder_overlap": 1, "compute_with_comm": 1, "fsdp2": 2}


def _run_benchmark(tmp_path: Path, impl: str, shard_mode: str, bucketing_mode: str = "none", *extra: str) -> dict:
    json_path = tmp_path / f"{impl}.json"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        str(BENCHMARKS / "benchmark_fsdp.py"),
        "--device", "cpu", "--model_name", "tiny-gpt", "--impl", impl, "--shard_mode", shard_mode,
        "--bucketing_mode", bucketing_mode,
        "--n_layers", str(N_LAYERS[impl]), "--max_iters", "2", "--warmup_iters", "1",
        "--json_path", str(json_path), "--dump_traces", *extra,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "iter 0: loss" in proc.stdout and "iter 1: loss" in proc.stdout, "no progress line per iteration"
    return json.loads(json_path.read_text())


@pytest.mark.ranks
@pytest.mark.parametrize("impl", ["thunder_overlap", "fsdp2", "compute_with_comm"])
def test_benchmark_writes_sane_json(tmp_path, impl):
    bucketing_mode = "layer" if impl == "thunder_overlap" else "none"
    # The training runs clip by the global norm, each its own way (thunder_overlap's over shards,
    # FSDP2's over DTensors).
    clip = () if impl == "compute_with_comm" else ("--max_norm", "1.0")
    result = _run_benchmark(tmp_path, impl, "zero3", bucketing_mode, *clip)
    assert (result["impl"], result["world_size"], result["device"], result["shard_mode"]) == (impl, 2, "cpu", "zero3")
    assert (result["model_name"], result["n_layers"]) == ("tiny-gpt", N_LAYERS[impl])
    assert result["max_norm"] == (1.0 if clip else None)
    assert len(result["iter_times_ms"]) == 1 and 0 < result["median_iter_time_ms"] < RUN_TIMEOUT_S * 1e3
    tokens = 2 * result["micro_batch_size"] * result["block_size"]
    assert result["tokens_per_sec"] == pytest.approx(tokens / (result["average_iter_time_ms"] / 1e3))
    assert result["model_flops_per_rank_step"] > 0 and result["model_tflop_per_sec"] > 0
    # At least the sharded parameters and the optimizer's two moments of them are held (float32).
    trained = sum(p.numel() for p in build_model("tiny-gpt", N_LAYERS[impl])[0].parameters() if p.requires_grad)
    assert trained > 50_000 and result["peak_memory_bytes"] > 3 * 4 * trained / 2
    assert math.isfinite(result["final_loss"]) and result["final_loss"] > 0
    if impl == "compute_with_comm":
        # The compute is the unsharded model (the collectives are replayed beside it), and its
        # optimizer is timed so that the testbed can take out the full-model surplus.
        assert result["schedule"]["forward"]["allgathers"] == 0
        assert len(result["optimizer_times_ms"]) == 1
    elif impl == "thunder_overlap":
        backward = result["schedule"]["backward"]
        assert backward["allgathers"] > 0, "ZeRO3 re-gathers parameters in backward"
        assert backward["reduce_scatters"] > 0
        assert (tmp_path / "thunder_overlap.backward_trace.py").read_text().startswith("#")
        # The pool the steps grew is the one planned from the final traces.
        assert len(result["bucket_pool_bytes"]) >= 2 and min(result["bucket_pool_bytes"]) > 0
        assert result["bucket_pool_bytes"] == result["bucket_pool_plan_bytes"]
    else:
        assert result["schedule"] == {}
    if impl != "thunder_overlap":
        assert result["bucket_pool_bytes"] == result["bucket_pool_plan_bytes"] == []


def _tokens(step: int, rank: int, config: TinyGPTConfig) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, config.vocab_size, (2, config.block_size + 1), generator=torch.Generator().manual_seed(10 * step + rank))
    return tokens[:, :-1], tokens[:, 1:]


HAND_LOOP_MODEL = TinyGPTConfig(n_embd=16, n_head=2, n_layer=2, block_size=8)
HAND_LOOP_STEPS = 2


def _hand_loop_parameters(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    from fsdp_bench.bench_models import loss_fn
    from fsdp_bench.hand_loop import HandPrefetchZero2

    torch.manual_seed(0)
    model = TinyGPT(HAND_LOOP_MODEL).double()
    hand = HandPrefetchZero2(model)
    optimizer = torch.optim.SGD(hand.parameters(), lr=0.5)
    for step in range(HAND_LOOP_STEPS):
        idx, targets = _tokens(step, rank, HAND_LOOP_MODEL)
        loss_fn(hand(idx), targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    hand(_tokens(0, rank, HAND_LOOP_MODEL)[0])  # gathers the stepped shards into the model's parameters
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.ranks
def test_hand_prefetch_loop_trains_as_one_process_averaging_the_ranks_gradients(local_ranks):
    """The benchmark's hand-written ZeRO2 baseline computes what it claims to: its parameters after
    two SGD steps equal one process's, stepped on the mean of the ranks' losses (float64: the
    two only sum in another order)."""
    from fsdp_bench.bench_models import loss_fn

    per_rank = local_ranks(_hand_loop_parameters, 2)
    torch.manual_seed(0)
    reference = TinyGPT(HAND_LOOP_MODEL).double()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    for step in range(HAND_LOOP_STEPS):
        batches = [_tokens(step, rank, HAND_LOOP_MODEL) for rank in range(2)]
        (sum(loss_fn(reference(idx), targets) for idx, targets in batches) / 2).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    expected = dict(reference.named_parameters())
    for parameters in per_rank:
        assert parameters.keys() == expected.keys()
        for name, value in parameters.items():
            torch.testing.assert_close(value, expected[name].detach(), rtol=1e-12, atol=1e-12, msg=name)


def test_bad_options_name_the_value_and_the_accepted_ones():
    accepted = (
        "thunder_overlap, thunder_overlap_uncoalesced, thunder_overlap_two_ahead, thunder_overlap_own_shards, "
        "thunder_overlap_laid_out, thunder_overlap_two_lay_outs, thunder_overlap_regather_all, thunder, fsdp2"
    )
    with pytest.raises(ValueError, match=rf"--impl='deepspeed'.*{accepted}"):
        BenchmarkConfig(impl="deepspeed")
    with pytest.raises(ValueError, match=r"unknown network 'slow'.*custom:<latency_us>"):
        BenchmarkConfig(network="slow")
    with pytest.raises(ValueError, match=r"--warmup_iters=5 must be in \[0, --max_iters=5\)"):
        BenchmarkConfig(max_iters=5, warmup_iters=5)
    with pytest.raises(ValueError, match=r"--cuda_peak_json .*needs --device cuda or auto, not cpu"):
        BenchmarkConfig(device="cpu", cuda_peak_json="peak.json")
    with pytest.raises(SystemExit):
        parse_args(["--shard_mode", "zero1"])
    with pytest.raises(ValueError, match=r"--impl hand_prefetch is a ZeRO2 loop; --shard_mode=zero3 is not wired, use zero2"):
        BenchmarkConfig(impl="hand_prefetch", shard_mode="zero3")
    with pytest.raises(ValueError, match=r"--max_norm: --impl hand_prefetch's gradients are flat shards, whose norm is local"):
        BenchmarkConfig(impl="hand_prefetch", max_norm=1.0)
    with pytest.raises(ValueError, match=r"--impl thunder_overlap_regather_all changes ZeRO3's backward; --shard_mode=zero2 has none"):
        BenchmarkConfig(impl="thunder_overlap_regather_all", shard_mode="zero2")
    assert parse_args(["--impl", "fsdp2", "--n_layers", "3"]) == BenchmarkConfig(impl="fsdp2", n_layers=3)


def test_benchmark_schedules_thunder_overlap_for_the_named_link():
    from fsdp_bench.impls import overlap_config

    config = overlap_config(BenchmarkConfig(network="custom:1000:0.05"), torch.device("cpu"), "thunder_overlap_uncoalesced")
    assert (config.cost_model.network.latency_s, config.cost_model.network.bus_bandwidth) == (1e-3, 0.05e9)
    assert config.cost_model.device.name == "cpu" and not config.tuning.coalesce
    assert overlap_config(BenchmarkConfig(), torch.device("cpu"), "thunder_overlap_two_ahead").tuning.bucket_eager_prefetch_blocks is None
    assert not overlap_config(BenchmarkConfig(), torch.device("cpu"), "thunder_overlap_own_shards").reduce_in_pool
    laid_out = overlap_config(BenchmarkConfig(), torch.device("cpu"), "thunder_overlap_laid_out")
    assert laid_out.tuning.per_tensor_gather_max_slowdown is None and laid_out.tuning.reduce_from_copy_max_slowdown is None
    two_lay_outs = overlap_config(BenchmarkConfig(), torch.device("cpu"), "thunder_overlap_two_lay_outs")
    assert two_lay_outs.tuning.bucket_reduce_scatter_blocks is None
    assert overlap_config(BenchmarkConfig(), torch.device("cpu")).tuning.zero3_keeps_free_units
    assert not overlap_config(BenchmarkConfig(), torch.device("cpu"), "thunder_overlap_regather_all").tuning.zero3_keeps_free_units
    assert overlap_config(BenchmarkConfig(), torch.device("cpu")).cost_model is None
    # The testbed names its link to every run that traces thunder_overlap, and to no other.
    from slow_link import TestbedConfig

    testbed = TestbedConfig(rate_mbit=400, link_latency_us=1000)
    labels = ("thunder", "compute_only", "comm_only@auto", "thunder_overlap_uncoalesced@none", "thunder_overlap_two_ahead@block")
    named = {label: "--network" in testbed.benchmark_args(label, Path("run.json")) for label in labels}
    assert named == {
        "thunder": False,
        "compute_only": False,
        "comm_only@auto": True,
        "thunder_overlap_uncoalesced@none": True,
        "thunder_overlap_two_ahead@block": True,
    }
    assert testbed.network == "custom:1000:0.05:ring:2"  # gloo runs two launches at once
    with pytest.raises(ValueError, match=r"--link-latency-us=-1.0 .*accepted are a latency >= 0"):
        TestbedConfig(link_latency_us=-1.0)


def test_mixed_precision_runs_are_named_and_refused_where_they_cannot_run():
    from slow_link import TestbedConfig, split_label

    with pytest.raises(ValueError, match=r"--mixed_precision: Thunder's own FSDP has no mixed precision"):
        BenchmarkConfig(impl="thunder", mixed_precision="bf16/fp32")
    with pytest.raises(ValueError, match=r"--mixed_precision='fp8'.*accepted: bf16/fp32"):
        BenchmarkConfig(mixed_precision="fp8")
    testbed = TestbedConfig(impls=("thunder_overlap@block", "thunder_overlap@block:bf16", "fsdp2:bf16"))
    args = {label: testbed.benchmark_args(label, Path("run.json")) for label in testbed.impls}
    assert [a[a.index("--mixed_precision") + 1] if "--mixed_precision" in a else None for a in args.values()] == [
        None,
        "bf16/fp32",
        "bf16/fp32",
    ]
    assert split_label("thunder_overlap@block:bf16") == ("thunder_overlap", "block")
    assert testbed.bucketings == ("none", "block")
    for label in ("thunder:bf16", "fsdp2:fp8"):
        with pytest.raises(ValueError, match=r":bf16 for mixed precision, :clip for clipping .* or :ckpt .*\(not thunder\)"):
            TestbedConfig(impls=(label,))


def test_hand_loop_runs_are_zero2_only_and_each_zero2_run_is_compared_with_them_round_by_round():
    from slow_link import TestbedConfig, hand_loop_checks

    assert TestbedConfig(impls=("thunder_overlap@block", "hand_prefetch@block"), shard_mode="zero2").bucketings == ("none", "block")
    for label, shard_mode in (("hand_prefetch@block", "zero3"), ("hand_prefetch@block:bf16", "zero2")):
        with pytest.raises(ValueError, match=r"hand_prefetch is ZeRO2 with no suffix"):
            TestbedConfig(impls=(label,), shard_mode=shard_mode)

    def rounds(shard_mode: str, *medians: float) -> list[dict]:
        return [{"iter_times_ms": [m - 1, m, m + 5], "shard_mode": shard_mode} for m in medians]

    runs = {
        "thunder_overlap@block": rounds("zero2", 90.0, 120.0, 100.0),
        "thunder_overlap@block/zero3": rounds("zero3", 300.0, 300.0, 300.0),
        "hand_prefetch@block": rounds("zero2", 100.0, 100.0, 80.0),
    }
    # Ratios 0.9, 1.2, 1.25: the median of the rounds' ratios, not the ratio of the medians (1.2 / 1.0).
    assert hand_loop_checks(runs) == [
        "FAIL thunder_overlap@block takes 1.200x hand_prefetch@block's step (median of 3 rounds' ratios: 0.900, 1.200, 1.250; <= 1.0)"
    ]
    runs["thunder_overlap@block"] = rounds("zero2", 90.0, 95.0, 100.0)
    assert hand_loop_checks(runs)[0].startswith("PASS thunder_overlap@block takes 0.950x")
    assert hand_loop_checks({"thunder_overlap@block": runs["thunder_overlap@block"]}) == []


def test_exposure_is_simulated_with_the_calibration_the_testbed_measured():
    from testbed_exposure import setting_of_run

    run_dir = BENCHMARKS / "measured" / "slow_link" / "grad_clip"
    block = json.loads((run_dir / "summary.json").read_text())["calibration_by_bucketing"]["block"]
    setting = setting_of_run(run_dir, "thunder_overlap@block", "layer")
    assert (setting.compute_ms, setting.comm_ms, setting.concurrent_ms) == (block["compute_ms"], block["comm_ms"], block["concurrent_ms"])
    assert setting.bucketing == "layer" and setting.comm_ms_by_bucketing.keys() == {"none", "block"}
    assert (setting.impl, setting.shard_mode, setting.n_layers) == ("thunder_overlap", "zero3", 4)
    assert setting.network == "custom:1000:0.05:ring:2"
    with pytest.raises(ValueError, match=r"--impl .thunder_overlap@auto.: .*grad_clip measured thunder_overlap@block, "):
        setting_of_run(run_dir, "thunder_overlap@auto", "auto")
    with pytest.raises(ValueError, match=r"--bucketings: 'blocks' is not a bucketing strategy; accepted: none, layer, block, auto"):
        setting_of_run(run_dir, "thunder_overlap@block", "blocks")


def test_clipped_runs_are_named_refused_where_they_cannot_run_and_compared_with_their_unclipped_run():
    from slow_link import CLIP_MAX_NORM, TestbedConfig, clipping_checks

    for impl in ("thunder", "comm_only"):
        with pytest.raises(ValueError, match=rf"--max_norm: --impl {impl} has no gradient to clip by its global norm"):
            BenchmarkConfig(impl=impl, max_norm=1.0)
    with pytest.raises(ValueError, match=r"--max_norm must be a positive number, got 0\.0"):
        BenchmarkConfig(max_norm=0.0)
    assert parse_args(["--max_norm", "0.5"]).max_norm == 0.5
    testbed = TestbedConfig(impls=("thunder_overlap@block", "thunder_overlap@block:clip", "fsdp2:clip"))
    args = [testbed.benchmark_args(label, Path("run.json")) for label in testbed.impls]
    assert [a[a.index("--max_norm") + 1] if "--max_norm" in a else None for a in args] == [None, str(CLIP_MAX_NORM), str(CLIP_MAX_NORM)]
    with pytest.raises(ValueError, match=r":clip for clipping by the global norm or :ckpt .*\(not thunder\)"):
        TestbedConfig(impls=("thunder:clip",))

    def rounds(*medians: float) -> list[dict]:
        return [{"iter_times_ms": [m - 1, m, m + 5]} for m in medians]

    # Round by round: +1 and +2 ms against round medians 100 and 110 (10 ms apart).
    within = clipping_checks({"a": rounds(100, 110), "a:clip": rounds(101, 112), "b": rounds(100, 101)})
    assert within == [
        "PASS a:clip adds +1.5 ms (+1.4%) to 105.0 ms (median of 2 rounds' differences), within the noise: "
        "the unclipped run's round medians spread 10.0 ms"
    ]
    assert clipping_checks({"a": rounds(100, 101), "a:clip": rounds(120, 121)})[0].startswith("FAIL a:clip adds +20.0 ms")


def test_checkpointed_runs_are_refused_where_they_cannot_run_and_compared_with_the_recompute():
    from slow_link import TestbedConfig, checkpointing_checks

    for impl in ("thunder", "fsdp2"):
        with pytest.raises(ValueError, match=rf"--activation_checkpointing: not wired for --impl {impl}"):
            BenchmarkConfig(impl=impl, activation_checkpointing=True)
        with pytest.raises(ValueError, match=r":ckpt for activation checkpointing"):
            TestbedConfig(impls=(f"{impl}:ckpt",))
    assert parse_args(["--activation_checkpointing"]).activation_checkpointing
    testbed = TestbedConfig(impls=("thunder_overlap@block", "thunder_overlap@block:ckpt"))
    # The recompute's compute time is measured beside the compute-only calibration run.
    assert testbed.calibration_runs[:2] == ("compute_only", "compute_only:ckpt")
    flags = [testbed.benchmark_args(label, Path("run.json")) for label in (*testbed.impls, "compute_only:ckpt")]
    assert ["--activation_checkpointing" in a for a in flags] == [False, True, True]

    def rounds(*medians: float) -> list[dict]:
        return [{"iter_times_ms": [m - 1, m, m + 5]} for m in medians]

    compute, compute_checkpointed = rounds(100, 110), rounds(130, 138)  # the recompute: 30 and 28 ms
    runs = {"a": rounds(200, 210), "a:ckpt": rounds(225, 236)}
    (line,) = checkpointing_checks(runs, compute, compute_checkpointed)
    assert line.startswith("PASS a:ckpt adds 25.5 ms to a's 205.0 ms") and "is 29.0 ms" in line, line
    runs["a:ckpt"] = rounds(240, 250)
    assert checkpointing_checks(runs, compute, compute_checkpointed)[0].startswith("FAIL a:ckpt adds 40.0 ms")
    assert checkpointing_checks(runs, compute, None) == []


def test_cuda_peak_names_what_was_alive_at_the_step_peak():
    def alloc(addr, size, line):
        return {"action": "alloc", "addr": addr, "size": size, "frames": [{"filename": "x.py", "line": line, "name": "f"}]}

    def free(addr, action="free_requested"):
        return {"action": action, "addr": addr, "size": 0}

    events = [
        alloc(1, 100, 10),
        alloc(2, 50, 20),
        free(1),
        alloc(3, 300, 30),  # the peak: 50 + 300 alive
        free(3),  # memory_allocated falls here, though another stream may still hold the block
        alloc(4, 250, 10),  # 300: below the peak (600 if the free counted only once completed)
        free(3, "free_completed"),
        free(4),
    ]
    peak = step_peak(events, start_bytes=1000)
    assert (peak.start_bytes, peak.peak_over_start_bytes, peak.peak_event, peak.events) == (1000, 350, 3, 8)
    assert peak.peak_allocation == "x.py:30 f"
    assert peak.live_at_peak == [LiveGroup("x.py:30 f", 300, 1), LiveGroup("x.py:20 f", 50, 1)]
    assert step_peak([], start_bytes=7).peak_over_start_bytes == 0


def _run(times_ms: list[float], optimizer_ms: list[float] = (), peak: int = 1) -> dict:
    return {"iter_times_ms": times_ms, "optimizer_times_ms": list(optimizer_ms), "world_size": 2, "peak_memory_bytes": peak}


def test_testbed_bounds_and_gap_closed():
    # compute_only: 110 ms with a 20 ms full-model optimizer, of which an FSDP rank does half.
    calibration = calibrate([_run([110.0], [20.0])], [_run([80.0, 80.0, 500.0])])
    assert (calibration.compute_ms, calibration.comm_ms) == (100.0, 80.0)
    assert (calibration.serial_ms, calibration.ideal_ms) == (180.0, 100.0)
    runs = {"thunder": [_run([180.0]), _run([176.0])], "thunder_overlap": [_run([110.0]), _run([120.0])]}
    summaries = {s.impl: s for s in summarize(runs, {impl: calibration for impl in runs}, {})}
    assert summaries["thunder"].gap_closed == pytest.approx(2 / 80)  # median of rounds: 178 ms
    assert summaries["thunder_overlap"].gap_closed == pytest.approx(65 / 80)
    assert summaries["thunder_overlap"].vs_thunder == pytest.approx(115 / 178)
    checks = target_checks(list(summaries.values()), calibration)
    assert checks[0].startswith("PASS speedup") and checks[1].startswith("PASS step / max(C,M) = 1.150")


def test_testbed_places_runs_against_compute_and_comm_at_once():
    calibration = calibrate([_run([110.0], [20.0])], [_run([80.0])], [_run([130.0, 126.0], [20.0])])
    # The concurrent run steps the full model's optimizer too: 128 - 10 ms.
    assert calibration.concurrent_ms == pytest.approx(118.0)
    runs = {"thunder_overlap": [_run([130.0])]}
    (summary,) = summarize(runs, {"thunder_overlap": calibration}, {})
    assert summary.over_concurrent == pytest.approx(130 / 118) and summary.over_ideal == pytest.approx(1.3)
    assert "C and M at once, no dependencies = 118.0 ms (1.180 x max(C,M))" in format_table([summary], {"none": calibration})


def test_testbed_targets_need_balanced_calibration():
    unbalanced = SlowLinkCalibration(compute_ms=100.0, comm_ms=400.0)
    (line,) = target_checks([], unbalanced)
    assert "4.00x" in line and "--rate-mbit" in line


def _prediction(impl: str, compute_ms: float, comm_ms: float) -> float | None:
    from fsdp_bench.prediction import TestbedSetting, predict_testbed_step_ms

    setting = TestbedSetting(
        impl=impl, shard_mode="zero3", model_name="tiny-gpt", n_layers=0, block_size=0, micro_batch_size=2,
        world_size=2, rate_mbit=400.0, compute_ms=compute_ms, comm_ms=comm_ms, result_json="",
    )
    return predict_testbed_step_ms(setting)


@pytest.mark.slow
def test_calibrated_simulator_places_schedules_between_the_bounds():
    from fsdp_bench.prediction import _annotated, _communication_ms, fit_link

    compute_ms = comm_ms = 1000.0
    overlap = _prediction("thunder_overlap", compute_ms, comm_ms)
    stock = _prediction("thunder", compute_ms, comm_ms)
    # The link is fitted to thunder_overlap's collectives (M). Thunder's ZeRO3 moves fewer bytes
    # (it re-gathers nothing in backward), and overlaps next to nothing: near its serial bound.
    block_size = build_model("tiny-gpt", None, None)[1].block_size
    shape = ("tiny-gpt", 0, block_size, 2, 2, "zero3")
    link = fit_link({"none": (comm_ms, _annotated("thunder_overlap", "none", None, *shape))}).network()
    thunder_comm_ms = _communication_ms(_annotated("thunder", "none", None, *shape), link)
    assert thunder_comm_ms < comm_ms
    assert 0.9 * (compute_ms + thunder_comm_ms) <= stock <= compute_ms + thunder_comm_ms + 1e-6
    # thunder_overlap's schedule closes most of the gap to max(C, M), and cannot beat it.
    assert max(compute_ms, comm_ms) - 1e-6 <= overlap < 0.8 * (compute_ms + comm_ms)
    assert _prediction("fsdp2", compute_ms, comm_ms) is None


@pytest.mark.slow
def test_link_fit_recovers_latency_and_bandwidth_from_two_bucketings():
    from thunder_overlap._analysis.cost_model import NetworkProfile

    from fsdp_bench.prediction import _annotated, _communication_ms, fit_link

    # The model's own depth and sequence (0: the preset's), the shape the test above traced
    # thunder_overlap's per-parameter run at: its traces are cached, and only "block" is traced here.
    shape = ("tiny-gpt", 0, 32, 2, 2, "zero3")
    traces = {b: _annotated("thunder_overlap", b, None, *shape) for b in ("none", "block")}
    for lanes in (1, 2):
        link = NetworkProfile("truth", 2e-3, 5e7, concurrent_launches=lanes)
        measured = {b: _communication_ms(t, link) for b, t in traces.items()}
        # Same bytes, far fewer collectives: only a latency term can tell the two runs apart.
        assert measured["block"] < 0.5 * measured["none"]
        fit = fit_link({b: (measured[b], traces[b]) for b in traces}, concurrent_launches=lanes)
        assert fit.fitted_to == ("block", "none") and fit.network().concurrent_launches == lanes
        assert fit.latency_s == pytest.approx(2e-3, rel=1e-6) and fit.bus_bandwidth == pytest.approx(5e7, rel=1e-6)
    # One run: no latency, the bandwidth alone accounts for that run's M.
    single = fit_link({"none": (measured["none"], traces["none"])})
    assert single.latency_s == 0 and single.fitted_to == ("none",)
    assert _communication_ms(traces["none"], single.network()) == pytest.approx(measured["none"], rel=1e-6)



@pytest.mark.slow
def test_cpu_peak_counts_the_bucket_pool_as_held_and_gradient_shards_only_while_grad_holds_them(fake_group_2):
    # The pool is allocated in the first step and reused after, invisible to the tracker of a
    # later step: the peak must count it as held between steps, or bucketed runs look smaller.
    # Gradient shards are the gradients: allocated in the step (the tracker sees them), given
    # back by zero_grad, never held by the bucket.
    config = TinyGPTConfig(n_layer=2)
    # Gradient shards of their own (reduced in the pool, they would be rows of pool buffers).
    overlap = thunder_overlap.OverlapConfig(reduce_in_pool=False)
    jm = thunder_overlap.fsdp(TinyGPT(config), device="cpu", sharding_strategy="zero3", bucketing_strategy="block", config=overlap)
    jm(torch.randint(0, config.vocab_size, (2, 16))).sum().backward()
    bucketing = thunder_overlap.BucketingTransform.of(jm)
    pool = sum(b.untyped_storage().nbytes() for b in bucketing.pool.buffers)
    shards = set().union(*(b.grad_shard_storages() for b in bucketing.buckets))
    grads = {p.grad.untyped_storage().data_ptr() for p in jm.parameters() if p.grad is not None}
    assert pool > 0 and len(shards) == len(bucketing.buckets) - 1 and shards == grads  # wpe is frozen
    model_bytes = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in [*jm.parameters(), *jm.buffers()]}
    assert persistent_bytes(jm, None) == sum(model_bytes.values()) + pool
    jm.zero_grad(set_to_none=True)
    assert set().union(*(b.grad_shard_storages() for b in bucketing.buckets)) == set()


def test_executors_are_refused_where_they_are_not_wired_and_checked_by_name():
    from fsdp_bench.impls import jit_options

    for impl in ("thunder", "fsdp2", "fsdp2_compile", "comm_only"):
        with pytest.raises(ValueError, match=rf"--executors=torchcompile: wired for thunder_overlap and compute_only, not --impl {impl}"):
            BenchmarkConfig(impl=impl, executors="torchcompile")
    with pytest.raises(ValueError, match=r"--executors='nvfuser' is not supported; accepted: default, torchcompile, thunder_inductor"):
        BenchmarkConfig(executors="nvfuser")
    assert jit_options(parse_args([]).executors) == {}
    assert [e.name for e in jit_options(parse_args(["--executors", "torchcompile"]).executors)["executors"]] == ["torchcompile"]
    inductor = [e.name for e in jit_options("thunder_inductor")["executors"]]
    assert inductor[0] == "torchcompile" and len(inductor) > 1


def test_side_by_side_table_gives_each_run_against_the_baseline_of_its_sharding():
    from ws1_table import side_by_side

    def run(impl: str, shard: str, ms: float, mib: int, executors: str = "default") -> dict:
        return {"impl": impl, "shard_mode": shard, "executors": executors, "bucketing_mode": "none",
                "median_iter_time_ms": ms, "peak_memory_bytes": mib * 2**20}  # fmt: skip

    rows = side_by_side([run("thunder_overlap", "zero2", 66.0, 150, "torchcompile"), run("fsdp2_compile", "zero2", 60.0, 100),
                         run("thunder_overlap", "zero3", 75.0, 90, "torchcompile"), run("fsdp2_compile", "zero3", 50.0, 120)],
                        "fsdp2_compile").splitlines()[2:]  # fmt: skip
    assert rows == [
        "| zero3 | fsdp2_compile | default | none | 50.0 | 120 | 1.000x | 1.000x |",
        "| zero3 | thunder_overlap | torchcompile | none | 75.0 | 90 | 1.500x | 0.750x |",
        "| zero2 | fsdp2_compile | default | none | 60.0 | 100 | 1.000x | 1.000x |",
        "| zero2 | thunder_overlap | torchcompile | none | 66.0 | 150 | 1.100x | 1.500x |",
    ]
