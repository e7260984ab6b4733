"""The slow-link testbed: 2 CPU ranks, real communication over a rate-limited link.

    sudo python benchmarks/slow_link.py --rate-mbit 400 --impls thunder,thunder_overlap \
        --shard-mode zero3 --rounds 5

Each rank runs in its own network namespace, pinned to its own core; the namespaces are joined by
a veth pair whose egress is limited with ``tc htb`` to ``--rate-mbit`` in each direction (see
fsdp_bench/netns.py). Everything created is removed on exit, also on errors, Ctrl-C and SIGTERM.

Every round runs, one after another (A B A B ... to cancel drift), two calibration runs and then
each implementation, each a fresh ``benchmark_fsdp.py`` launch with the same model and data
(``--impls thunder_overlap@none,thunder_overlap@block`` compares bucketing strategies; a ``:bf16``
suffix runs with mixed precision, bf16 gathers and compute over fp32 parameters, fp32 reductions:
``--impls thunder_overlap@block,thunder_overlap@block:bf16,fsdp2:bf16``; a ``:clip`` suffix clips
the gradient by its global norm each step, ``--max_norm 1.0``:
``--impls thunder_overlap@block,thunder_overlap@block:clip``; a ``:ckpt`` suffix checkpoints
every block's activations (and adds a compute-only run that does too, whose difference from C is
the recompute's compute time): ``--impls thunder_overlap@block,thunder_overlap@block:ckpt``; a ``/zero2``, ``/zero3``
or ``/auto`` part runs that sharding instead of ``--shard-mode``, ``/auto`` within
``--memory-budget-bytes``, by default halfway between the predicted ZeRO3 and ZeRO2 peaks:
``--impls thunder_overlap@block/zero3,thunder_overlap@block/zero2,thunder_overlap@block/auto``):

- C, ``--impl compute_only``: every rank runs ``thunder.jit`` of the unsharded model on its own
  micro-batch with no communication at all, i.e. exactly an FSDP rank's forward and backward. Its
  optimizer steps the whole model instead of a 1/world_size shard, so C subtracts that surplus
  using the optimizer time the run reports: C = step - (1 - 1/world_size) * optimizer.
- M, ``--impl comm_only``: thunder_overlap's collectives for this shard mode (ZeRO3: forward
  all-gathers, backward re-gathers and reduce-scatters), replayed in the order and with the
  in-flight pattern of its traces, with no compute. One run per bucketing strategy measured
  (always ``none``); each implementation is placed between the bounds of its own strategy, and
  with two or more strategies the simulator fits the link's per-collective latency as well as
  its bandwidth (fsdp_bench/prediction.py).
- C with M, ``--impl compute_with_comm``: both at once on every rank, the replay on a second
  thread, with no dependencies between them. No schedule can beat it; how far it sits above
  max(C, M) is what communicating takes from computing on this machine (one core per rank).

The calibration runs are float32's: a ``:bf16`` implementation is placed between float32's bounds
and gets no simulator prediction (its compute is not calibrated), only the mixed-precision
targets (against float32 thunder_overlap and against FSDP2 with the same policy). A ``:clip`` run
gets no prediction either (the simulator reads the traces, and clipping runs after them), only
its time against its unclipped run, and the rounds' spread that puts it in or out of the noise.
A ``:ckpt`` run gets no prediction either (C is calibrated without recomputation), only its time
over its run without checkpointing against the recompute's measured compute time. A ``:tc`` run
(Thunder's torchcompile executor) gets none (C is calibrated with Thunder's default executors).
``hand_prefetch@block`` (ZeRO2 only) is a hand-written loop in eager PyTorch
(fsdp_bench/hand_loop.py); it too is placed between Thunder's bounds, though it computes eagerly,
faster than Thunder's default executors on CPU (benchmarks/compute_executors.py): compare its time.

It prints, per implementation, the median step time (median over rounds of each run's median),
its ratio to Thunder's own FSDP, where it lands between the serial bound C + M (gap closed 0%) and
the ideal max(C, M) (100%), the simulator's prediction when connected, and the issue's targets.
Per-run JSONs, logs and summary.json go to ``--out``; benchmarks/plot_results.py plots them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from thunder_overlap._backends import GLOO

from fsdp_bench.bench_config import BUCKETING_MODES, SHARD_MODES, TRAINING_IMPLS
from fsdp_bench.bench_models import TINY_PRESETS
from fsdp_bench.launch import run_on_link
from fsdp_bench.netns import LinkSpec, SlowLink
from fsdp_bench.prediction import TestbedSetting, predict_testbed_step_ms
from fsdp_bench.results import load_results
from fsdp_bench.testbed_summary import SlowLinkCalibration, calibrate, format_table, summarize, target_checks

_REQUIRED_TOOLS = ("ip", "tc", "taskset")
# A ``:clip`` run's --max_norm: litgpt's default.
CLIP_MAX_NORM = 1.0


@dataclass(frozen=True)
class TestbedConfig:
    rate_mbit: float = 400.0
    impls: tuple[str, ...] = ("thunder", "thunder_overlap")
    shard_mode: str = "zero3"
    rounds: int = 5
    model_name: str = "tiny-gpt-4m"
    n_layers: int | None = None
    block_size: int | None = None
    # With tiny-gpt-4m at 400 Mbit/s this makes C and M about equal on a 2-core x86 machine
    # (C ~ 90 ms per sample of 128 tokens, M ~ 950 ms for ZeRO3); tune with --rate-mbit.
    micro_batch_size: int = 12
    max_iters: int = 12
    warmup_iters: int = 4
    cores: tuple[int, int] = (0, 1)
    # What thunder_overlap is told one collective launch costs on this link, besides bytes over
    # the rate: gloo's fixed cost per collective, about 1 ms on the 2-core testbed (one small
    # launch in link_probe.py; the simulator fits 1.3 ms to the latency-bound setting's
    # communication-only runs). With the rate, and gloo's two launches at once, it names the
    # network that schedules and sizes auto buckets (no built-in profile knows a rate-limited veth).
    link_latency_us: float = 1000.0
    out: str = "results/slow_link"
    # Per launch; Thunder compiles in the first iteration of each run.
    timeout_s: float = 600.0
    # Summarise the runs already in `out` (e.g. with a newer simulator) instead of measuring.
    from_runs: bool = False
    # Sharding auto's per-rank budget; None: halfway between ZeRO3's and ZeRO2's predicted peaks.
    memory_budget_bytes: int | None = None

    def __post_init__(self) -> None:
        def known(label: str) -> bool:
            impl, bucketing = split_label(label)
            suffix = label.partition(":")[2]
            sharding = sharding_of(label, self.shard_mode)
            return (
                impl in TRAINING_IMPLS
                and bucketing in BUCKETING_MODES
                and sharding in SHARD_MODES
                and (sharding == self.shard_mode or impl == "thunder_overlap")
                and suffix in ("", "bf16", "clip", "ckpt", "tc")
                and (impl not in ("thunder", "hand_prefetch") or not suffix)
                and (impl != "hand_prefetch" or sharding == "zero2")
                and (suffix not in ("ckpt", "tc") or impl.startswith("thunder_overlap"))
            )

        unknown = [i for i in self.impls if not known(i)]
        if unknown or not self.impls:
            raise ValueError(
                f"--impls {','.join(self.impls)!r}: accepted are one or more of {', '.join(TRAINING_IMPLS)}, "
                f"each optionally with @bucketing ({', '.join(BUCKETING_MODES)}), /sharding ({', '.join(SHARD_MODES)}; "
                "thunder_overlap only) and :bf16 for mixed precision, :clip for clipping by the global norm or :ckpt for "
                "activation checkpointing (not thunder); :tc for Thunder's torchcompile executor (thunder_overlap only), "
                "e.g. thunder_overlap@block/auto:bf16; hand_prefetch is ZeRO2 with no suffix"
            )
        if self.shard_mode not in SHARD_MODES:
            raise ValueError(f"--shard-mode={self.shard_mode!r}; accepted: {', '.join(SHARD_MODES)}")
        if self.rounds < 1:
            raise ValueError(f"--rounds must be >= 1, got {self.rounds}")
        if not (self.link_latency_us >= 0 and self.rate_mbit > 0):
            raise ValueError(
                f"--link-latency-us={self.link_latency_us} and --rate-mbit={self.rate_mbit}: accepted are a latency >= 0 and a rate > 0"
            )

    @property
    def network(self) -> str:
        """The link as a cost-model network: ``custom:<latency_us>:<GB/s>:ring:2``, a ring on
        which gloo runs two launches at once."""
        return f"custom:{self.link_latency_us:g}:{self.rate_mbit / 8e3:g}:ring:{GLOO.concurrent_launches}"

    @property
    def bucketings(self) -> tuple[str, ...]:
        """Strategies needing a communication-only run: "none" always, and each one measured."""
        measured = [split_label(i)[1] for i in self.impls]
        return tuple(dict.fromkeys(["none", *measured]))

    @property
    def calibration_runs(self) -> tuple[str, ...]:
        checkpointed = ("compute_only:ckpt",) if any(map(is_checkpointed, self.impls)) else ()
        return ("compute_only", *checkpointed, *(f"{run}@{b}" for b in self.bucketings for run in ("comm_only", "compute_with_comm")))

    def benchmark_args(self, label: str, json_path: Path, memory_budget_bytes: int | None = None) -> list[str]:
        impl, bucketing = split_label(label)
        sharding = sharding_of(label, self.shard_mode)
        args = {
            "impl": impl,
            "bucketing_mode": None if impl == "compute_only" else bucketing,
            "device": "cpu",
            "model_name": self.model_name,
            "n_layers": self.n_layers,
            "block_size": self.block_size,
            "micro_batch_size": self.micro_batch_size,
            "shard_mode": sharding,
            "memory_budget_bytes": memory_budget_bytes if sharding == "auto" else None,
            "max_iters": self.max_iters,
            "warmup_iters": self.warmup_iters,
            "json_path": json_path,
            "mixed_precision": "bf16/fp32" if is_mixed(label) else None,
            "max_norm": CLIP_MAX_NORM if is_clipped(label) else None,
            "activation_checkpointing": "" if is_checkpointed(label) else None,
            "executors": "torchcompile" if is_torchcompiled(label) else None,
            # Runs that trace thunder_overlap (the calibration replays included) schedule for the link.
            "network": self.network if impl.startswith("thunder_overlap") or impl in ("comm_only", "compute_with_comm") else None,
        }
        # A value of "" is a flag without one.
        return [item for key, value in args.items() if value is not None for item in (f"--{key}", str(value)) if item]


def split_label(label: str) -> tuple[str, str]:
    """``"thunder_overlap@block/auto:bf16"`` -> ("thunder_overlap", "block"); no ``@`` means no buckets."""
    impl, _, bucketing = label.partition(":")[0].partition("/")[0].partition("@")
    return impl, bucketing or "none"


def file_label(label: str) -> str:
    """``label`` as a file name: ``"thunder_overlap@block/auto"`` -> ``"thunder_overlap@block_auto"``."""
    return label.replace("/", "_")


def sharding_of(label: str, default: str) -> str:
    """``"thunder_overlap@block/auto:bf16"`` -> "auto"; ``default`` without a ``/`` part."""
    return label.partition(":")[0].partition("/")[2] or default


def prediction_setting(
    cfg: TestbedConfig,
    label: str,
    out: Path,
    run: dict,
    calibration: SlowLinkCalibration,
    comm_ms_by_bucketing: dict[str, float],
    bucketing: str | None = None,
) -> TestbedSetting:
    """What the simulator needs to predict ``label``'s run (``run``: one round's result JSON) from
    the testbed's calibration; ``bucketing`` simulates another strategy under it."""
    impl, measured = split_label(label)
    return TestbedSetting(
        impl=impl,
        bucketing=bucketing or measured,
        shard_mode=sharding_of(label, cfg.shard_mode),
        model_name=cfg.model_name,
        n_layers=run["n_layers"],
        block_size=run["block_size"],
        micro_batch_size=cfg.micro_batch_size,
        world_size=SlowLink.WORLD_SIZE,
        rate_mbit=cfg.rate_mbit,
        network=cfg.network,
        compute_ms=calibration.compute_ms,
        comm_ms=calibration.comm_ms,
        result_json=str(out / "runs" / f"round0_{file_label(label)}.json"),
        comm_ms_by_bucketing=comm_ms_by_bucketing,
        concurrent_ms=calibration.concurrent_ms,
    )


