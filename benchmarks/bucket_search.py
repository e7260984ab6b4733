"""The fastest bucketing the simulator finds for one setting, against the plan ``"auto"`` makes.

Traces the model once (meta device, fake process group, ``bucketing_strategy="auto"``) and takes
its forward and backward as they were before bucketing. A candidate bucketing cuts the parameters,
in first-use order, into contiguous runs of whole units: blocks and the modules outside them, or
with ``--units layer`` every module (so a block may be split anywhere between its layers). Each
candidate is laid out in buckets, both traces' collectives rewritten into them, scheduled as a
compile schedules them (``memory_aware``, within the step's budget) and the step simulated, as the
scaling table's rows are. ``--search all`` tries every bucketing (2^(units - 1)); ``--search climb``
starts from ``auto``'s plan (or ``--start``) and takes the fastest of the plans one boundary away
(moved by one unit, added or removed) until none is faster. Where ``auto``'s plan cuts inside the
units (a fast network splits blocks), it is compared as compiled and a climb needs ``--start``.

It answers two questions a row over its bound raises: how much faster than ``auto``'s plan any
bucketing of these units is predicted to be, and whether any bucketing brings the step within 5%
of its own max(compute, communication), or only by adding launches that make it slower.

Under ZeRO3 the units kept gathered to the backward stay as the ``auto`` compile chose them (the
re-gathers are in the traces before bucketing), so a candidate that would change that choice is
predicted with ``auto``'s. Each candidate's buckets reduce in the pool where the compile's path
choice would put them ([Note: bucket paths]); the fake group's backend has no other path to choose.

    python benchmarks/bucket_search.py --world-size 1024 --sharding zero2 --search all \\
        --json benchmarks/measured/bucket_search/llama-2-7b-x8_zero2_1024_blocks.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import thunder
import torch
import torch.nn as nn

from thunder_overlap import CostModel, MixedPrecision, OverlapConfig
from thunder_overlap._analysis.classify import classify_trace
from thunder_overlap._bucketing.module_plan import bucket_slots, make_buckets, unsharded_numel
from thunder_overlap._bucketing.path_choice import choose_bucket_paths
from thunder_overlap._bucketing.plan import bucket_owner, make_plan
from thunder_overlap._ops import BUCKETED_ISSUES
from thunder_overlap._scheduling.step_budget import schedule_step
from thunder_overlap._transforms.bucketing import BucketingTransform
from thunder_overlap.options import BucketingStrategy
from thunder_overlap.report._models import BUILTIN_MODELS, trace_model
from thunder_overlap.report._report import analyze_trace
from thunder_overlap.report._thunder_baseline import fake_process_group

sys.path.insert(0, str(Path(__file__).parent))
from scaling_table import PRECISIONS, TOPOLOGY  # noqa: E402

# The predicted rows' target (benchmarks/README.md): a step within this share of its own max(compute, communication).
GAP_TARGET = 0.05
_GIB = 2**30
# Most bucketings --search all evaluates: 2^14 at about a second each is already hours.
MOST_BUCKETINGS = 2**14


@dataclass(frozen=True)
class Candidate:
    """One bucketing: where each bucket starts (indices into the units) and its predicted step."""

    starts: tuple[int, ...]
    labels: tuple[str, ...]
    step_ms: float
    bound_ms: float
    peak_bytes: int

    @property
    def gap(self) -> float:
        return self.step_ms / self.bound_ms - 1


class Search:
    """The traced model and what evaluating one bucketing of it needs."""

    def __init__(
        self, jm, original: nn.Module, units: str, policy: MixedPrecision | None, config: OverlapConfig, cost_model: CostModel
    ) -> None:
        self.state = BucketingTransform.of(jm).state
        self.config, self.cost_model, self.policy = config, cost_model, policy
        self.forward = _before_bucketing(thunder.last_traces(jm))
        self.backward = _before_bucketing(thunder.last_backward_traces(jm))
        self.shards = list(jm.named_parameters())
        streams = {(shard.dtype, shard.requires_grad) for _, shard in self.shards}
        if len(streams) != 1:
            kinds = sorted(f"{dtype} {'trainable' if trainable else 'frozen'}" for dtype, trainable in streams)
            raise ValueError(f"the search cuts one stream of parameters (one dtype, all trainable); this model has {kinds}")
        block_names = [name for name, _ in self.state.blocks]
        strategy = BucketingStrategy.LAYER if units == "layer" else BucketingStrategy.BLOCK
        owners = bucket_owner(jm._model, strategy, block_names)
        self.units: list[tuple[str, list[str]]] = []  # (owner, its parameters), in first-use order
        for name, _ in self.shards:
            if self.units and self.units[-1][0] == owners[name]:
                self.units[-1][1].append(name)
            else:
                self.units.append((owners[name], [name]))
        # Elements before sharding, which tell which buckets pad (``jm``'s own module is sharded now).
        self.numels = {name: unsharded_numel(original, name) for name, _ in self.shards}
        self.aliases = jm._get_shared_names()
        self.evaluated: dict[tuple[int, ...], Candidate] = {}

    @property
    def unit_firsts(self) -> list[str]:
        """Each unit's first parameter: where a bucketing of whole units may cut."""
        return [names[0] for _, names in self.units]

    def cuts_between_units(self, first_parameters: list[str]) -> bool:
        """Whether buckets starting at these parameters hold whole units."""
        return set(first_parameters) <= set(self.unit_firsts)

    def starts_of(self, first_parameters: list[str]) -> tuple[int, ...]:
        """The bucketing whose buckets start at these parameters (the first unit's among them)."""
        firsts = self.unit_firsts
        unknown = [p for p in first_parameters if p not in firsts]
        if unknown or not first_parameters or first_parameters[0] != firsts[0]:
            raise ValueError(
                f"a bucketing starts with {firsts[0]!r} and cuts before units' first parameters only; got {first_parameters} "
                f"({'not first parameters: ' + str(unknown) if unknown else 'not starting with ' + repr(firsts[0])}); "
                f"accepted: {firsts}"
            )
        return tuple(sorted(firsts.index(p) for p in set(first_parameters)))

    def evaluate(self, starts: tuple[int, ...]) -> Candidate:
        if starts in self.evaluated:
            return self.evaluated[starts]
        state, shard_of = self.state, dict(self.shards)
        plans = []
        for begin, end in itertools.pairwise((*starts, len(self.units))):
            owners = [owner for owner, _ in self.units[begin:end]]
            label = owners[0] if len(owners) == 1 else f"{owners[0]} .. {owners[-1]}"
            members = [(name, shard_of[name]) for _, names in self.units[begin:end] for name in names]
            plans.append(make_plan(label, members, members[0][1].dtype, True))
        buckets, _ = make_buckets(plans, shard_of, self.numels, state.bucket_group, self.policy)
        if buckets[0].layout.backend.has_bucket_path_choices:
            raise ValueError(f"the search chooses no bucket paths of backend {buckets[0].layout.backend.name!r}; it runs on the fake group")
        slots = bucket_slots(buckets, self.aliases)
        # The compile's model state with these buckets: its rewrite (hybrid sharding's all-reduces
        # across the replicas included), as a compile prices a step.
        forward, backward = replace(state, buckets=buckets, bucket_slots=slots).bucketed(self.forward, self.backward)
        layouts = {bucket: bucket.layout for bucket in buckets}
        # The prefetch limits' unit as a compile resolves it: the largest block, or bucket where larger.
        largest_bucket = max(b.gathered_numel() * b.gather_dtype.itemsize for b in buckets)
        unit_bytes = max(state.largest_block_bytes or 0, largest_bucket)
        forward_scheduled, backward_scheduled = schedule_step(
            classify_trace(forward, layouts),
            classify_trace(backward, layouts),
            self.config,
            largest_block_bytes=unit_bytes,
            cost_model=lambda _: self.cost_model,
            basis_floor_bytes=state.regather_all_peak_bytes,
        )
        # The compile's path choice: where a pool buffer would sit idle to the step's end, reduce in it.
        forward_memory = forward_scheduled.memory
        paths = choose_bucket_paths(
            forward_memory.trace if forward_memory is not None else forward_scheduled.trace,
            backward_scheduled,
            layouts,
            max_slowdowns=(None, None),
            reduce_in_pool=self.config.reduce_in_pool,
            cost_model=lambda _: self.cost_model,
            agree=list,
            reschedule=None,
        )
        traces = (forward_scheduled.trace, paths.backward.trace)
        candidate = _predicted(starts, tuple(p.label for p in plans), traces, paths.layouts, self.cost_model)
        self.evaluated[starts] = candidate
        return candidate

    def as_compiled(self, jm) -> Candidate:
        """``auto``'s plan as the compile ran it (its chosen bucket paths): the scaling table's row."""
        traces = (thunder.last_traces(jm)[-1], thunder.last_backward_traces(jm)[-1])
        return _predicted((), tuple(b.plan.label for b in self.state.buckets), traces, self.state.layouts, self.cost_model)

    def every_bucketing(self) -> None:
        count = 2 ** (len(self.units) - 1)
        if count > MOST_BUCKETINGS:
            raise ValueError(
                f"--search all would evaluate {count} bucketings of {len(self.units)} units (about a second each); at most "
                f"{MOST_BUCKETINGS} are tried: use --search climb, or --units block"
            )
        for cuts in itertools.product((False, True), repeat=len(self.units) - 1):
            self.evaluate((0, *(i + 1 for i, cut in enumerate(cuts) if cut)))

    def climb(self, start: tuple[int, ...], most_rounds: int) -> None:
        best = self.evaluate(start)
        for _ in range(most_rounds):
            nearby = min((self.evaluate(n) for n in self._one_boundary_away(best.starts)), key=lambda c: c.step_ms)
            if nearby.step_ms >= best.step_ms:
                return
            best = nearby
            print(f"  climbing: {best.step_ms:.1f} ms, {len(best.starts)} buckets ({len(self.evaluated)} evaluated)", file=sys.stderr)

    def _one_boundary_away(self, starts: tuple[int, ...]) -> set[tuple[int, ...]]:
        nearby = {tuple(sorted({*starts, cut})) for cut in range(1, len(self.units)) if cut not in starts}
        for i in range(1, len(starts)):
            nearby.add(starts[:i] + starts[i + 1 :])
            for step in (-1, 1):
                moved = starts[i] + step
                if starts[i - 1] < moved < (starts[i + 1] if i + 1 < len(starts) else len(self.units)):
                    nearby.add((*starts[:i], moved, *starts[i + 1 :]))
        return nearby


