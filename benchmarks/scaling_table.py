"""How the predicted step scales with the world size: Llama-2 shapes on 8 to 1024 H100s.

For every world size (NVLink inside one node, InfiniBand beyond), sharding and bucketing strategy,
traces the model on the meta device over a fake process group and predicts one training step
(forward + backward) for three orders of the same collectives:

- ``thunder 0.2.6``: the traces Thunder's own FSDP produces (one per world size and sharding;
  its bucketing flags change nothing, so it has no bucketing of its own);
- ``stock``: Thunder's order of thunder_overlap's collectives with these buckets;
- ``memory_aware``: thunder_overlap's schedule (the default).

``--precisions`` adds rows of other dtypes beside the default ``bf16`` (a bfloat16 model):
``fp32`` (a float32 model) and ``bf16/fp32`` (float32 masters with
``MixedPrecision(bfloat16, float32)``: bfloat16 all-gathers and compute, float32 reduce-scatters).
Thunder's own FSDP row of a mixed-precision setting is its float32 model's (it has no mixed
precision).

With ``--shard-group-sizes 8``, every world size also gets hybrid sharding (HSDP) rows: a 2-D
device mesh (world / 8 replicas, shard groups of 8 consecutive ranks, one node each), the
all-gathers and reduce-scatters over NVLink inside the node and each reduced gradient shard
all-reduced across the replicas over InfiniBand. Every group is costed on its own network
(``NodeTopology``: NVLink inside a node of 8, InfiniBand across nodes), which for plain FSDP is
the network of its world size. Thunder's own FSDP has no hybrid sharding: its row is the
full-world one.

Columns: predicted step, the bound max(C, M) (the busier of compute and the busiest
communication stream, summed over both passes), the gap between them, the predicted peak
against the just-in-time order's, and whether the peak stays within the memory budget. About
40 s of tracing per setting for 8 layers of Llama-2-7B; the whole table takes about half an hour.

    python benchmarks/scaling_table.py --out benchmarks/measured/scaling/scaling.md \\
        --json benchmarks/measured/scaling/scaling.json
    python benchmarks/scaling_table.py --world-sizes 1024 --sharding zero3 --bucketing none block auto \\
        --shard-group-sizes 8 --n-layer-70b 0 --out benchmarks/measured/hsdp/hsdp.md --json benchmarks/measured/hsdp/hsdp.json
    python benchmarks/scaling_table.py --world-sizes 64 1024 --sharding zero3 --bucketing block auto --precisions fp32 bf16/fp32 \\
        --n-layer-70b 0 --out benchmarks/measured/mixed_precision/scaling.md --json benchmarks/measured/mixed_precision/scaling.json
    python benchmarks/scaling_table.py --world-sizes 64 1024 --sharding zero2 zero3 auto --bucketing block auto \\
        --memory-budgets-gib 80 25 --n-layer-70b 0 --out benchmarks/measured/selective_unsharding/scaling.md \\
        --json benchmarks/measured/selective_unsharding/scaling.json

Sharding ``auto`` gets one setting per ``--memory-budgets-gib`` (its per-rank budget); its rows
say how many units it kept unsharded to the backward.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from thunder_overlap import CostModel, MixedPrecision, OverlapConfig
from thunder_overlap._analysis.network import NodeTopology
from thunder_overlap._scheduling.limits import resolve_limits
from thunder_overlap._transforms.zero3 import Zero3Transform
from thunder_overlap.config import Tuning
from thunder_overlap.report._models import BUILTIN_MODELS, trace_model
from thunder_overlap.report._policies import PolicyComparison, compare_policies
from thunder_overlap.report._report import BASELINE
from thunder_overlap.report._thunder_baseline import ThunderFSDPTraces, fake_process_group, trace_thunder_fsdp

WORLD_SIZES = (8, 64, 256, 1024)
BUCKETINGS = ("none", "layer", "block", "auto")
ORDERS = ("stock", "memory_aware")
# The targets for memory_aware with auto buckets: within 10% of its own max(C, M) at
# every world size and within 3% on one NVLink node.
GAP_TARGET, GAP_TARGET_ONE_NODE = 0.10, 0.03
# The mixed-precision issue's target: bf16/fp32 rows within this share of their own max(C, M).
MIXED_GAP_TARGET = 0.05
# --precisions: the model's dtype and the mixed-precision policy (param, reduce) of each.
PRECISIONS = {"bf16": ("bfloat16", None), "fp32": ("float32", None), "bf16/fp32": ("float32", ("bfloat16", "float32"))}
# The HSDP issue's target: hybrid sharding's best step at most this share of full-world FSDP's best.
HSDP_TARGET = 0.5
# NVLink inside a node of 8 GPUs, InfiniBand across nodes, per process group.
TOPOLOGY = NodeTopology("nvlink", "infiniband", 8)
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
    # Whether every pass's predicted peak is within the step's memory budget the scheduler applies
    # (the just-in-time step's peak plus the slack); None for orders without a budget.
    within_budget: bool | None
    # Hybrid sharding: ranks per shard group (world_size / shard_group_size replicas); None:
    # sharded over the whole world.
    shard_group_size: int | None = None
    # A key of PRECISIONS.
    precision: str = "bf16"
    # Sharding "auto": its per-rank budget and the units it kept unsharded ("5/10").
    memory_budget_bytes: int | None = None
    kept: str | None = None

    @property
    def layout(self) -> str:
        """The sharding strategy, and the mesh under hybrid sharding."""
        if self.memory_budget_bytes is not None:
            kept = f", kept {self.kept}" if self.kept is not None else ""
            return f"{self.sharding} {self.memory_budget_bytes / _GIB:g} GiB{kept}"
        if self.shard_group_size is None:
            return self.sharding
        return f"{self.sharding} HSDP {self.world_size // self.shard_group_size}x{self.shard_group_size}"

    @property
    def gap(self) -> float:
        return self.step_ms / self.bound_ms - 1 if self.bound_ms else 0.0

    @property
    def peak_vs_just_in_time(self) -> float | None:
        return self.peak_bytes / self.just_in_time_peak_bytes - 1 if self.just_in_time_peak_bytes else None

    def markdown(self) -> str:
        vs_jit = "" if self.peak_vs_just_in_time is None else f"{self.peak_vs_just_in_time:+.1%}"
        budget = {None: "", True: "yes", False: "**no**"}[self.within_budget]
        model = self.model if self.precision == "bf16" else f"{self.model} {self.precision}"
        return (
            f"| {model} | {self.world_size}, {self.network} | {self.layout} | {self.bucketing} | {self.order} "
            f"| {self.step_ms:.1f} | {self.bound_ms:.1f} | {self.gap:.1%} | {self.peak_bytes / _GIB:.2f} | {vs_jit} | {budget} |"
        )


HEADER = (
    "| model | world size, network | sharding | bucketing | order | predicted step ms | max(C,M) ms | gap "
    "| peak GiB | peak vs just-in-time | within budget |\n|---|---|---|---|---|---|---|---|---|---|---|"
)


def _order_row(comparison: PolicyComparison, order: str, config: OverlapConfig, **setting) -> ScalingRow:
    results = [r for r in comparison.results if r.policy == order]
    just_in_time = [r for r in comparison.results if r.policy == "just_in_time"] if order != BASELINE else []
    budget = resolve_limits(config, None).memory_budget if order == "memory_aware" else None
    within_budget = None
    if budget is not None:
        # The step's budget: relative to the just-in-time step's peak ([Note: the step's budget]).
        step_budget = budget.budget(max(r.report.peak_bytes for r in just_in_time))
        within_budget = all(r.report.peak_bytes <= step_budget for r in results)
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
    model_name: str,
    n_layer: int,
    seq_len: int,
    world_size: int,
    sharding: str,
    device_profile: str,
    bucketings: tuple[str, ...],
    shard_group_size: int | None = None,
    precision: str = "bf16",
    memory_budget_bytes: int | None = None,
    tuning: Tuning | None = None,
) -> list[ScalingRow]:
    """Every row of one model, world size, sharding (hybrid with ``shard_group_size``) and
    precision (a key of PRECISIONS): Thunder's own FSDP (full world only: it has no hybrid
    sharding), then each bucketing; thunder_overlap's rows under ``tuning``."""
    # The default network is the shard group's (bucket sizing reads it); each collective is
    # costed on its own group's network.
    network = TOPOLOGY.network_of_ranks(range(shard_group_size or world_size)).name
    cost_model = CostModel.named(device_profile, network, topology=TOPOLOGY)
    recipe = BUILTIN_MODELS[model_name](n_layer)
    networks = network if shard_group_size is None else f"{network}+{TOPOLOGY.inter_node.name}"
    setting = {"model": f"{model_name} x{n_layer}", "world_size": world_size, "network": networks, "sharding": sharding}
    if memory_budget_bytes is not None:
        setting["memory_budget_bytes"] = memory_budget_bytes
    dtype_name, policy_names = PRECISIONS[precision]
    dtype = getattr(torch, dtype_name)
    policy = MixedPrecision(*(getattr(torch, n) for n in policy_names)) if policy_names else None
    rows = []
    # One fake group for the whole setting: the topology reads each group's ranks while alive.
    with fake_process_group(world_size):
        with torch.device("meta"):
            model = recipe.build().to(dtype)
            idx = torch.zeros((1, seq_len), dtype=torch.long)
        # Thunder's own traces do not depend on the bucketing asked for: trace them once.
        # Thunder's ZERO3 for "auto" (Thunder has no such strategy; its ZERO3 runs as ZERO2).
        thunder_sharding = "zero3" if sharding == "auto" else sharding
        thunder_fsdp: ThunderFSDPTraces = trace_thunder_fsdp(model, world_size=world_size, sharding=thunder_sharding, args=(idx,))
        for bucketing in bucketings:
            start = time.perf_counter()
            with torch.device("meta"):
                model = recipe.build().to(dtype)
            config = OverlapConfig(cost_model=cost_model, memory_budget_bytes=memory_budget_bytes, _tuning=tuning or Tuning())
            jm = trace_model(
                model,
                world_size=world_size,
                sharding=sharding,
                bucketing=bucketing,
                idx_shape=(1, seq_len),
                config=config,
                shard_group_size=shard_group_size,
                mixed_precision=policy,
            )
            comparison = compare_policies(jm, cost_model=cost_model, config=config, policies=ORDERS, thunder_fsdp=thunder_fsdp)
            choice = Zero3Transform.of(jm).choice if Zero3Transform.of(jm) is not None else None
            kept = {"kept": f"{len(choice.kept)}/{len(choice.candidates)}"} if choice is not None else {}
            if bucketing == bucketings[0] and shard_group_size is None and sharding != "auto":
                rows.append(_order_row(comparison, BASELINE, config, **setting, bucketing="-", precision=precision))
            rows += [
                _order_row(
                    comparison,
                    order,
                    config,
                    **setting,
                    **kept,
                    bucketing=bucketing,
                    shard_group_size=shard_group_size,
                    precision=precision,
                )
                for order in ORDERS
            ]
            hybrid = f" HSDP shard {shard_group_size}" if shard_group_size else ""
            took = time.perf_counter() - start
            print(f"{model_name} {world_size} {sharding}{hybrid} {precision} {bucketing}: {took:.0f} s", file=sys.stderr)
    return rows