def midway_budget(cfg: TestbedConfig, bucketing: str) -> int:
    """Halfway between the predicted peaks of ZeRO3 and ZeRO2 for the testbed's model, batch and
    ``bucketing``: sharding auto's own estimates (the just-in-time step), traced on a fake group
    of 2 ranks with the buckets' gloo paths, whose copies the testbed's runs hold."""
    import thunder
    import torch

    from thunder_overlap import BucketingTransform, OverlapConfig, Zero3Transform, fsdp
    from thunder_overlap._backends import GLOO
    from thunder_overlap.report._thunder_baseline import _math_attention, fake_process_group

    from fsdp_bench.bench_models import build_model

    model, spec = build_model(cfg.model_name, cfg.n_layers, cfg.block_size)
    everything = OverlapConfig(memory_budget_bytes=1 << 50)
    with fake_process_group(SlowLink.WORLD_SIZE), _math_attention():
        jm = fsdp(model, device="meta", sharding_strategy="auto", bucketing_strategy=bucketing, config=everything)
        buckets = BucketingTransform.of(jm)
        if buckets is not None:
            buckets.set_layouts({bucket: layout.as_on(GLOO) for bucket, layout in buckets.layouts.items()})
        idx = torch.zeros((cfg.micro_batch_size, spec.block_size), dtype=torch.long, device="meta")
        thunder.compile_data(jm).get_computation_and_inputs(idx)
    choice = Zero3Transform.of(jm).choice
    return choice.zero3_peak_bytes + (choice.zero2_peak_bytes - choice.zero3_peak_bytes) // 2


