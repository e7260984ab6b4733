"""Block buckets against none, per sharding, from benchmark_fsdp.py JSONs (gpu_ws1.sh's table).

The peak difference is counted in block-sized buffers (the largest bucket pool buffer of the block
run): issue 17's target is at most one, at a step time within 2% of none's.

    python benchmarks/ws1_table.py results/*.json
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("jsons", nargs="+", type=Path)
    print(table(load_results(parser.parse_args(argv).jsons)))


if __name__ == "__main__":
    main()
