"""Every scheduling policy side by side on Llama-2-7B shapes, as a markdown table.

For each world size (with its network), sharding and bucketing strategy, traces the model once
on the meta device over a fake process group and compares the policies with
:func:`thunder_overlap.report._policies.compare_policies` (the same numbers as
``python -m thunder_overlap report --compare-policies``), with Thunder's own FSDP of the same
model as the first row of each pass (traced by ``compare_policies``). About 80 s of tracing per
setting for 8 layers.

    python benchmarks/policy_table.py --n-layer 8 --bucketing none block \\
        --out benchmarks/measured/policies/policies.md --json benchmarks/measured/policies/policies.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from thunder_overlap import CostModel, OverlapConfig
from thunder_overlap.report._builtin_models import Llama, LlamaConfig
from thunder_overlap.report._models import trace_model
from thunder_overlap.report._policies import PolicyComparison, compare_policies

# (world size, network): one NVLink node, and 8 nodes over InfiniBand.
SETTINGS = ((8, "nvlink"), (64, "infiniband"))
HEADER = (
    "| world size, network | sharding | bucketing | pass | policy | hidden/hideable | predicted ms "
    "| max(C,M) ms | gap | peak GiB | vs just-in-time |\n|---|---|---|---|---|---|---|---|---|---|---|"
)


def table_rows(comparison: PolicyComparison, network: str, sharding: str, bucketing: str) -> list[str]:
    rows = []
    for r in comparison.results:
        o = r.report
        rows.append(
            f"| {comparison.world_size}, {network} | {sharding} | {bucketing} | {r.pass_name} | {r.policy} | "
            f"{o.hidden}/{o.hideable} | {o.predicted_ms:.1f} | {o.bound_ms:.1f} | {r.bound_gap:.1%} | "
            f"{o.peak_bytes / 2**30:.2f} | {comparison.peak_over_just_in_time(r):+.1%} |"
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--device-profile", default="h100")
    parser.add_argument("--sharding", nargs="+", default=["zero2", "zero3"])
    parser.add_argument("--bucketing", nargs="+", default=["none"])
    parser.add_argument("--out", default=None, help="also write the table to this markdown file")
    parser.add_argument("--json", default=None, help="also write every comparison's raw figures to this JSON file")
    args = parser.parse_args(argv)

    lines = [HEADER]
    raw = []
    for world_size, network in SETTINGS:
        cost_model = CostModel.named(args.device_profile, network)
        for sharding in args.sharding:
            for bucketing in args.bucketing:
                start = time.perf_counter()
                with torch.device("meta"):
                    model = Llama(replace(LlamaConfig(), n_layer=args.n_layer)).to(torch.bfloat16)
                config = OverlapConfig(cost_model=cost_model)
                jm = trace_model(
                    model, world_size=world_size, sharding=sharding, bucketing=bucketing, idx_shape=(1, args.seq_len), config=config
                )
                comparison = compare_policies(jm, cost_model=cost_model, config=config)
                lines += table_rows(comparison, network, sharding, bucketing)
                raw.append({"sharding": sharding, "bucketing": bucketing, "n_layer": args.n_layer, **comparison.to_json()})
                print(f"{world_size} {network} {sharding} {bucketing}: {time.perf_counter() - start:.0f} s", file=sys.stderr)
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(raw, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