def unsharding_checks(summaries: list, default_sharding: str) -> list[str]:
    """Each ``/auto`` run against the ZeRO3 and ZeRO2 runs of the same implementation and
    bucketing: its step at most halfway between theirs."""
    by_impl = {s.impl: s for s in summaries}
    checks = []
    for label, auto in by_impl.items():
        if sharding_of(label, default_sharding) != "auto":
            continue
        base = label.partition(":")[0].partition("/")[0]
        suffix = label.partition(":")[1] + label.partition(":")[2]
        runs = {
            sharding_of(other, default_sharding): s
            for other, s in by_impl.items()
            if other.partition(":")[0].partition("/")[0] == base and other.endswith(suffix)
        }
        if "zero2" not in runs or "zero3" not in runs:
            continue
        zero2, zero3 = runs["zero2"].median_ms, runs["zero3"].median_ms
        halfway = (zero2 + zero3) / 2
        closed = (zero3 - auto.median_ms) / (zero3 - zero2) if zero3 != zero2 else float("nan")
        checks.append(
            f"{'PASS' if auto.median_ms <= halfway else 'FAIL'} {label} {auto.median_ms:.1f} ms <= halfway between ZeRO3 "
            f"{zero3:.1f} ms and ZeRO2 {zero2:.1f} ms ({halfway:.1f} ms); it closes {closed:.0%} of the difference"
        )
    return checks