def target_checks(rows: list[ScalingRow]) -> list[str]:
    """The issue's targets, one line each, for every model, world size and sharding."""
    lines = []
    def key(r: ScalingRow) -> tuple:
        return r.model, r.world_size, r.sharding, r.shard_group_size or 0, r.precision, r.memory_budget_bytes or 0

    for setting in sorted({key(r) for r in rows}):
        group = [r for r in rows if key(r) == setting]
        model, world_size = setting[:2]
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
        precision = "" if auto.precision == "bf16" else f" {auto.precision}"
        lines.append(f"{model}{precision} {world_size} ranks {auto.layout}, memory_aware auto {auto.step_ms:.1f} ms: {verdicts}")
    return lines + hsdp_checks(rows) + mixed_precision_checks(rows) + unsharding_checks(rows)


def unsharding_checks(rows: list[ScalingRow]) -> list[str]:
    """For every sharding "auto" memory_aware row: its step and peak against ZeRO3's and ZeRO2's
    of the same model, world size and bucketing, and whether its peak is within its budget."""
    lines = []
    for auto in (r for r in rows if r.sharding == "auto" and r.order == "memory_aware"):
        same = {
            r.sharding: r
            for r in rows
            if r.order == "memory_aware"
            and (r.model, r.world_size, r.bucketing, r.precision) == (auto.model, auto.world_size, auto.bucketing, auto.precision)
        }
        zero2, zero3 = same.get("zero2"), same.get("zero3")
        if zero2 is None or zero3 is None:
            continue
        within = auto.peak_bytes <= auto.memory_budget_bytes
        lines.append(
            f"{auto.model} {auto.world_size} ranks {auto.layout} {auto.bucketing}: "
            f"{auto.step_ms:.1f} ms, peak {auto.peak_bytes / _GIB:.2f} GiB "
            f"({'ok' if within else 'MISSED'}: within the budget); ZeRO3 {zero3.step_ms:.1f} ms, {zero3.peak_bytes / _GIB:.2f} GiB; "
            f"ZeRO2 {zero2.step_ms:.1f} ms, {zero2.peak_bytes / _GIB:.2f} GiB"
        )
    return lines


