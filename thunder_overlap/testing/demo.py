"""The demo: what thunder_overlap changes in Thunder's FSDP, and what that is worth.

    python -m thunder_overlap demo [--sharding zero3] [--bucketing block] [--steps 4] [--n-layer 3]

Two gloo ranks on this machine's CPU train TinyGPT with Thunder's own FSDP and with
thunder_overlap. The demo prints what is deterministic first (collectives per step, measured peak
memory, the schedule of each final trace, the losses, which agree), then the step time the cost
model predicts for the same model shapes on 8 and 64 H100s, then the times measured here.
Over loopback gloo there is no communication cost to hide, so the measured times show only the
extra work; the predicted ones show what the schedule is worth where communication costs time.

Progress goes to stderr; stdout is the result, and the README's excerpt of it is checked against
a fresh run (``thunder_overlap.testing.readme_excerpts``). Lines starting with
:data:`MEASURED_PREFIX` hold timings and differ from run to run.
"""

from __future__ import annotations

import argparse
import statistics
import textwrap
from dataclasses import dataclass
from typing import TYPE_CHECKING

from thunder_overlap._console import (
    Heartbeat,
    children_without_known_warnings,
    filter_known_output,
    progress,
    silence_known_warnings,
)
from thunder_overlap.options import BucketingStrategy, ShardingStrategy
from thunder_overlap.testing.demo_prediction import PREDICTED_SCALES, PredictedStep, PredictionSetup, predict_step

# torch and Thunder are imported past argument parsing: --help and usage errors answer at once.
if TYPE_CHECKING:
    from thunder_overlap.testing.training import RankResult, TrainSetup

__all__ = ["MEASURED_PREFIX", "main"]

IMPLS = ("thunder", "thunder_overlap")
# Every line of the demo's stdout that holds a measured time starts with this.
MEASURED_PREFIX = "  measured:"
PICTURE_WIDTH = 96
# The predicted schedule counts as trailing its unscheduled traces (same buckets) when it is
# slower by more than this factor (below it, the difference is rounding in the cost model).
SCHEDULE_LOSS_TOLERANCE = 1.01
# Lines of each schedule picture: the start (prefetch), an ellipsis, and the end.
PICTURE_LINES = 3
# The model: 3 blocks compile and train on 2 CPU ranks in well under a minute of CPU time each,
# and are enough for the schedule to reach its steady state (the next block prefetched).
DEFAULT_N_LAYER = 3
DEFAULT_N_EMBD = 64
DEFAULT_STEPS = 4
MICRO_BATCH = 1
SEQ_LEN = 16


@dataclass(frozen=True)
class DemoResults:
    """Rank 0's training results per implementation, and the predictions."""

    thunder: RankResult
    overlap: RankResult
    predictions: list[PredictedStep]


@dataclass(frozen=True)
class RankWork:
    """What one rank runs: the trainings in order, then its share of the predictions."""

    setups: tuple[TrainSetup, ...]
    predictions: tuple[PredictionSetup, ...]


def _train_then_predict(rank: int, world_size: int, work: RankWork) -> tuple[list[RankResult], list[PredictedStep]]:
    """Runs on each rank: both implementations, one after the other, in one process group; then,
    with that group gone, every ``world_size``-th prediction from this rank's. The ranks have
    imported torch and Thunder already: a fresh process per prediction would import them again."""
    import torch.distributed as dist

    from thunder_overlap.testing.training import train_rank

    results = []
    for setup in work.setups:
        if rank == 0:
            progress(f"compiling forward and backward, rank 0: {setup.impl} ...")
        results.append(train_rank(rank, world_size, setup))
    mine = work.predictions[rank::world_size]
    # The peers meet before the group goes: none may leave while another still communicates.
    dist.barrier()
    dist.destroy_process_group()  # predict_step traces in a fake group of its own
    if rank == 0 and work.predictions:
        scales = " and ".join(str(p.world_size) for p in work.predictions)
        progress(f"predicting the step at {scales} GPUs (tracing on the meta device) ...")
    return results, [predict_step(p) for p in mine]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m thunder_overlap demo", description=__doc__.splitlines()[0])
    # Not "auto": it needs a memory budget on CPU, and the demo compares with Thunder's ZeRO2/ZeRO3.
    parser.add_argument("--sharding", choices=[ShardingStrategy.ZERO2.value, ShardingStrategy.ZERO3.value], default="zero3")
    parser.add_argument(
        "--bucketing", choices=BucketingStrategy.names(), default="block", help="thunder_overlap's bucketing strategy"
    )
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    parser.add_argument("--n-layer", type=int, default=DEFAULT_N_LAYER)
    parser.add_argument("--world-size", type=int, default=2, help="local gloo ranks (processes)")
    parser.add_argument("--no-prediction", action="store_true", help="skip the predicted multi-GPU step times")
    args = parser.parse_args(argv)
    for option, value, least in (("--steps", args.steps, 2), ("--n-layer", args.n_layer, 1), ("--world-size", args.world_size, 2)):
        if value < least:
            parser.error(f"{option} {value} is not allowed; it must be at least {least}")
    return args


