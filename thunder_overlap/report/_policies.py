"""Every scheduling policy on one model's traces, side by side: overlap, time and memory.

The traces Thunder produced before thunder_overlap's scheduling pass (see
:func:`~thunder_overlap.report._report.unscheduled_trace`) are scheduled again by each policy of
:class:`~thunder_overlap.config.Policy` with the same cost model the report
simulates with, then simulated and memory-estimated like the report's own orders; the policy the
module was compiled with is reported from its own final traces instead, as they run (the
backward's bucket paths and the order the ranks agreed on come from the compile, which a
scheduling of its own would not repeat). The first row
of each pass is Thunder's own FSDP (the report's baseline, ``thunder 0.2.6``), which every policy
is compared with; ``stock`` is thunder_overlap's traces unscheduled. The ``just_in_time`` row is
the memory budget's baseline; ``greedy`` shows what unbounded overlap costs in memory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import thunder
from thunder.core.trace import TraceCtx

from thunder_overlap._analysis.blocks import largest_block_bytes
from thunder_overlap._analysis.classify import classify_trace
from thunder_overlap._analysis.cost_model import CostModel
from thunder_overlap._analysis.layout import BucketLayouts
from thunder_overlap._analysis.passes import Pass
from thunder_overlap._scheduling.step_budget import schedule_step
from thunder_overlap._scheduling.summary import ScheduleSummary
from thunder_overlap._transforms.schedule import OverlapScheduleTransform
from thunder_overlap.config import OverlapConfig, Policy
from thunder_overlap.report._report import BASELINE, LEGEND, OrderReport, analyze_trace, module_layouts, speed_change, unscheduled_trace
from thunder_overlap.report._thunder_baseline import ThunderFSDPTraces, thunder_fsdp_baseline, world_size_of

__all__ = ["COMPARED_POLICIES", "PolicyComparison", "PolicyResult", "compare_policies"]

# In the order of the rows: Thunder's order first, then more overlap.
COMPARED_POLICIES = (Policy.STOCK, Policy.JUST_IN_TIME, Policy.HEURISTIC, Policy.GREEDY, Policy.MEMORY_AWARE)
_MIB = 2**20
POLICY_LEGEND = """\
max(C,M) ms: the bound ms below; gap: predicted ms over it, minus one.
vs JIT: predicted peak memory over the just-in-time order's in the same pass, minus one."""


@dataclass(frozen=True)
class PolicyResult:
    policy: str  # a scheduling policy's name, or BASELINE for Thunder's own FSDP
    pass_name: Pass
    report: OrderReport
    summary: ScheduleSummary | None  # None where nothing was scheduled (Thunder's own FSDP, stock)

    @property
    def bound_gap(self) -> float:
        """Predicted time over max(compute, communication), minus one: 0 is ideal overlap."""
        return self.report.predicted_ms / self.report.bound_ms - 1 if self.report.bound_ms else 0.0


@dataclass(frozen=True)
class PolicyComparison:
    results: tuple[PolicyResult, ...]
    device: str
    network: str
    world_size: int

    def result(self, policy: Policy | str, pass_name: str) -> PolicyResult:
        for r in self.results:
            if (r.policy, r.pass_name) == (policy, pass_name):
                return r
        raise KeyError(f"no result for policy {policy!r} in pass {pass_name!r}")

    def peak_over_just_in_time(self, result: PolicyResult) -> float:
        """``result``'s predicted peak over the just-in-time order's in the same pass, minus one."""
        baseline = self.result(Policy.JUST_IN_TIME, result.pass_name).report.peak_bytes
        return result.report.peak_bytes / baseline - 1 if baseline else 0.0

    def step_ms(self, policy: Policy | str) -> float:
        return sum(r.report.predicted_ms for r in self.results if r.policy == policy)

    def __str__(self) -> str:
        head = (
            f"{'pass':<9} {'policy':<14} {'hidden/hideable':>15} {'exposed ms':>10} {'predicted ms':>12} "
            f"{'max(C,M) ms':>11} {'gap':>6} {'peak MiB':>9} {'vs JIT':>7}"
        )
        lines = [f"world size {self.world_size}, device {self.device}, network {self.network}", head, "-" * len(head)]
        for r in self.results:
            o = r.report
            lines.append(
                f"{r.pass_name:<9} {r.policy:<14} {f'{o.hidden}/{o.hideable}':>15} {o.exposed_ms:>10.3f} {o.predicted_ms:>12.3f} "
                f"{o.bound_ms:>11.3f} {r.bound_gap:>6.1%} {o.peak_bytes / _MIB:>9.1f} {self.peak_over_just_in_time(r):>+7.1%}"
            )
        policies = list(dict.fromkeys(r.policy for r in self.results))
        lines.append("predicted step (forward + backward): " + ", ".join(f"{p} {self.step_ms(p):.3f} ms" for p in policies))
        if BASELINE in policies:
            base = self.step_ms(BASELINE)
            lines += [f"  {p} against {BASELINE}: {speed_change(base, self.step_ms(p))}" for p in policies if p != BASELINE]
        return "\n".join([*lines, "", POLICY_LEGEND, LEGEND])

    def to_json(self, path: str | Path | None = None) -> dict:
        data = {
            "device": self.device,
            "network": self.network,
            "world_size": self.world_size,
            "results": [
                {"policy": r.policy, "pass": r.pass_name, **r.report.summary(), "bound_gap": r.bound_gap,
                 "peak_over_just_in_time": self.peak_over_just_in_time(r),
                 "forced_waits": r.summary.forced_waits if r.summary else 0}
                for r in self.results
            ],
        }  # fmt: skip
        if path is not None:
            Path(path).write_text(json.dumps(data, indent=1))
        return data