def mixed_precision_checks(rows: list[ScalingRow]) -> list[str]:
    """For every bf16/fp32 memory_aware row: its gap to its own max(C, M) against the target, and
    its step against the fp32 row of the same setting."""
    lines = []

    def setting(r: ScalingRow) -> tuple:
        return r.model, r.world_size, r.sharding, r.shard_group_size, r.bucketing, r.order

    for mixed in (r for r in rows if r.precision == "bf16/fp32" and r.order == "memory_aware"):
        fp32 = next((r for r in rows if r.precision == "fp32" and setting(r) == setting(mixed)), None)
        against = "" if fp32 is None else f"; fp32 {fp32.step_ms:.1f} ms, ratio {mixed.step_ms / fp32.step_ms:.2f}"
        verdict = "ok" if mixed.gap <= MIXED_GAP_TARGET else "MISSED"
        lines.append(
            f"{mixed.model} bf16/fp32 {mixed.world_size} ranks {mixed.layout} {mixed.bucketing}: {mixed.step_ms:.1f} ms, "
            f"gap {mixed.gap:.1%} ({verdict}: <= {MIXED_GAP_TARGET:.0%}){against}"
        )
    return lines


def hsdp_checks(rows: list[ScalingRow]) -> list[str]:
    """For every hybrid setting: its best step (any bucketing, memory_aware) against the best
    full-world step of the same model, world size and sharding, and the peaks of both."""
    lines = []
    for hybrid in sorted({(r.model, r.world_size, r.sharding, r.shard_group_size) for r in rows if r.shard_group_size}):
        model, world_size, sharding, shard = hybrid
        same = [r for r in rows if (r.model, r.world_size, r.sharding) == (model, world_size, sharding) and r.order == "memory_aware"]
        hsdp = [r for r in same if r.shard_group_size == shard]
        full = [r for r in same if r.shard_group_size is None]
        if not hsdp or not full:
            continue
        best_hsdp, best_full = min(hsdp, key=lambda r: r.step_ms), min(full, key=lambda r: r.step_ms)
        ratio = best_hsdp.step_ms / best_full.step_ms
        lines.append(
            f"{model} {world_size} ranks {best_hsdp.layout}: best {best_hsdp.bucketing} {best_hsdp.step_ms:.1f} ms, "
            f"peak {best_hsdp.peak_bytes / _GIB:.2f} GiB; full-world {sharding} best {best_full.bucketing} "
            f"{best_full.step_ms:.1f} ms, peak {best_full.peak_bytes / _GIB:.2f} GiB; ratio {ratio:.2f} "
            f"({'ok' if ratio <= HSDP_TARGET else 'MISSED'}: <= {HSDP_TARGET})"
        )
    return lines


