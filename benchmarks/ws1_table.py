"""World-size-1 tables from benchmark_fsdp.py JSONs.

Block buckets against none, per sharding (gpu_ws1.sh's table): the peak difference is counted in
block-sized buffers (the largest bucket pool buffer of the block run), at most one, at a step time
within 2% of none's. With ``--against IMPL``, every run against that implementation's run of the
same sharding instead, step and peak side by side (gpu_compile_ws1.sh's table).

    python benchmarks/ws1_table.py results/*.json
    python benchmarks/ws1_table.py results/*.json --against fsdp2_compile
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fsdp_bench.results import load_results  # noqa: E402

MIB = 2**20
MAX_BLOCK_BUFFERS = 1.0  # bucketed peak over unbucketed, in block-sized buffers
MAX_SLOWDOWN = 0.02  # bucketed median step over unbucketed, minus one


def table(results: list[dict]) -> str:
    runs = {(r["shard_mode"], r["bucketing_mode"]): r for r in results}
    lines = [
        "| sharding | bucketing | median ms | peak MiB | pool buffers | peak over none, block buffers | step vs none |",
        "|---|---|---|---|---|---|---|",
    ]
    for shard in sorted({shard for shard, _ in runs}, reverse=True):
        none = runs.get((shard, "none"))
        for bucketing in ("none", "block", "layer"):
            run = runs.get((shard, bucketing))
            if run is None:
                continue
            pool = run.get("bucket_pool_bytes", [])
            over = ratio = ""
            if none is not None and run is not none and pool:
                block_buffer = max(pool)
                buffers = (run["peak_memory_bytes"] - none["peak_memory_bytes"]) / block_buffer
                slowdown = run["median_iter_time_ms"] / none["median_iter_time_ms"] - 1
                over = f"{buffers:+.2f} ({'met' if buffers <= MAX_BLOCK_BUFFERS else 'missed'})"
                ratio = f"{slowdown:+.1%} ({'met' if slowdown <= MAX_SLOWDOWN else 'missed'})"
            lines.append(
                f"| {shard} | {bucketing} | {run['median_iter_time_ms']:.1f} | {run['peak_memory_bytes'] / MIB:.0f} "
                f"| {len(pool) or '-'} | {over} | {ratio} |"
            )
    return "\n".join(lines)


def side_by_side(results: list[dict], against: str) -> str:
    """Each run's median step and peak, and both as ratios to ``against``'s run of its sharding."""
    baselines = {r["shard_mode"]: r for r in results if r["impl"] == against}
    lines = [
        f"| sharding | impl | executors | bucketing | median ms | peak MiB | step vs {against} | peak vs {against} |",
        "|---|---|---|---|---|---|---|---|",
    ]
    # ZeRO3 before ZeRO2 (as table()), the baseline first within each; sorts are stable.
    rows = sorted(results, key=lambda r: (r["impl"] != against, r["impl"], r.get("executors", "default"), r["bucketing_mode"]))
    for run in sorted(rows, key=lambda r: r["shard_mode"], reverse=True):
        base = baselines.get(run["shard_mode"])
        step = peak = "-"
        if base is not None:
            step = f"{run['median_iter_time_ms'] / base['median_iter_time_ms']:.3f}x"
            peak = f"{run['peak_memory_bytes'] / base['peak_memory_bytes']:.3f}x"
        lines.append(
            f"| {run['shard_mode']} | {run['impl']} | {run.get('executors', 'default')} | {run['bucketing_mode']} "
            f"| {run['median_iter_time_ms']:.1f} | {run['peak_memory_bytes'] / MIB:.0f} | {step} | {peak} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("jsons", nargs="+", type=Path)
    parser.add_argument("--against", metavar="IMPL", help="compare every run with this implementation's run of its sharding")
    args = parser.parse_args(argv)
    results = load_results(args.jsons)
    print(table(results) if args.against is None else side_by_side(results, args.against))


if __name__ == "__main__":
    main()
