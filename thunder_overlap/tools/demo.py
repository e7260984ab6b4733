"""The demo: 2 gloo ranks train TinyGPT with thunder_overlap and with Thunder's own FSDP.

    python -m thunder_overlap demo [--sharding zero3] [--bucketing block] [--steps 5] [--n-layer 8]

Prints per-step losses (they agree), ms per step, measured peak memory and a compact picture of
each forward and backward schedule, so the difference is visible at a glance.
"""

from __future__ import annotations

import argparse
import statistics
import textwrap

from thunder_overlap.options import BucketingStrategy, ShardingStrategy
from thunder_overlap.tools.local_ranks import run_local_ranks
from thunder_overlap.tools.tiny_models import TinyGPTConfig
from thunder_overlap.tools.training import RankResult, TrainSetup, train_rank

IMPLS = ("thunder", "thunder_overlap")
PICTURE_WIDTH = 96
PICTURE_LINES = 3


def _picture(text: str) -> str:
    lines = textwrap.wrap(text, PICTURE_WIDTH)
    if len(lines) > PICTURE_LINES:
        lines = [*lines[: PICTURE_LINES - 1], "...", lines[-1]]
    return "\n".join("    " + line for line in lines)


def _mib(nbytes: int | None) -> str:
    return "n/a" if nbytes is None else f"{nbytes / 2**20:.2f} MiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m thunder_overlap demo", description=__doc__.splitlines()[0])
    parser.add_argument("--sharding", choices=ShardingStrategy.names(), default="zero3")
    parser.add_argument(
        "--bucketing", choices=BucketingStrategy.names(), default="none", help="thunder_overlap's bucketing strategy"
    )
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args(argv)
    for option, value in (("--steps", args.steps), ("--n-layer", args.n_layer), ("--world-size", args.world_size)):
        if value < 1:
            parser.error(f"{option} {value} is not allowed; it must be a positive integer")

    # Parameters dominate memory in this shape, as they do for FSDP at small micro-batches.
    model = TinyGPTConfig(n_layer=args.n_layer, n_embd=128)
    print(
        f"TinyGPT: {args.n_layer} blocks, {args.world_size} gloo ranks on CPU, {args.sharding.upper()}, {args.steps} steps, "
        f"thunder_overlap bucketing {args.bucketing} (Thunder's FSDP ignores its bucketing option, so it runs none)"
    )
    results: dict[str, RankResult] = {}
    for impl in IMPLS:
        print(f"  compiling and training with {impl} ...", flush=True)
        bucketing = args.bucketing if impl == "thunder_overlap" else "none"
        setup = TrainSetup(
            impl=impl, sharding=args.sharding, bucketing=bucketing, model=model, micro_batch=1, seq_len=16, steps=args.steps
        )
        results[impl] = run_local_ranks(train_rank, args.world_size, (setup,))[0]

    print(f"\n{'step':>4}  {'loss thunder':>14}  {'loss overlap':>14}  {'ms thunder':>11}  {'ms overlap':>11}")
    base, ours = results["thunder"], results["thunder_overlap"]
    for step in range(args.steps):
        print(
            f"{step + 1:>4}  {base.losses[step]:>14.6f}  {ours.losses[step]:>14.6f}  "
            f"{base.step_ms[step]:>11.1f}  {ours.step_ms[step]:>11.1f}"
        )
    if args.steps > 1:
        # The first step compiles; the median of the rest is the steady state.
        print(f"median ms/step after the first: thunder {statistics.median(base.step_ms[1:]):.1f}, "
              f"thunder_overlap {statistics.median(ours.step_ms[1:]):.1f}")
    print(f"peak live tensor memory in a step: thunder {_mib(base.peak_step_bytes)}, "
          f"thunder_overlap {_mib(ours.peak_step_bytes)}")
    print("\nSchedules (rank 0): AG/RS issue a collective, W waits, mm is a matmul, c other compute")
    for impl in IMPLS:
        r = results[impl]
        print(f"  {impl} forward ({r.forward_stats.allgathers} all-gathers, at most "
              f"{r.forward_stats.max_allgathers_in_flight} in flight):")
        print(_picture(r.forward_picture))
        print(f"  {impl} backward ({r.backward_stats.allgathers} all-gathers, "
              f"{r.backward_stats.reduce_scatters_overlapped}/{r.backward_stats.reduce_scatters} reduce-scatters overlapped):")
        print(_picture(r.backward_picture))
    return 0