def _schedule_step(
    unscheduled: dict[Pass, TraceCtx], layouts: BucketLayouts, config: OverlapConfig, block_bytes: int | None, cost_model: CostModel
) -> dict[Pass, tuple[TraceCtx, ScheduleSummary | None]]:
    """Each pass of ``unscheduled`` (bucketed with ``layouts``) scheduled by ``config`` as a
    compile schedules them (the forward within the step's budget): the trace and what the
    scheduler decided."""
    forward, backward = (classify_trace(unscheduled[p], layouts) if p in unscheduled else None for p in (Pass.FORWARD, Pass.BACKWARD))
    step = schedule_step(forward, backward, config, largest_block_bytes=block_bytes, cost_model=lambda _: cost_model)
    return {pass_: (s.trace, s.summary) for pass_, s in zip((Pass.FORWARD, Pass.BACKWARD), step, strict=True) if s is not None}


def compare_policies(
    jm,
    *,
    cost_model: CostModel,
    config: OverlapConfig | None = None,
    policies: tuple[Policy | str, ...] = COMPARED_POLICIES,
    thunder_fsdp: ThunderFSDPTraces | None = None,
    baseline: bool = True,
) -> PolicyComparison:
    """Schedules ``jm``'s last forward and backward traces with each policy and reports them
    beside Thunder's own FSDP (``baseline=False``: without it, so it is not traced).

    ``config`` supplies the limits (its ``policy`` is replaced by each compared one); the
    prefetch byte limits are sized from ``jm``'s largest block as in training. Where that makes
    the configuration ``jm`` was compiled with, its own final traces are reported. ``thunder_fsdp``
    as in :func:`~thunder_overlap.report._report.report` (default: traced here).
    """
    if not baseline and thunder_fsdp is not None:
        raise ValueError("compare_policies() got thunder_fsdp= with baseline=False; pass either, not both")
    config = config if config is not None else OverlapConfig()
    policies = tuple(Policy.parse(p) for p in policies)
    if Policy.JUST_IN_TIME not in policies:
        policies = (Policy.JUST_IN_TIME, *policies)
    forward, backward = thunder.last_traces(jm), thunder.last_backward_traces(jm)
    if not forward:
        raise ValueError("the module has not been run or traced yet: call it once (or trace it) before compare_policies()")
    # The limits' unit as training resolves it (the largest block, or bucket where larger).
    schedule = OverlapScheduleTransform.of(jm)
    block_bytes = schedule.prefetch_unit_bytes if schedule is not None else largest_block_bytes(jm._model)
    layouts = module_layouts(jm)
    unscheduled = {Pass.FORWARD: unscheduled_trace(jm, forward)}
    if backward:
        unscheduled[Pass.BACKWARD] = unscheduled_trace(jm, backward)
    if baseline and thunder_fsdp is None:
        thunder_fsdp = thunder_fsdp_baseline(jm)
    results = []
    baseline_passes = []
    if baseline:
        baseline_passes = [(Pass.FORWARD, thunder_fsdp.forward)] + ([(Pass.BACKWARD, thunder_fsdp.backward)] if backward else [])
    baseline_forward = None
    for pass_name, trace in baseline_passes:
        report = analyze_trace(trace, cost_model, order=BASELINE, after=baseline_forward)
        if pass_name is Pass.FORWARD:
            baseline_forward = report.memory
        results.append(PolicyResult(BASELINE, pass_name, report, None))
    compiled = {}  # the traces jm runs, and what its scheduler decided for them
    if schedule is not None:
        compiled = {Pass.FORWARD: (forward[-1], schedule.summaries.forward)}
        if backward:
            compiled[Pass.BACKWARD] = (backward[-1], schedule.summaries.backward)
    for policy in policies:
        # A policy that reads no memory compares without the absolute budget (it refuses one).
        budget = config.memory_budget_bytes if policy.reads_memory else None
        policy_config = replace(config, policy=policy, memory_budget_bytes=budget)
        if schedule is not None and policy_config == schedule.config:
            passes = compiled
        else:
            passes = _schedule_step(unscheduled, layouts, policy_config, block_bytes, cost_model)
        forward_memory = None
        for pass_name, (scheduled_trace, summary) in passes.items():
            report = analyze_trace(scheduled_trace, cost_model, order=policy.value, after=forward_memory, layouts=layouts)
            if pass_name is Pass.FORWARD:
                forward_memory = report.memory
            results.append(PolicyResult(policy.value, pass_name, report, summary))
    rows = (BASELINE, *(policy.value for policy in policies))
    results.sort(key=lambda r: (r.pass_name is not Pass.FORWARD, rows.index(r.policy)))
    # The ranks of the job: the baseline's (under hybrid sharding Thunder's FSDP takes the whole world).
    world_size = thunder_fsdp.world_size if baseline else world_size_of(jm)
    return PolicyComparison(tuple(results), cost_model.device.name, cost_model.network.name, world_size)