def is_mixed(label: str) -> bool:
    """Whether ``label`` runs with mixed precision (a ``:bf16`` suffix)."""
    return label.endswith(":bf16")


def is_clipped(label: str) -> bool:
    """Whether ``label`` clips the gradient by its global norm each step (a ``:clip`` suffix)."""
    return label.endswith(":clip")


def is_checkpointed(label: str) -> bool:
    """Whether ``label`` checkpoints every block's activations (a ``:ckpt`` suffix)."""
    return label.endswith(":ckpt")


def is_torchcompiled(label: str) -> bool:
    """Whether ``label`` runs under Thunder's torchcompile executor (a ``:tc`` suffix)."""
    return label.endswith(":tc")


def checkpointing_checks(runs: dict[str, list[dict]], compute: list[dict], compute_checkpointed: list[dict] | None) -> list[str]:
    """Each ``:ckpt`` run against its run without checkpointing, round by round (they ran back to
    back): what checkpointing added to the step, against what it added to the compute-only step
    (the recompute's compute time). Under ZeRO3 the backward's gathers serve the recomputation,
    so checkpointing should add no exposed communication: at most the recompute."""
    if compute_checkpointed is None:
        return []
    recompute = statistics.median(
        statistics.median(c["iter_times_ms"]) - statistics.median(p["iter_times_ms"])
        for c, p in zip(compute_checkpointed, compute, strict=True)
    )
    lines = []
    for label, checkpointed_runs in runs.items():
        plain_runs = runs.get(label.removesuffix(":ckpt")) if is_checkpointed(label) else None
        if plain_runs is None:
            continue
        checkpointed = [statistics.median(r["iter_times_ms"]) for r in checkpointed_runs]
        plain = [statistics.median(r["iter_times_ms"]) for r in plain_runs]
        added = statistics.median(c - p for c, p in zip(checkpointed, plain, strict=True))
        lines.append(
            f"{'PASS' if added <= recompute else 'FAIL'} {label} adds {added:.1f} ms to {label.removesuffix(':ckpt')}'s "
            f"{statistics.median(plain):.1f} ms (median of {len(plain)} rounds' differences); the recompute's compute time, "
            f"compute_only:ckpt - compute_only, is {recompute:.1f} ms (<= it: the backward's gathers stay hidden)"
        )
    return lines


