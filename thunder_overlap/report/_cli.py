"""``python -m thunder_overlap report``: predicted overlap and memory at any world size, no GPU.

The model is built on the meta device and traced (never run) in one process that pretends to be
rank 0 of ``--world-size`` ranks through PyTorch's ``fake`` process group, so a 1024-rank
Llama-2-7B report needs neither GPUs nor memory for the weights. The same model is traced twice:
with thunder_overlap's FSDP and with Thunder's own (the baseline). Thunder's tracing dominates the
run time (about 5 s per transformer layer and FSDP here); a heartbeat shows it is still going.

``--shard-group-size N`` predicts hybrid sharding (HSDP): a 2-D device mesh (world / N replicas,
shard groups of N consecutive ranks) passed to ``thunder_overlap.fsdp``. With ``--network auto``
each process group is costed on its own network: NVLink when its ranks lie in one node of
``--gpus-per-node`` consecutive ranks, InfiniBand when they span nodes.

Arguments are parsed and checked before torch or Thunder is imported: ``--help`` and every usage
error answer at once.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import threading
import time
from pathlib import Path

# Each of these imports neither torch nor Thunder.
from thunder_overlap._analysis.devices import DEVICE_PROFILES, device_profile
from thunder_overlap._analysis.network import DEFAULT_GPUS_PER_NODE, NETWORK_PROFILES, NodeTopology, network_profile
from thunder_overlap.options import (
    BucketingStrategy,
    ShardingStrategy,
    own_dtype_reducers,
    parse_bucketing_strategy,
    parse_sharding_strategy,
    reduce_dtypes_for,
)
from thunder_overlap.report._models import BUILTIN_MODELS

__all__ = ["DEFAULT_OUT", "main"]

# The fake process group takes any size; beyond this no FSDP job exists and shards get silly.
MAX_WORLD_SIZE = 1 << 20
# Seconds between progress lines while Thunder traces.
HEARTBEAT_S = 15.0
# Where report.json, report.trace.json and report.png go unless --out says otherwise.
DEFAULT_OUT = "thunder_overlap_report"

# --dtype, --param-dtype, --reduce-dtype: torch dtype names (looked up once torch is imported),
# and their short spellings.
DTYPES = ("bfloat16", "float16", "float32")
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
AUTO_NETWORK = "auto"
CUSTOM_NETWORK = "custom:<latency_us>:<GB/s>[:ring|tree[:<concurrent launches>]]"


class UsageError(ValueError):
    """A bad command-line value; printed without a traceback."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m thunder_overlap report", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default="llama-2-7b", help=f"built-in {sorted(BUILTIN_MODELS)} or a litgpt config name (default: llama-2-7b)"
    )
    parser.add_argument("--n-layer", type=int, default=None, help="override the number of transformer layers")
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument(
        "--shard-group-size",
        type=int,
        default=None,
        help="hybrid sharding (HSDP): shard within groups of N consecutive ranks and all-reduce gradients across the "
        "world-size / N replicas; N must divide --world-size (default: shard over the whole world)",
    )
    parser.add_argument(
        "--gpus-per-node",
        type=int,
        default=DEFAULT_GPUS_PER_NODE,
        help=f"consecutive ranks per node, for --network auto (default: {DEFAULT_GPUS_PER_NODE})",
    )
    parser.add_argument(
        "--sharding", default="zero3", help=f"{', '.join(ShardingStrategy.names()[:-1])} or {ShardingStrategy.names()[-1]} (default: zero3)"
    )
    parser.add_argument(
        "--memory-budget",
        default=None,
        help="per-rank budget on a step's predicted peak, e.g. 60GiB or 512MiB (bytes without a unit); "
        "needed by --sharding auto, which keeps as many blocks unsharded as it allows",
    )
    parser.add_argument("--bucketing", default="none", help=f"{', '.join(BucketingStrategy.names())} (default: none)")
    parser.add_argument("--device-profile", default="h100", help=f"one of {sorted(DEVICE_PROFILES)}")
    parser.add_argument(
        "--network",
        default=AUTO_NETWORK,
        help=(
            f"{AUTO_NETWORK} (each process group over nvlink when its ranks lie in one node, else infiniband), "
            f"{sorted(NETWORK_PROFILES)}, or {CUSTOM_NETWORK} for every group"
        ),
    )
    dtypes = f"{', '.join(DTYPES)} or {', '.join(DTYPE_ALIASES)}"
    parser.add_argument(
        "--dtype", default=None, help=f"the model's parameter dtype: {dtypes} (default: bfloat16; float32 with --param-dtype)"
    )
    parser.add_argument(
        "--param-dtype",
        default=None,
        help="mixed precision (MixedPrecision): the dtype parameters are gathered and computed in (default: --dtype, no cast)",
    )
    parser.add_argument(
        "--reduce-dtype", default=None, help="mixed precision: the dtype gradients are reduced in (default: --dtype, no cast)"
    )
    parser.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="every block keeps only its inputs and recomputes its activations in the backward",
    )
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
    return parser