def _write(rows: list[ScalingRow], markdown_path: str | None, json_path: str | None) -> None:
    if markdown_path:
        Path(markdown_path).parent.mkdir(parents=True, exist_ok=True)
        Path(markdown_path).write_text("\n".join([HEADER, *(r.markdown() for r in rows), "", *target_checks(rows)]) + "\n")
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps([asdict(r) for r in rows], indent=1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-layer", type=int, default=8, help="layers of Llama-2-7B")
    parser.add_argument("--n-layer-70b", type=int, default=2, help="layers of the Llama-2-70B row at 1024 ranks (0: none)")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=list(WORLD_SIZES))
    parser.add_argument("--sharding", nargs="+", default=["zero2", "zero3"])
    parser.add_argument("--bucketing", nargs="+", default=list(BUCKETINGS))
    parser.add_argument(
        "--shard-group-sizes",
        type=int,
        nargs="*",
        default=[],
        help="also predict hybrid sharding with shard groups of these sizes (world sizes they divide, with replicas)",
    )
    parser.add_argument(
        "--memory-budgets-gib", type=float, nargs="+", default=[80.0], help="per-rank budgets of sharding auto, one setting each"
    )
    parser.add_argument("--precisions", nargs="+", default=["bf16"], choices=list(PRECISIONS), help="model dtypes and policies")
    parser.add_argument("--device-profile", default="h100")
    parser.add_argument(
        "--regather-all",
        action="store_true",
        help="ZeRO3 re-gathers every parameter, none kept where free (thunder_overlap_regather_all)",
    )
    parser.add_argument("--out", default=None, help="also write the table to this markdown file")
    parser.add_argument("--json", default=None, help="also write every row's raw figures to this JSON file")
    args = parser.parse_args(argv)

    rows: list[ScalingRow] = []
    settings = [
        ("llama-2-7b", args.n_layer, world_size, sharding, shard, precision, budget)
        for world_size in args.world_sizes
        for sharding in args.sharding
        for shard in (None, *(s for s in args.shard_group_sizes if s < world_size and world_size % s == 0))
        for precision in args.precisions
        for budget in ([int(b * _GIB) for b in args.memory_budgets_gib] if sharding == "auto" else [None])
    ]
    if args.n_layer_70b:
        settings.append(("llama-2-70b", args.n_layer_70b, 1024, "zero3", None, "bf16", None))
    for model_name, n_layer, world_size, sharding, shard, precision, budget in settings:
        rows += measure_setting(
            model_name,
            n_layer,
            args.seq_len,
            world_size,
            sharding,
            args.device_profile,
            args.bucketing,
            shard,
            precision,
            budget,
            Tuning(zero3_keeps_free_units=not args.regather_all),
        )
        # Written after every setting: a long run that stops keeps what it measured.
        _write(rows, args.out, args.json)
    print("\n".join([HEADER, *(r.markdown() for r in rows), "", *target_checks(rows)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