def clipping_checks(runs: dict[str, list[dict]]) -> list[str]:
    """Each ``:clip`` run against its unclipped run, round by round (they ran back to back): the
    median of the rounds' differences in median step time, and whether it is within the noise,
    the spread of the unclipped run's round medians."""
    lines = []
    for label, clipped_runs in runs.items():
        unclipped_runs = runs.get(label.removesuffix(":clip")) if is_clipped(label) else None
        if unclipped_runs is None:
            continue
        clipped = [statistics.median(r["iter_times_ms"]) for r in clipped_runs]
        unclipped = [statistics.median(r["iter_times_ms"]) for r in unclipped_runs]
        added = statistics.median(c - u for c, u in zip(clipped, unclipped, strict=True))
        noise = max(unclipped) - min(unclipped)
        base = statistics.median(unclipped)
        lines.append(
            f"{'PASS' if added <= noise else 'FAIL'} {label} adds {added:+.1f} ms ({added / base:+.1%}) to {base:.1f} ms "
            f"(median of {len(clipped)} rounds' differences), within the noise: the unclipped run's round medians spread "
            f"{noise:.1f} ms"
        )
    return lines


# The target: thunder_overlap's ZeRO2 step at most the hand-written loop's.
MAX_OVER_HAND_LOOP = 1.0
HAND_LOOP = "hand_prefetch@block"


def hand_loop_checks(runs: dict[str, list[dict]]) -> list[str]:
    """Each thunder_overlap ZeRO2 run against the hand-written loop, round by round (they ran in
    the same rounds): the median of the rounds' ratios of median step times."""
    if HAND_LOOP not in runs:
        return []
    hand = [statistics.median(r["iter_times_ms"]) for r in runs[HAND_LOOP]]
    lines = []
    for label, label_runs in runs.items():
        if not label.startswith("thunder_overlap") or label_runs[0]["shard_mode"] != "zero2":
            continue
        ratios = [statistics.median(r["iter_times_ms"]) / h for r, h in zip(label_runs, hand, strict=True)]
        ratio = statistics.median(ratios)
        lines.append(
            f"{'PASS' if ratio <= MAX_OVER_HAND_LOOP else 'FAIL'} {label} takes {ratio:.3f}x {HAND_LOOP}'s step (median of "
            f"{len(ratios)} rounds' ratios: {', '.join(f'{r:.3f}' for r in ratios)}; <= {MAX_OVER_HAND_LOOP})"
        )
    return lines