def _predicted(starts, labels, traces, layouts, cost_model: CostModel) -> Candidate:
    """The step of a forward and backward execution trace, simulated as the report simulates them."""
    step_ms = bound_ms = 0.0
    peak, after = 0, None
    for trace in traces:
        report = analyze_trace(trace, cost_model, order="candidate", after=after, layouts=layouts)
        after = report.memory
        step_ms, bound_ms, peak = step_ms + report.predicted_ms, bound_ms + report.bound_ms, max(peak, report.peak_bytes)
    return Candidate(starts, labels, step_ms, bound_ms, peak)


def _described(candidate: Candidate) -> str:
    return (
        f"{candidate.step_ms:.1f} ms, {candidate.gap:.1%} over its max(C, M) {candidate.bound_ms:.1f} ms, "
        f"peak {candidate.peak_bytes / _GIB:.2f} GiB ({', '.join(candidate.labels)})"
    )


def _before_bucketing(history: list) -> object:
    """The last trace of a pass's history before the bucketing transform's (the first with buckets)."""
    bucketed = next(i for i, trace in enumerate(history) if any(b.sym.id in BUCKETED_ISSUES for b in trace.bound_symbols))
    return history[bucketed - 1]


@dataclass(frozen=True)
class Outcome:
    """One setting's search: ``auto``'s plan as the search evaluates it (None where it cuts inside
    the units) and as the compile ran it, and every bucketing evaluated, fastest first."""

    units: int
    seconds: float
    auto: Candidate | None
    auto_as_compiled: Candidate
    evaluated: list[Candidate]

    @property
    def fastest(self) -> Candidate:
        return self.evaluated[0]

    @property
    def fastest_within_target(self) -> Candidate | None:
        return next((c for c in self.evaluated if c.gap <= GAP_TARGET), None)