def _parse(argv: list[str]) -> argparse.Namespace:
    """The command line's options, each checked, naming a bad value and what is accepted."""
    args = _parser().parse_args(argv)
    _check_sizes(args)
    _check_profiles(args)
    try:
        args.sharding = parse_sharding_strategy(args.sharding, flag="--sharding")
        args.bucketing = parse_bucketing_strategy(args.bucketing, flag="--bucketing")
    except ValueError as e:
        raise UsageError(str(e)) from None
    _check_dtypes(args)
    args.memory_budget = _parse_bytes(args.memory_budget, "--memory-budget")
    if args.sharding is ShardingStrategy.AUTO and args.memory_budget is None:
        raise UsageError("--sharding auto needs --memory-budget (e.g. --memory-budget 60GiB): the budget it chooses within")
    # auto: a topology gives each process group its network; the default network (the one
    # bucket sizing and the report's header use) is the group parameters are sharded over's.
    args.topology = None
    if args.network == AUTO_NETWORK:
        args.topology = NodeTopology("nvlink", "infiniband", args.gpus_per_node)
        args.network = args.topology.network_of_ranks(range(args.shard_group_size or args.world_size)).name
    return args


_BYTE_UNITS = {"b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def _parse_bytes(text: str | None, flag: str) -> int | None:
    """``"60GiB"`` -> 64424509440; None stays None."""
    if text is None:
        return None
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or (unit and unit not in _BYTE_UNITS) or float(match.group(1)) * _BYTE_UNITS.get(unit, 1) < 1:
        raise UsageError(f"{flag} {text!r} is not a size; accepted: a positive number of bytes, or with a unit: 60GiB, 512MiB, 80GB")
    return int(float(match.group(1)) * _BYTE_UNITS.get(unit, 1))


def _check_sizes(args: argparse.Namespace) -> None:
    if not 1 <= args.world_size <= MAX_WORLD_SIZE:
        raise UsageError(f"--world-size {args.world_size} is impossible; accepted: 1 to {MAX_WORLD_SIZE} ranks")
    if args.n_layer is not None and args.n_layer < 1:
        raise UsageError(f"--n-layer {args.n_layer} is impossible; a model needs at least 1 layer")
    if args.gpus_per_node < 1:
        raise UsageError(f"--gpus-per-node {args.gpus_per_node} is impossible; accepted: 1 or more ranks per node")
    if args.shard_group_size is not None and (args.shard_group_size < 1 or args.world_size % args.shard_group_size):
        raise UsageError(
            f"--shard-group-size {args.shard_group_size} does not divide --world-size {args.world_size}; "
            f"accepted: a divisor of {args.world_size} ({_divisors(args.world_size)})"
        )
    if args.batch_size < 1:
        raise UsageError(f"--batch-size {args.batch_size} must be at least 1")
    if args.seq_len is not None and args.seq_len < 1:
        raise UsageError(f"--seq-len {args.seq_len} is impossible; accepted: 1 to the model's block size")
    if args.steps < 0:
        raise UsageError(f"--steps {args.steps} is impossible; accepted: 0 (no per-step table, the default) or more rows")


def _check_profiles(args: argparse.Namespace) -> None:
    try:
        device_profile(args.device_profile)
    except ValueError:
        accepted = ", ".join(sorted(DEVICE_PROFILES))
        raise UsageError(f"--device-profile: unknown device profile {args.device_profile!r}; accepted: {accepted}") from None
    if args.network != AUTO_NETWORK:
        try:
            network_profile(args.network)
        except ValueError:
            raise UsageError(
                f"--network: unknown network {args.network!r}; accepted: {AUTO_NETWORK} (the default), "
                f"{', '.join(sorted(NETWORK_PROFILES))}, or {CUSTOM_NETWORK} with latency >= 0, bandwidth > 0 "
                "and concurrent launches >= 1"
            ) from None


def _dtype_name(value: str | None, flag: str) -> str | None:
    if value is None:
        return None
    name = DTYPE_ALIASES.get(value, value)
    if name not in DTYPES:
        raise UsageError(f"{flag} {value!r} is not a dtype this report takes; accepted: {', '.join(DTYPES)} or {', '.join(DTYPE_ALIASES)}")
    return name


def _check_dtypes(args: argparse.Namespace) -> None:
    """Resolves the dtype names; a policy that would cast nothing, or reduce in less precision
    than it computes, is an error (MixedPrecision's own rule, checked here before torch loads)."""
    args.param_dtype = _dtype_name(args.param_dtype, "--param-dtype")
    args.reduce_dtype = _dtype_name(args.reduce_dtype, "--reduce-dtype")
    mixed = args.param_dtype is not None or args.reduce_dtype is not None
    args.dtype = _dtype_name(args.dtype, "--dtype") or ("float32" if mixed else "bfloat16")
    if mixed and {args.param_dtype, args.reduce_dtype} <= {None, args.dtype}:
        flags = (("--param-dtype", args.param_dtype), ("--reduce-dtype", args.reduce_dtype))
        given = " ".join(f"{flag} {value}" for flag, value in flags if value)
        raise UsageError(
            f"{given} casts nothing for parameters of --dtype {args.dtype}; give a dtype other than {args.dtype} "
            "(e.g. --param-dtype bf16 --dtype fp32), or no mixed precision"
        )
    gather = args.param_dtype or args.dtype
    reduce = args.reduce_dtype or args.dtype
    accepted = reduce_dtypes_for(gather)
    if reduce not in accepted:
        raise UsageError(
            f"--reduce-dtype {reduce} is not as wide as --param-dtype {gather}: gradients would be reduced in less precision "
            f"than they were computed in; accepted: {', '.join(accepted)}"
        )
    users = own_dtype_reducers(args.bucketing, hybrid=args.shard_group_size is not None, flags=True)
    if users and reduce != args.dtype:
        raise UsageError(
            f"--reduce-dtype {reduce} with {' and '.join(users)}: they reduce in the parameters' dtype "
            f"(--dtype {args.dtype}) for now; accepted: --reduce-dtype {args.dtype}"
            + (", or --bucketing none" if args.shard_group_size is None else "")
        )


def _divisors(n: int, shown: int = 12) -> str:
    """The divisors of ``n``, the first and last few of them when there are many."""
    divisors = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    divisors = sorted({*divisors, *(n // d for d in divisors)})
    if len(divisors) <= shown:
        return ", ".join(map(str, divisors))
    return f"{', '.join(map(str, divisors[: shown // 2]))}, ..., {', '.join(map(str, divisors[-shown // 2 :]))}"


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


def _topology_words(topology: NodeTopology) -> str:
    return f"{topology.intra_node.name} inside a node of {topology.gpus_per_node}, {topology.inter_node.name} across nodes"


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """Runs the report command; returns the process exit status."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = _parse(argv)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    # The arguments are sound: from here on torch and Thunder are needed.
    from thunder_overlap._analysis.cost_model import CostModel
    from thunder_overlap.report._models import model_recipe

    try:
        cost_model = CostModel.named(args.device_profile, args.network, topology=args.topology)
        spec = model_recipe(args.model, args.n_layer)
        seq_len = args.seq_len or spec.block_size
        if not 1 <= seq_len <= spec.block_size:
            raise UsageError(f"--seq-len {seq_len} must be between 1 and the model's block size {spec.block_size}")
    except ValueError as e:  # UsageError, UnknownModelError
        print(f"error: {e}", file=sys.stderr)
        return 2

    from thunder_overlap._scheduling.unsharding import MemoryBudgetTooSmall

    try:
        jm, result, comparison = _predict(args, spec, seq_len, cost_model)
    except MemoryBudgetTooSmall as e:  # a finding about the settings, not a failure of the command
        print(f"error: {e}", file=sys.stderr)
        return 1
    _write(args, jm, result, comparison)
    return 0


def _predict(args: argparse.Namespace, spec, seq_len: int, cost_model):
    """Traces the model with thunder_overlap and with Thunder's own FSDP on the meta device, and
    reports both (and every policy, with --compare-policies)."""
    import torch

    from thunder_overlap.config import OverlapConfig
    from thunder_overlap.report._models import trace_model
    from thunder_overlap.report._policies import compare_policies
    from thunder_overlap.report._report import report
    from thunder_overlap.report._thunder_baseline import fake_process_group, thunder_fsdp_baseline

    start = time.perf_counter()
    _progress(f"building {args.model} ({args.n_layer or 'all'} layers) on the meta device")
    from thunder_overlap.options import MixedPrecision

    with torch.device("meta"):
        model = spec.build().to(getattr(torch, args.dtype))
    policy = None
    if args.param_dtype is not None or args.reduce_dtype is not None:
        policy = MixedPrecision(*(getattr(torch, d) if d is not None else None for d in (args.param_dtype, args.reduce_dtype)))
    layers = args.n_layer or "all"
    hybrid = f", hybrid: {args.world_size // args.shard_group_size} replicas of {args.shard_group_size}" if args.shard_group_size else ""
    _progress(
        f"tracing forward and backward at world size {args.world_size}{hybrid}, {args.sharding} (about 5 s per layer, {layers} layers)"
    )
    networks = args.network if args.topology is None else _topology_words(args.topology)
    # One fake group for tracing and simulating: the topology reads each group's ranks.
    with fake_process_group(args.world_size):
        with _Heartbeat("tracing"):
            jm = trace_model(
                model,
                world_size=args.world_size,
                sharding=args.sharding,
                bucketing=args.bucketing,
                idx_shape=(args.batch_size, seq_len),
                config=OverlapConfig(cost_model=cost_model, memory_budget_bytes=args.memory_budget),
                shard_group_size=args.shard_group_size,
                mixed_precision=policy,
                activation_checkpointing=args.activation_checkpointing,
            )
            traced = time.perf_counter()
            _progress(f"traced in {traced - start:.1f} s; tracing the same model with Thunder's own FSDP, the baseline")
            thunder_fsdp = thunder_fsdp_baseline(jm)
        baseline_traced = time.perf_counter()
        _progress(f"traced in {baseline_traced - traced:.1f} s; simulating with {args.device_profile} / {networks}")
        result = report(jm, cost_model=cost_model, thunder_fsdp=thunder_fsdp)
        _progress(f"analysed in {time.perf_counter() - baseline_traced:.2f} s")
        comparison = None
        if args.compare_policies:
            config = OverlapConfig(cost_model=cost_model, memory_budget_bytes=args.memory_budget)
            comparison = compare_policies(jm, cost_model=cost_model, config=config, thunder_fsdp=thunder_fsdp)

    return jm, result, comparison


def _write(args: argparse.Namespace, jm, result, comparison) -> None:
    """Prints the report (and the auto plan, the step table, the policies) and writes its files."""
    print(result)
    if args.bucketing is BucketingStrategy.AUTO:
        from thunder_overlap._transforms import BucketingTransform

        # Which buckets the cost model chose for this world size and network, and why; and
        # whether the first compile ran block buckets instead ([Note: auto against block]).
        summaries = BucketingTransform.of(jm).summaries
        print(summaries.plan)
        if summaries.plan_choice is not None:
            print(summaries.plan_choice)
    if args.steps:
        print(result["forward"].step_table(max_rows=args.steps))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result.to_json(out / "report.json")
    result.to_chrome_trace(out / "report.trace.json")
    written = ["report.json", "report.trace.json"]
    if comparison is not None:
        print(comparison)
        comparison.to_json(out / "policies.json")
        written.append("policies.json")
    try:
        result.to_png(out / "report.png")
        written.append("report.png")
    except RuntimeError as e:  # no matplotlib: the text and JSON are still useful
        _progress(f"skipped the PNG: {e}")
    _progress(f"wrote {', '.join(w for w in written)} to {out.resolve()}{' (the default --out)' if args.out == DEFAULT_OUT else ''}")


if __name__ == "__main__":
    sys.exit(main())