def mixed_precision_checks(summaries: list) -> list[str]:
    """Each ``:bf16`` thunder_overlap run against its float32 run (at most 0.8x) and against FSDP2
    with the same policy (faster), all in the same rounds."""
    by_impl = {s.impl: s for s in summaries}
    fsdp2 = by_impl.get("fsdp2:bf16")
    checks = []
    for label, mixed in by_impl.items():
        if not is_mixed(label) or not label.startswith("thunder_overlap"):
            continue
        fp32 = by_impl.get(label.removesuffix(":bf16"))
        if fp32 is not None:
            ratio = mixed.median_ms / fp32.median_ms
            checks.append(f"{'PASS' if ratio <= 0.8 else 'FAIL'} {label} / its float32 run = {ratio:.3f} (<= 0.8)")
        if fsdp2 is not None:
            ratio = mixed.median_ms / fsdp2.median_ms
            checks.append(f"{'PASS' if ratio < 1 else 'FAIL'} {label} / fsdp2:bf16 = {ratio:.3f} (< 1)")
    return checks


def _parse_args(argv: list[str]) -> TestbedConfig:
    defaults = TestbedConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rate-mbit", type=float, default=defaults.rate_mbit, help="htb rate of the link, each direction")
    impls_help = f"comma-separated, of {', '.join(TRAINING_IMPLS)}, each optionally @{'|'.join(BUCKETING_MODES)}"
    p.add_argument("--impls", default=",".join(defaults.impls), help=impls_help)
    p.add_argument("--shard-mode", default=defaults.shard_mode, choices=SHARD_MODES)
    p.add_argument("--rounds", type=int, default=defaults.rounds)
    p.add_argument("--model-name", default=defaults.model_name, help=f"presets: {', '.join(TINY_PRESETS)}, or a litgpt name")
    p.add_argument("--n-layers", type=int, default=defaults.n_layers)
    p.add_argument("--block-size", type=int, default=defaults.block_size)
    p.add_argument("--micro-batch-size", type=int, default=defaults.micro_batch_size)
    p.add_argument("--max-iters", type=int, default=defaults.max_iters)
    p.add_argument("--warmup-iters", type=int, default=defaults.warmup_iters)
    p.add_argument("--link-latency-us", type=float, default=defaults.link_latency_us, help="per-launch latency thunder_overlap assumes")
    p.add_argument("--cores", default=",".join(map(str, defaults.cores)), help="core of rank 0, core of rank 1")
    p.add_argument("--out", default=defaults.out)
    p.add_argument("--timeout-s", type=float, default=defaults.timeout_s)
    p.add_argument(
        "--memory-budget-bytes",
        type=int,
        default=None,
        help="/auto runs' budget (default: halfway between ZeRO3's and ZeRO2's predicted peaks)",
    )
    p.add_argument(
        "--from-runs", action="store_true", help="summarise the run JSONs already in --out instead of measuring (no root needed)"
    )
    args = p.parse_args(argv)
    try:
        cores = tuple(int(c) for c in args.cores.split(","))
        return TestbedConfig(**{**vars(args), "impls": tuple(i for i in args.impls.split(",") if i), "cores": cores})
    except ValueError as e:
        p.error(str(e))


def _check_host() -> None:
    missing = [tool for tool in _REQUIRED_TOOLS if shutil.which(tool) is None]
    if missing:
        raise SystemExit(f"slow_link.py needs {', '.join(_REQUIRED_TOOLS)}; missing: {', '.join(missing)}")
    if os.geteuid() != 0:
        raise SystemExit("slow_link.py creates network namespaces and qdiscs: run it as root")


def _exit_on_signal(signum, _frame) -> None:
    # Turn SIGTERM/SIGHUP into an exception so that the `with SlowLink` block cleans up.
    raise SystemExit(f"stopped by signal {signal.Signals(signum).name}")


