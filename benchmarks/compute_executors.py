"""What one rank's compute costs under each executor: eager PyTorch against ``thunder.jit``.

    python benchmarks/compute_executors.py --out benchmarks/measured/slow_link/zero2_hand_loop/compute.json

Forward and backward of one micro-batch of the slow-link testbed's model (no communication, no
optimizer), on one core as a testbed rank runs, timed in rounds that visit every executor in
turn (A B C D A B C D ...) so drift on a shared machine falls on all of them alike. Prints the
median per executor and its ratio to eager; writes the raw times as JSON.

Why it exists: on CPU, Thunder's default executors run the decomposed trace (layer norm, GELU,
attention and their gradients as many elementwise ops, with no fusion executor), so a Thunder
step computes more slowly than the same model eagerly; torch.compile through Thunder's
torchcompile executor fuses them again. The slow-link comparison with the hand-written loop,
which computes eagerly, is read against these figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import thunder
import torch

from fsdp_bench.bench_config import EXECUTORS
from fsdp_bench.bench_models import TINY_PRESETS, build_model, loss_fn, materialize
from fsdp_bench.impls import jit_options

EAGER = "eager"


def _step(fn, model: torch.nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> float:
    start = time.perf_counter()
    loss_fn(fn(idx), targets).backward()
    elapsed_ms = (time.perf_counter() - start) * 1e3
    model.zero_grad(set_to_none=True)
    return elapsed_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model-name", default="tiny-gpt-4m", choices=sorted(TINY_PRESETS))
    parser.add_argument("--micro-batch-size", type=int, default=12, help="as the slow-link testbed's")
    parser.add_argument("--rounds", type=int, default=8, help="timed visits of every executor (after one untimed)")
    parser.add_argument("--core", type=int, default=0, help="the one core to run on, as a testbed rank")
    parser.add_argument("--out", type=Path, default=None, help="where to write the raw times (JSON)")
    args = parser.parse_args()
    if args.micro_batch_size < 1 or args.rounds < 1:
        parser.error(f"--micro-batch-size={args.micro_batch_size} and --rounds={args.rounds} must be at least 1")
    if args.core not in os.sched_getaffinity(0):
        parser.error(f"--core={args.core} is not one this process may run on: {sorted(os.sched_getaffinity(0))}")
    os.sched_setaffinity(0, {args.core})
    torch.set_num_threads(1)

    torch.manual_seed(0)
    model, spec = build_model(args.model_name)
    model = materialize(model, torch.device("cpu"))
    tokens = torch.randint(0, spec.vocab_size, (args.micro_batch_size, spec.block_size + 1), generator=torch.Generator().manual_seed(0))
    idx, targets = tokens[:, :-1], tokens[:, 1:]
    runners = {EAGER: model, **{name: thunder.jit(model, **jit_options(name)) for name in EXECUTORS}}
    # The first step compiles (and warms the allocator): what a run pays once per executor.
    first_step_ms = {name: _step(fn, model, idx, targets) for name, fn in runners.items()}
    times_ms: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(args.rounds):
        for name, fn in runners.items():
            times_ms[name].append(_step(fn, model, idx, targets))

    medians = {name: statistics.median(ts) for name, ts in times_ms.items()}
    print(f"{args.model_name}, micro-batch {args.micro_batch_size}, forward + backward on core {args.core}, {args.rounds} rounds")
    print(f"{'executors':<18} {'median ms':>10} {'/ eager':>8} {'first step s':>13}")
    for name, median in medians.items():
        print(f"{name:<18} {median:>10.1f} {median / medians[EAGER]:>8.3f} {first_step_ms[name] / 1e3:>13.1f}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        settings = {"model_name": args.model_name, "micro_batch_size": args.micro_batch_size, "rounds": args.rounds, "threads": 1}
        measured = {"median_ms": medians, "first_step_ms": first_step_ms, "times_ms": times_ms}
        args.out.write_text(json.dumps({"settings": settings, **measured}, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