def search_setting(args: argparse.Namespace) -> Outcome:
    """Traces ``args``' setting with ``auto`` buckets and searches its bucketings (see the module's docstring)."""
    # The shard group's network sizes the buckets; each collective is costed on its own group's.
    network = TOPOLOGY.network_of_ranks(range(args.shard_group_size or args.world_size)).name
    cost_model = CostModel.named(args.device_profile, network, topology=TOPOLOGY)
    dtype_name, policy_names = PRECISIONS[args.precision]
    policy = MixedPrecision(*(getattr(torch, n) for n in policy_names)) if policy_names else None
    config = OverlapConfig(cost_model=cost_model)
    # One fake group for the whole search: the topology reads each group's ranks while alive.
    with fake_process_group(args.world_size):
        with torch.device("meta"):
            model = BUILTIN_MODELS[args.model](args.n_layer).build().to(getattr(torch, dtype_name))
        jm = trace_model(
            model, world_size=args.world_size, sharding=args.sharding, bucketing="auto", idx_shape=(1, args.seq_len),
            config=config, mixed_precision=policy, shard_group_size=args.shard_group_size,
        )  # fmt: skip
        with torch.device("meta"):
            original = BUILTIN_MODELS[args.model](args.n_layer).build()
        search = Search(jm, original, args.units, policy, config, cost_model)
        compiled = search.as_compiled(jm)
        # auto's plan among the candidates, where it cuts only between these units.
        auto_firsts = [b.plan.slots[0].name for b in search.state.buckets]
        auto_starts = search.starts_of(auto_firsts) if search.cuts_between_units(auto_firsts) else None
        auto = search.evaluate(auto_starts) if auto_starts is not None else None
        started = time.perf_counter()
        if args.search == "all":
            search.every_bucketing()
        else:
            start = search.starts_of(args.start.split(",")) if args.start else auto_starts
            if start is None:
                raise ValueError(f"auto's plan cuts inside {args.units} units ({auto_firsts}): give --start, or --units layer")
            search.climb(start, args.rounds)
        took = time.perf_counter() - started
    evaluated = sorted(search.evaluated.values(), key=lambda c: c.step_ms)
    return Outcome(len(search.units), took, auto, compiled, evaluated)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-2-7b", choices=sorted(BUILTIN_MODELS))
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--world-size", type=int, default=1024)
    parser.add_argument("--sharding", default="zero2", choices=["zero2", "zero3"])
    parser.add_argument("--shard-group-size", type=int, default=None, help="hybrid sharding (HSDP) in shard groups of this many ranks")
    parser.add_argument("--precision", default="bf16", choices=list(PRECISIONS))
    parser.add_argument("--device-profile", default="h100")
    parser.add_argument("--units", default="block", choices=["block", "layer"], help="what a bucket holds whole")
    parser.add_argument("--search", default="all", choices=["all", "climb"])
    parser.add_argument("--start", default=None, help="climb from the plan whose buckets start at these parameters (comma-separated)")
    parser.add_argument("--rounds", type=int, default=8, help="most improvements a climb takes")
    parser.add_argument("--json", default=None, help="also write every evaluated bucketing to this JSON file")
    return parser


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    outcome = search_setting(args)
    fastest, within = outcome.fastest, outcome.fastest_within_target
    hybrid = f" HSDP {args.world_size // args.shard_group_size}x{args.shard_group_size}" if args.shard_group_size else ""
    setting = f"{args.model} x{args.n_layer} {args.precision}, {args.world_size} ranks, {args.sharding}{hybrid}"
    print(f"{setting}: {len(outcome.evaluated)} bucketings of {outcome.units} {args.units} units evaluated in {outcome.seconds:.0f} s")
    print(f"  auto's plan as compiled (its bucket paths), the scaling table's row: {_described(outcome.auto_as_compiled)}")
    auto = outcome.auto if outcome.auto is not None else outcome.auto_as_compiled
    if outcome.auto is not None:
        print(f"  auto's plan:  {_described(outcome.auto)}")
    else:
        print(f"  auto's plan cuts inside {args.units} units: it is compared as compiled")
    print(f"  fastest:      {_described(fastest)}")
    print(f"  auto's plan is {auto.step_ms / fastest.step_ms - 1:.1%} slower than the fastest found")
    if within is not None:
        print(
            f"  fastest within {GAP_TARGET:.0%} of its own max(C, M): {within.step_ms:.1f} ms ({within.gap:.1%}), "
            f"{within.step_ms / fastest.step_ms - 1:.1%} slower than the fastest ({len(within.starts)} buckets)"
        )
    else:
        print(f"  no bucketing evaluated is within {GAP_TARGET:.0%} of its own max(C, M)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        record = {
            "setting": vars(args),
            "seconds": outcome.seconds,
            "auto": asdict(outcome.auto) if outcome.auto is not None else None,
            "auto_as_compiled": asdict(outcome.auto_as_compiled),
            "fastest": asdict(fastest),
            "fastest_within_target": asdict(within) if within is not None else None,
            "evaluated": [asdict(c) for c in outcome.evaluated],
        }
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