def _measure(cfg: TestbedConfig, link: SlowLink, out: Path) -> dict[str, list[dict]]:
    sequence = (*cfg.calibration_runs, *cfg.impls)
    runs: dict[str, list[dict]] = {impl: [] for impl in sequence}
    budgets = {}
    for impl in cfg.impls:
        if sharding_of(impl, cfg.shard_mode) == "auto":
            bucketing = split_label(impl)[1]
            budgets[impl] = cfg.memory_budget_bytes or midway_budget(cfg, bucketing)
            print(f"{impl}: memory budget {budgets[impl]} B", flush=True)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    (out / "budgets.json").write_text(json.dumps(budgets, indent=1))
    for round_index in range(cfg.rounds):
        for impl in sequence:
            label = f"round{round_index}_{file_label(impl)}"
            json_path = out / "runs" / f"{label}.json"
            run_on_link(link, cfg.benchmark_args(impl, json_path, budgets.get(impl)), out / "logs", label, cfg.timeout_s)
            (result,) = load_results([json_path])
            runs[impl].append(result)
            median = statistics.median(result["iter_times_ms"])
            print(f"round {round_index + 1}/{cfg.rounds} {impl:<16} median {median:.1f} ms", flush=True)
    return runs


def _load_runs(cfg: TestbedConfig, out: Path) -> dict[str, list[dict]]:
    """The per-round JSONs an earlier measurement with the same options left in ``out`` (runs
    from before the concurrent calibration existed have none: it is then not measured)."""
    runs = {}
    for impl in (*cfg.calibration_runs, *cfg.impls):
        paths = [out / "runs" / f"round{r}_{file_label(impl)}.json" for r in range(cfg.rounds)]
        missing = [str(p) for p in paths if not p.exists()]
        if missing and impl.startswith("compute_with_comm@") and len(missing) == len(paths):
            continue
        if missing:
            raise SystemExit(f"--from-runs: {', '.join(missing)} not found; measure with the same --impls and --rounds first")
        runs[impl] = load_results(paths)
    return runs


def main(argv: list[str]) -> None:
    cfg = _parse_args(argv)
    out = Path(cfg.out)
    if cfg.from_runs:
        runs = _load_runs(cfg, out)
    else:
        _check_host()
        for signum in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, _exit_on_signal)
        with SlowLink(LinkSpec(cfg.rate_mbit, cfg.cores)) as link:
            print(f"link: {link.address(0)} <-> {link.address(1)}, {cfg.rate_mbit} Mbit/s each way (htb), cores {cfg.cores}", flush=True)
            runs = _measure(cfg, link, out)

    compute_runs = runs.pop("compute_only")
    checkpointed_compute_runs = runs.pop("compute_only:ckpt", None)
    calibrations = {
        b: calibrate(compute_runs, runs.pop(f"comm_only@{b}"), runs.pop(f"compute_with_comm@{b}", None)) for b in cfg.bucketings
    }
    comm_ms_by_bucketing = {b: c.comm_ms for b, c in calibrations.items()}
    # Thunder's FSDP runs per parameter whatever its bucketing option says.
    calibration_of = {impl: calibrations["none" if split_label(impl)[0] == "thunder" else split_label(impl)[1]] for impl in runs}
    first = next(iter(runs.values()))[0]
    simulated = {
        # Calibrated for --shard-mode's float32 runs under the default executors only.
        impl: None
        if any(is_kind(impl) for is_kind in (is_mixed, is_clipped, is_checkpointed, is_torchcompiled))
        or sharding_of(impl, cfg.shard_mode) != cfg.shard_mode
        else predict_testbed_step_ms(prediction_setting(cfg, impl, out, first, calibration_of[impl], comm_ms_by_bucketing))
        for impl in runs
    }
    summaries = summarize(runs, calibration_of, simulated)
    print()
    print(format_table(summaries, calibrations))
    checks = (
        target_checks(summaries, calibrations["none"])
        + mixed_precision_checks(summaries)
        + unsharding_checks(summaries, cfg.shard_mode)
        + clipping_checks(runs)
        + hand_loop_checks(runs)
        + checkpointing_checks(runs, compute_runs, checkpointed_compute_runs)
    )
    print("\n".join(checks))
    summary = {
        "config": asdict(cfg),
        "calibration": asdict(calibrations["none"]),
        "calibration_by_bucketing": {b: asdict(c) for b, c in calibrations.items()},
        "implementations": [asdict(s) for s in summaries],
        "targets": checks,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"wrote {out / 'summary.json'}")


if __name__ == "__main__":
    main(sys.argv[1:])