def _run(args: argparse.Namespace) -> DemoResults:
    from thunder_overlap.report._builtin_models import TinyGPTConfig
    from thunder_overlap.testing.local_ranks import run_local_ranks
    from thunder_overlap.testing.training import TrainSetup

    model = TinyGPTConfig(n_layer=args.n_layer, n_embd=DEFAULT_N_EMBD)
    setups = tuple(
        TrainSetup(
            impl=impl,
            sharding=args.sharding,
            # Thunder 0.2.6's FSDP stores its bucketing option and never reads it.
            bucketing=args.bucketing if impl == "thunder_overlap" else "none",
            model=model,
            micro_batch=MICRO_BATCH,
            seq_len=SEQ_LEN,
            steps=args.steps,
        )
        for impl in IMPLS
    )
    requests = () if args.no_prediction else tuple(
        PredictionSetup(model, args.sharding, args.bucketing, world_size, network) for world_size, network in PREDICTED_SCALES
    )
    with children_without_known_warnings(), filter_known_output():
        with Heartbeat(f"compiling, training and predicting on {args.world_size} ranks"):
            ranks = run_local_ranks(_train_then_predict, args.world_size, (RankWork(setups, requests),))
    thunder, overlap = ranks[0][0]
    # Rank r predicted requests r, r + world_size, ...: back in the order asked.
    predictions = [ranks[i % args.world_size][1][i // args.world_size] for i in range(len(requests))]
    return DemoResults(thunder, overlap, predictions)


def _picture(text: str) -> list[str]:
    lines = textwrap.wrap(text, PICTURE_WIDTH)
    if len(lines) > PICTURE_LINES:
        lines = [*lines[: PICTURE_LINES - 1], "...", lines[-1]]
    return ["      " + line for line in lines]


def _paragraph(text: str) -> list[str]:
    return textwrap.wrap(text, PICTURE_WIDTH + 6, initial_indent="  ", subsequent_indent="  ")


def _mib(nbytes: int | None) -> str:
    return "n/a" if nbytes is None else f"{nbytes / 2**20:.2f} MiB"


def _label(impl: str, bucketing: str) -> str:
    return f"thunder_overlap ({bucketing} buckets)" if impl == "thunder_overlap" and bucketing != "none" else impl


def _what_changes(results: DemoResults, args: argparse.Namespace) -> list[str]:
    rows = [(_label(impl, args.bucketing), r) for impl, r in zip(IMPLS, (results.thunder, results.overlap), strict=True)]
    width = max(len(label) for label, _ in rows)
    lines = [
        "What changes (rank 0's final traces; measured peak memory):",
        f"  {'':<{width}}  all-gathers fwd + bwd  reduce-scatters  peak live tensors",
    ]
    for label, r in rows:
        gathers = f"{r.forward_stats.allgathers} + {r.backward_stats.allgathers}"
        lines.append(f"  {label:<{width}}  {gathers:>21}  {r.backward_stats.reduce_scatters:>15}  {_mib(r.peak_step_bytes):>17}")
    if (results.overlap.peak_step_bytes or 0) > (results.thunder.peak_step_bytes or 0):
        lines += _paragraph(
            f"At {SEQ_LEN} tokens per rank the gathered parameters are most of the memory: the block in use, the next "
            "one arriving and, over gloo, each bucket's copy-out weigh more than Thunder's parameter-sized all-gathers "
            "here. At a GPU's batch, activations dominate; see the predicted peaks below."
        )
    lines.append("")
    lines.append("Schedules: AG/RS issue an all-gather/reduce-scatter, W waits, mm is a matmul, c other compute")
    for impl, r in zip(IMPLS, (results.thunder, results.overlap), strict=True):
        f, b = r.forward_stats, r.backward_stats
        lines.append(f"  {impl} forward ({f.allgathers} all-gathers, at most {f.max_allgathers_in_flight} in flight):")
        lines += _picture(r.forward_picture)
        lines.append(f"  {impl} backward ({b.reduce_scatters_overlapped} of {b.reduce_scatters} reduce-scatters overlap compute):")
        lines += _picture(r.backward_picture)
    return lines


def _losses(results: DemoResults) -> list[str]:
    base, ours = results.thunder.losses, results.overlap.losses
    agree = "they agree" if base == ours else f"largest difference {max(abs(a - b) for a, b in zip(base, ours, strict=True)):.2e}"
    lines = [f"Losses ({agree}):", f"  {'step':>4}  {'thunder':>10}  {'thunder_overlap':>15}"]
    lines += [f"  {step:>4}  {a:>10.5f}  {b:>15.5f}" for step, (a, b) in enumerate(zip(base, ours, strict=True), start=1)]
    return lines


def _predicted(results: DemoResults, args: argparse.Namespace) -> list[str]:
    if not results.predictions:
        return []
    from thunder_overlap.report._report import BASELINE, OVERLAP, UNSCHEDULED, speed_change

    first = results.predictions[0]
    head = (
        f"Predicted step, forward + backward, per GPU (cost model: {first.device}, nvlink/infiniband; the same "
        f"TinyGPT in {first.dtype}, {first.batch} x {first.seq_len} tokens per GPU):"
    )
    lines = textwrap.wrap(head, PICTURE_WIDTH + 6, subsequent_indent="  ")
    lines.append(f"  {'':<19}" + "".join(f"{c:>20}" for c in (BASELINE, UNSCHEDULED, OVERLAP)))
    for p in results.predictions:
        verdict = speed_change(p.thunder_ms, p.overlap_ms)
        times = "".join(f"{ms:>17.3f} ms" for ms in (p.thunder_ms, p.unscheduled_ms, p.overlap_ms))
        lines.append(f"  {p.world_size:>3} GPUs, {p.network:<10}{times}  {verdict}")
    regather = ", ZeRO3 re-gathers" if args.sharding == ShardingStrategy.ZERO3 else ""
    lines += _paragraph(
        f"{BASELINE}: the traces Thunder's own FSDP produces (one collective per parameter; its ZeRO3 keeps the "
        f"unsharded parameters, so backward gathers nothing). {UNSCHEDULED}: thunder_overlap's traces "
        f"({args.bucketing} buckets{regather}) in Thunder's order."
    )
    if any(p.overlap_ms > p.unscheduled_ms * SCHEDULE_LOSS_TOLERANCE for p in results.predictions):
        lines += _paragraph(
            "Where thunder_overlap trails its unscheduled traces, collective latency dominates this small model: "
            "every launch pays it, and the order that issues the collectives later leaves more of it exposed."
        )
    peaks = ", ".join(
        f"{p.world_size} GPUs {_mib(p.thunder_peak_bytes)} -> {_mib(p.overlap_peak_bytes)}" for p in results.predictions
    )
    lines += _paragraph(f"Predicted peak memory per GPU, {BASELINE} -> {OVERLAP}: {peaks}")
    return lines


def _measured(results: DemoResults, world_size: int) -> list[str]:
    base, ours = results.thunder.step_ms, results.overlap.step_ms
    return [
        f"Measured here ({world_size} CPU processes over loopback gloo; times vary from run to run):",
        f"{MEASURED_PREFIX} first step (compiles): thunder {base[0] / 1e3:.1f} s, thunder_overlap {ours[0] / 1e3:.1f} s",
        f"{MEASURED_PREFIX} median of the later steps: thunder {statistics.median(base[1:]):.1f} ms, "
        f"thunder_overlap {statistics.median(ours[1:]):.1f} ms",
        *_paragraph(
            "Over loopback there is no communication cost to hide, so these times show thunder_overlap's extra work "
            "(ZeRO3 re-gathers, bucket copies), not its benefit."
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    """Runs the demo; returns the process exit status."""
    args = _parse(argv)
    silence_known_warnings()
    print(
        f"TinyGPT: {args.n_layer} blocks, n_embd {DEFAULT_N_EMBD}, {args.world_size} gloo ranks on CPU, "
        f"{args.sharding.upper()}, {args.steps} steps of {MICRO_BATCH} x {SEQ_LEN} tokens per rank"
    )
    print("Thunder's FSDP: one collective per parameter, in Thunder's order. thunder_overlap: "
          f"{args.bucketing} buckets, collectives interleaved with compute.", flush=True)
    results = _run(args)
    sections = [_what_changes(results, args), _losses(results), _predicted(results, args), _measured(results, args.world_size)]
    print("\n\n".join("\n".join(section) for section in sections if section))
    return 0
