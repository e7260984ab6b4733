"""``python -m thunder_overlap report``: predicted overlap and memory at any world size, no GPU.

The model is built on the meta device and traced (never run) in one process that pretends to be
rank 0 of ``--world-size`` ranks through PyTorch's ``fake`` process group, so a 1024-rank
Llama-2-7B report needs neither GPUs nor memory for the weights. The same model is traced twice:
with thunder_overlap's FSDP and with Thunder's own (the baseline). Thunder's tracing dominates the
run time (about 5 s per transformer layer and FSDP here); a heartbeat shows it is still going.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import torch

from thunder_overlap.analysis.cost_model import default_network
from thunder_overlap.options import BucketingStrategy, ShardingStrategy, parse_bucketing_strategy, parse_sharding_strategy
from thunder_overlap.report.models import BUILTIN_MODELS, model_recipe, trace_model

__all__ = ["DEFAULT_OUT", "main"]

# The fake process group takes any size; beyond this no FSDP job exists and shards get silly.
MAX_WORLD_SIZE = 1 << 20
# Seconds between progress lines while Thunder traces.
HEARTBEAT_S = 15.0
# Where report.json, report.trace.json and report.png go unless --out says otherwise.
DEFAULT_OUT = "thunder_overlap_report"

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class UsageError(ValueError):
    """A bad command-line value; printed without a traceback."""


def _parse(argv: list[str]) -> argparse.Namespace:
    from thunder_overlap.analysis.cost_model import DEVICE_PROFILES, NETWORK_PROFILES

    parser = argparse.ArgumentParser(prog="python -m thunder_overlap report", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default="llama-2-7b", help=f"built-in {sorted(BUILTIN_MODELS)} or a litgpt config name (default: llama-2-7b)"
    )
    parser.add_argument("--n-layer", type=int, default=None, help="override the number of transformer layers")
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--sharding", default="zero3", help=f"{' or '.join(ShardingStrategy.names())} (default: zero3)")
    parser.add_argument("--bucketing", default="none", help=f"{', '.join(BucketingStrategy.names())} (default: none)")
    parser.add_argument("--device-profile", default="h100", help=f"one of {sorted(DEVICE_PROFILES)}")
    parser.add_argument(
        "--network",
        default="auto",
        help=(
            f"auto (nvlink up to 8 ranks, else infiniband), {sorted(NETWORK_PROFILES)}, "
            "or custom:<latency_us>:<GB/s>[:ring|tree[:<concurrent launches>]]"
        ),
    )
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPES), help="parameter and activation dtype")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=None, help="default: the model's block size")
    parser.add_argument(
        "--out", default=DEFAULT_OUT, help=f"directory for report.json, report.trace.json and report.png (default: ./{DEFAULT_OUT})"
    )
    parser.add_argument("--steps", type=int, default=0, help="also print the first N rows of the per-step table")
    parser.add_argument(
        "--compare-policies",
        action="store_true",
        help="also schedule with every policy (stock, just_in_time, heuristic, greedy, memory_aware) and print them side by side",
    )
    args = parser.parse_args(argv)
    if not 1 <= args.world_size <= MAX_WORLD_SIZE:
        raise UsageError(f"--world-size {args.world_size} is impossible; accepted: 1 to {MAX_WORLD_SIZE} ranks")
    if args.n_layer is not None and args.n_layer < 1:
        raise UsageError(f"--n-layer {args.n_layer} is impossible; a model needs at least 1 layer")
    if args.batch_size < 1:
        raise UsageError(f"--batch-size {args.batch_size} must be at least 1")
    try:
        args.sharding = parse_sharding_strategy(args.sharding, flag="--sharding")
        args.bucketing = parse_bucketing_strategy(args.bucketing, flag="--bucketing")
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.network == "auto":
        args.network = default_network(args.world_size)
    return args


class _Heartbeat:
    """Prints elapsed time every ``HEARTBEAT_S`` seconds while a long step runs."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True)

    def _beat(self) -> None:
        start = time.perf_counter()
        while not self._stop.wait(HEARTBEAT_S):
            print(f"  ... {self.what}: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)

    def __enter__(self) -> _Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """Runs the report command; returns the process exit status."""
    from thunder_overlap.analysis.cost_model import CostModel
    from thunder_overlap.config import OverlapConfig
    from thunder_overlap.report.policies import compare_policies
    from thunder_overlap.report.report import report
    from thunder_overlap.report.thunder_baseline import thunder_fsdp_baseline

    argv = sys.argv[1:] if argv is None else argv
    try:
        args = _parse(argv)
        cost_model = CostModel.named(args.device_profile, args.network)
        spec = model_recipe(args.model, args.n_layer)
        seq_len = args.seq_len or spec.block_size
        if not 1 <= seq_len <= spec.block_size:
            raise UsageError(f"--seq-len {seq_len} must be between 1 and the model's block size {spec.block_size}")
    except ValueError as e:  # UsageError, UnknownModelError, an unknown profile or network
        print(f"error: {e}", file=sys.stderr)
        return 2

    start = time.perf_counter()
    _progress(f"building {args.model} ({args.n_layer or 'all'} layers) on the meta device")
    with torch.device("meta"):
        model = spec.build().to(_DTYPES[args.dtype])
    layers = args.n_layer or "all"
    _progress(f"tracing forward and backward at world size {args.world_size}, {args.sharding} (about 5 s per layer, {layers} layers)")
    with _Heartbeat("tracing"):
        jm = trace_model(
            model,
            world_size=args.world_size,
            sharding=args.sharding,
            bucketing=args.bucketing,
            idx_shape=(args.batch_size, seq_len),
            config=OverlapConfig(cost_model=cost_model),
        )
        traced = time.perf_counter()
        _progress(f"traced in {traced - start:.1f} s; tracing the same model with Thunder's own FSDP, the baseline")
        thunder_fsdp = thunder_fsdp_baseline(jm)
    baseline_traced = time.perf_counter()
    _progress(f"traced in {baseline_traced - traced:.1f} s; simulating with {args.device_profile} / {args.network}")
    result = report(jm, cost_model=cost_model, thunder_fsdp=thunder_fsdp)
    _progress(f"analysed in {time.perf_counter() - baseline_traced:.2f} s")

    print(result)
    if args.bucketing is BucketingStrategy.AUTO:
        from thunder_overlap.transforms import BucketingTransform

        # Which buckets the cost model chose for this world size and network, and why.
        print(BucketingTransform.of(jm).summaries["plan"])
    if args.steps:
        print(result["forward"].step_table(max_rows=args.steps))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result.to_json(out / "report.json")
    result.to_chrome_trace(out / "report.trace.json")
    written = ["report.json", "report.trace.json"]
    if args.compare_policies:
        config = OverlapConfig(cost_model=cost_model)
        comparison = compare_policies(jm, cost_model=cost_model, config=config, thunder_fsdp=thunder_fsdp)
        print(comparison)
        comparison.to_json(out / "policies.json")
        written.append("policies.json")
    try:
        result.to_png(out / "report.png")
        written.append("report.png")
    except RuntimeError as e:  # no matplotlib: the text and JSON are still useful
        _progress(f"skipped the PNG: {e}")
    _progress(f"wrote {', '.join(w for w in written)} to {out.resolve()}{' (the default --out)' if args.out == DEFAULT_OUT else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
