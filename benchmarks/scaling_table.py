"""How the predicted step scales with the world size: Llama-2 shapes on 8 to 1024 H100s.

For every world size (NVLink inside one node, InfiniBand beyond), sharding and bucketing strategy,
traces the model on the meta device over a fake process group and predicts one training step
(forward + backward) for three orders of the same collectives:

- ``thunder 0.2.6``: the traces Thunder's own FSDP produces (one per world size and sharding;
  its bucketing flags change nothing, so it has no bucketing of its own);
- ``stock``: Thunder's order of thunder_overlap's collectives with these buckets;
- ``memory_aware``: thunder_overlap's schedule (the default).

Columns: predicted step, the bound max(C, M) (the busier of compute and the busiest
communication stream, summed over both passes), the gap between them, the predicted peak
against the just-in-time order's, and whether the peak stays within the memory budget. About
40 s of tracing per setting for 8 layers of Llama-2-7B; the whole table takes about half an hour.

    python benchmarks/scaling_table.py --out benchmarks/measured/scaling/scaling.md \\
        --json benchmarks/measured/scaling/scaling.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from thunder_overlap import CostModel, OverlapConfig
from thunder_overlap.analysis.cost_model import default_network
from thunder_overlap.report.models import BUILTIN_MODELS, trace_model
from thunder_overlap.report.policies import PolicyComparison, compare_policies
from thunder_overlap.report.report import BASELINE
from thunder_overlap.report.thunder_baseline import trace_thunder_fsdp

WORLD_SIZES = (8, 64, 256, 1024)
BUCKETINGS = ("none", "layer", "block", "auto")
ORDERS = ("stock", "memory_aware")
# The targets for memory_aware with auto buckets: within 10% of its own max(C, M) at
# every world size and within 3% on one NVLink node.
GAP_TARGET, GAP_TARGET_ONE_NODE = 0.10, 0.03
_GIB = 2**30


@dataclass(frozen=True)
class ScalingRow:
    model: str
    world_size: int
    network: str
    sharding: str
    bucketing: str  # "-" for Thunder's own FSDP
    order: str
    step_ms: float
    bound_ms: float
    peak_bytes: int
    just_in_time_peak_bytes: int | None
    # Whether every pass's predicted peak is within the memory budget the scheduler applies (the
    # just-in-time peak of the same pass plus the slack); None for orders without a budget.
    within_budget: bool | None

    @property
    def gap(self) -> float:
        return self.step_ms / self.bound_ms - 1 if self.bound_ms else 0.0

    @property
    def peak_vs_just_in_time(self) -> float | None:
        return self.peak_bytes / self.just_in_time_peak_bytes - 1 if self.just_in_time_peak_bytes else None

    def markdown(self) -> str:
        vs_jit = "" if self.peak_vs_just_in_time is None else f"{self.peak_vs_just_in_time:+.1%}"
        budget = {None: "", True: "yes", False: "**no**"}[self.within_budget]
        return (
            f"| {self.model} | {self.world_size}, {self.network} | {self.sharding} | {self.bucketing} | {self.order} "
            f"| {self.step_ms:.1f} | {self.bound_ms:.1f} | {self.gap:.1%} | {self.peak_bytes / _GIB:.2f} | {vs_jit} | {budget} |"
        )


HEADER = (
    "| model | world size, network | sharding | bucketing | order | predicted step ms | max(C,M) ms | gap "
    "| peak GiB | peak vs just-in-time | within budget |\n|---|---|---|---|---|---|---|---|---|---|---|"
)


def _order_row(comparison: PolicyComparison, order: str, config: OverlapConfig, **setting) -> ScalingRow:
    results = [r for r in comparison.results if r.policy == order]
    just_in_time = [r for r in comparison.results if r.policy == "just_in_time"] if order != BASELINE else []
    budget = config.limits(None).memory_budget if order == "memory_aware" else None
    within_budget = None
    if budget is not None:
        within_budget = all(
            r.report.peak_bytes <= budget.budget(comparison.result("just_in_time", r.pass_name).report.peak_bytes) for r in results
        )
    return ScalingRow(
        **setting,
        order=order,
        step_ms=sum(r.report.predicted_ms for r in results),
        bound_ms=sum(r.report.bound_ms for r in results),
        peak_bytes=max(r.report.peak_bytes for r in results),
        just_in_time_peak_bytes=max((r.report.peak_bytes for r in just_in_time), default=None),
        within_budget=within_budget,
    )


def measure_setting(
    model_name: str, n_layer: int, seq_len: int, world_size: int, sharding: str, device_profile: str, bucketings: tuple[str, ...]
) -> list[ScalingRow]:
    """Every row of one model, world size and sharding: Thunder's own FSDP, then each bucketing."""
    network = default_network(world_size)
    cost_model = CostModel.named(device_profile, network)
    recipe = BUILTIN_MODELS[model_name](n_layer)
    setting = {"model": f"{model_name} x{n_layer}", "world_size": world_size, "network": network, "sharding": sharding}
    rows = []
    with torch.device("meta"):
        model = recipe.build().to(torch.bfloat16)
        idx = torch.zeros((1, seq_len), dtype=torch.long)
    # Thunder's own traces do not depend on the bucketing asked for: trace them once.
    thunder_fsdp = trace_thunder_fsdp(model, world_size=world_size, sharding=sharding, args=(idx,))
    for bucketing in bucketings:
        start = time.perf_counter()
        with torch.device("meta"):
            model = recipe.build().to(torch.bfloat16)
        config = OverlapConfig(cost_model=cost_model)
        jm = trace_model(model, world_size=world_size, sharding=sharding, bucketing=bucketing, idx_shape=(1, seq_len), config=config)
        comparison = compare_policies(jm, cost_model=cost_model, config=config, policies=ORDERS, thunder_fsdp=thunder_fsdp)
        if bucketing == bucketings[0]:
            rows.append(_order_row(comparison, BASELINE, config, **setting, bucketing="-"))
        rows += [_order_row(comparison, order, config, **setting, bucketing=bucketing) for order in ORDERS]
        print(f"{model_name} {world_size} {sharding} {bucketing}: {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return rows


def target_checks(rows: list[ScalingRow]) -> list[str]:
    """The issue's targets, one line each, for every model, world size and sharding."""
    lines = []
    settings = sorted({(r.model, r.world_size, r.sharding) for r in rows}, key=lambda s: (s[0], s[1], s[2]))
    for model, world_size, sharding in settings:
        group = [r for r in rows if (r.model, r.world_size, r.sharding) == (model, world_size, sharding)]
        auto = next((r for r in group if (r.bucketing, r.order) == ("auto", "memory_aware")), None)
        if auto is None:
            continue
        others = [r for r in group if r is not auto and (r.order != "memory_aware" or r.bucketing != "auto")]
        best = min(others, key=lambda r: r.step_ms)
        gap_target = GAP_TARGET_ONE_NODE if world_size <= 8 else GAP_TARGET
        best_words = f"{best.order} {best.bucketing}: {best.step_ms:.1f} ms"
        checks = [
            (auto.step_ms <= best.step_ms * 1.0001, f"no slower than the best other row ({best_words})"),
            (auto.gap <= gap_target, f"gap {auto.gap:.1%} <= {gap_target:.0%}"),
            (auto.within_budget is not False, "peak within the memory budget"),
        ]
        verdicts = "; ".join(f"{'ok' if passed else 'MISSED'}: {what}" for passed, what in checks)
        lines.append(f"{model} {world_size} ranks {sharding}, memory_aware auto {auto.step_ms:.1f} ms: {verdicts}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-layer", type=int, default=8, help="layers of Llama-2-7B")
    parser.add_argument("--n-layer-70b", type=int, default=2, help="layers of the Llama-2-70B row at 1024 ranks (0: none)")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=list(WORLD_SIZES))
    parser.add_argument("--sharding", nargs="+", default=["zero2", "zero3"])
    parser.add_argument("--bucketing", nargs="+", default=list(BUCKETINGS))
    parser.add_argument("--device-profile", default="h100")
    parser.add_argument("--out", default=None, help="also write the table to this markdown file")
    parser.add_argument("--json", default=None, help="also write every row's raw figures to this JSON file")
    args = parser.parse_args(argv)

    rows: list[ScalingRow] = []
    for world_size in args.world_sizes:
        for sharding in args.sharding:
            rows += measure_setting("llama-2-7b", args.n_layer, args.seq_len, world_size, sharding, args.device_profile, args.bucketing)
    if args.n_layer_70b:
        rows += measure_setting("llama-2-70b", args.n_layer_70b, args.seq_len, 1024, "zero3", args.device_profile, args.bucketing)
    text = "\n".join([HEADER, *(r.markdown() for r in rows), "", *target_checks(rows)])
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
