"""Overlap scheduling of the forward and backward execution traces.

Each compile of a pass classifies its trace (with the buckets' layouts), schedules it and returns
the scheduled trace. The first compile of a pass is where every rank is present: ranks agree on
their settings, then on the pass's issue order and launches (``_scheduling/rank_agreement.py``);
the backward's first compile also chooses the buckets' paths in one step
(``_bucketing/path_choice.py``), whose layouts the bucketing transform runs with from then on.
Retraces schedule once, in the agreed order, with the final layouts.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass

from thunder.core.devices import to_torch_device
from thunder.core.proxies import TensorProxy
from thunder.core.trace import TraceCtx, TraceTag
from thunder.core.transform_common import Transform
from thunder.distributed import get_skip_data_parallel_grad_sync
from torch.distributed import ProcessGroup

from thunder_overlap._analysis.blocks import BlockTypes, largest_block_bytes
from thunder_overlap._analysis.classify import AnnotatedTrace, classify_trace, find_swallowed_collectives
from thunder_overlap._analysis.cost_model import CostModel
from thunder_overlap._analysis.layout import NO_BUCKETS, BucketLayouts
from thunder_overlap._analysis.memory_estimate import MemoryEstimate, estimate_memory
from thunder_overlap._analysis.simulator import simulate
from thunder_overlap._bucketing.path_choice import PathChoice, choose_bucket_paths
from thunder_overlap._scheduling.dispatch import ScheduledTrace, schedule_trace
from thunder_overlap._scheduling.issue_order import IssueOrder, issue_order_of
from thunder_overlap._scheduling.rank_agreement import IssueOrderAgreement, agree_settings, agreed_subset, collective_keys
from thunder_overlap._scheduling.summary import ScheduleSummary
from thunder_overlap._scheduling.unsharding import StepPrediction
from thunder_overlap._transforms._lookup import transform_of
from thunder_overlap._transforms.bucketing import BucketingTransform
from thunder_overlap.config import OverlapConfig

__all__ = ["OverlapScheduleTransform", "ScheduleSummaries"]


@dataclass
class ScheduleSummaries:
    """What the scheduler decided for the last forward and backward."""

    forward: ScheduleSummary | None = None
    backward: ScheduleSummary | None = None

    def __getitem__(self, key: str) -> ScheduleSummary | None:
        """The summaries by their former names ("forward", "backward")."""
        return getattr(self, key)


class OverlapScheduleTransform(Transform):
    """Reorders collectives and waits around Thunder's compute order (see ``_scheduling``).

    Compute keeps its order; all-gathers move up to prefetch within the configured limits,
    reduce-scatters move up to right after their gradient, waits move down to their first use.
    ``block_types`` names the module classes that form blocks (None: detected), which size the
    default prefetch limits; ``buckets`` is the module's bucketing transform (None without
    buckets); ``settings`` are the options ranks must share (they are compared at the first
    compile, with the configuration's); ``agreement_group`` is the group ranks agree over (None:
    the group of the traces' collectives; hybrid sharding passes the world). After a step,
    :attr:`summaries` holds what was decided and :attr:`bucket_paths` the paths chosen.
    """

    def __init__(
        self,
        config: OverlapConfig | None = None,
        *,
        block_types: BlockTypes | None = None,
        buckets: BucketingTransform | None = None,
        settings: Mapping[str, object] | None = None,
        agreement_group: ProcessGroup | None = None,
    ) -> None:
        self.config = config if config is not None else OverlapConfig()
        self.block_types = block_types
        self.buckets = buckets
        self.settings = {**self.config.agreed_fields(), **(settings or {})}
        self.agreement_group = agreement_group
        self.agreement = IssueOrderAgreement(exchange=self.config.tuning.check_ranks_agree)
        self.summaries = ScheduleSummaries()
        self.bucket_paths: PathChoice | None = None
        # Sizes the default prefetch limits; None until transform_module sees the model.
        self.largest_block_bytes: int | None = None
        # The last forward's memory estimate, and its just-in-time order's the budget was relative
        # to: Thunder compiles a backward right after its forward, whose outputs are its inputs.
        self._forward_memory: MemoryEstimate | None = None
        self._forward_budget_basis: MemoryEstimate | None = None
        self._settings_agreed = False

    @staticmethod
    def of(module) -> OverlapScheduleTransform | None:
        """The schedule transform of a module ``thunder_overlap.fsdp`` returned, if any."""
        return transform_of(module, OverlapScheduleTransform)

    @property
    def prefetch_unit_bytes(self) -> int | None:
        """What the default in-flight limits count in: the largest block, or the largest bucket
        where buckets hold several blocks (``auto``)."""
        bucket = self.buckets.largest_bucket_bytes() if self.buckets is not None else None
        if bucket is None or self.largest_block_bytes is None:
            return self.largest_block_bytes
        return max(self.largest_block_bytes, bucket)

    @property
    def layouts(self) -> BucketLayouts:
        return self.buckets.layouts if self.buckets is not None else NO_BUCKETS

    def transform_module(self, model) -> None:
        # The original module still has the unsharded shapes (on meta once FSDP released it).
        self.largest_block_bytes = largest_block_bytes(model._model, self.block_types)
        if self.largest_block_bytes is None and self.config.policy in ("memory_aware", "heuristic"):
            warnings.warn(
                f"thunder_overlap: {type(model._model).__name__} has no nn.ModuleList/nn.Sequential of blocks to "
                f"size prefetching by (name them with block_types=); limiting all-gathers in flight to "
                f"{self.config.tuning.fallback_in_flight_allgathers} "
                "and leaving reduce-scatter bytes unbounded unless OverlapConfig sets limits",
                stacklevel=2,
            )

    def transform_trace_post_optimization(self, computation_trace: TraceCtx, **kwargs) -> TraceCtx:
        swallowed = find_swallowed_collectives(computation_trace)
        if swallowed:
            executors = [ex.name for ex in kwargs.get("executors_list", ())]
            raise RuntimeError(
                f"thunder_overlap: collectives were fused into {swallowed}, so they cannot be scheduled. "
                f"Executors in use: {executors}. Leave out executors that fuse communication "
                "(such as 'torchcompile'); nvFuser and the torch executor keep collectives top-level."
            )
        annotated = classify_trace(computation_trace, self.layouts)
        backward = TraceTag.BACKWARD in computation_trace.tags
        if not annotated.collectives:
            if not backward:
                self._forward_memory = self._forward_budget_basis = None
            return computation_trace
        group = self.agreement_group_of(annotated)
        self.agree_settings_once(group)
        scheduled = self._schedule_pass(annotated, "backward" if backward else "forward", group)
        setattr(self.summaries, "backward" if backward else "forward", scheduled.summary)
        self._warn_if_over_budget("backward" if backward else "forward", scheduled.summary)
        if not backward:
            self._forward_memory, self._forward_budget_basis = scheduled.memory, scheduled.budget_basis
        return scheduled.trace

    def agreement_group_of(self, annotated: AnnotatedTrace) -> ProcessGroup | None:
        """The group ranks agree over: the one given, else that of ``annotated``'s collectives."""
        return self.agreement_group if self.agreement_group is not None else _process_group(annotated)

    def agree_settings_once(self, group: ProcessGroup | None) -> None:
        """Compares the settings and bucket plans with the other ranks', once, before any other
        exchange (settings that differ would make ranks exchange differently); sharding "auto"
        calls it first, at its choice."""
        if not self._settings_agreed:
            agree_settings(self.settings, self.buckets.plan_digest() if self.buckets is not None else None, group)
            self._settings_agreed = True

    def _warn_if_over_budget(self, pass_name: str, summary: ScheduleSummary | None) -> None:
        """Says so where even no prefetch at all is over ``memory_budget_bytes``: the pass then
        runs just in time, over the budget (sharding "auto" refuses such a budget up front)."""
        budget = self.config.memory_budget_bytes
        if budget is None or summary is None or summary.baseline_peak_bytes is None or summary.baseline_peak_bytes <= budget:
            return
        warnings.warn(
            f"thunder_overlap: the {pass_name} needs {summary.baseline_peak_bytes} B even with every collective just in time, "
            f"over OverlapConfig.memory_budget_bytes={budget}; it prefetches nothing and runs over the budget. Raise the "
            "budget, or shrink the batch or the model per rank",
            stacklevel=3,
        )

    def _schedule_pass(self, annotated: AnnotatedTrace, pass_name: str, group: ProcessGroup | None) -> ScheduledTrace:
        """Schedules once, in the agreed order where this pass compiled before; at its first
        compile, agrees on the order (rescheduling only where this rank's differed) and, for the
        backward, chooses the bucket paths."""
        keys = collective_keys(annotated)
        agreed = self.agreement.agreed_order(pass_name, keys)
        if agreed is not None:
            return self._schedule(annotated, agreed, self.agreement.agreed_launches(pass_name, keys))
        chooses_paths = pass_name == "backward" and self._chooses_paths(annotated)
        uncapped = chooses_paths and _path_choice_reads_uncapped(self.config, annotated)
        scheduled = self._schedule(annotated, None, None, caps=not uncapped)
        own, own_launches = issue_order_of(annotated, scheduled.order), [list(launch.members) for launch in scheduled.launches]
        agreed = self.agreement.agree(pass_name, keys, own, group, own_launches)
        launches = self.agreement.agreed_launches(pass_name, keys)
        if agreed != own or launches != own_launches:
            scheduled = self._schedule(annotated, agreed, launches, caps=not uncapped)
        if not chooses_paths:
            return scheduled

        def reschedule(layouts: BucketLayouts) -> ScheduledTrace:
            return self._schedule(classify_trace(annotated.trace, layouts), agreed, launches)

        tuning = self.config.tuning
        self.bucket_paths = choose_bucket_paths(
            self._forward_memory.trace,
            scheduled,
            self.layouts,
            max_slowdowns=(tuning.reduce_from_copy_max_slowdown, tuning.per_tensor_gather_max_slowdown)
            if _backend(annotated).has_bucket_path_choices
            else (None, None),
            reduce_in_pool=self.config.reduce_in_pool,
            cost_model=self._cost_model,
            agree=(lambda labels: agreed_subset(labels, group)) if tuning.check_ranks_agree else list,
            reschedule=reschedule if uncapped else None,
        )
        self.buckets.set_layouts(self.bucket_paths.layouts)
        self._forward_memory = self.bucket_paths.forward_memory
        return self.bucket_paths.backward

    def predict_step(self, forward: TraceCtx, backward: TraceCtx, layouts: BucketLayouts = NO_BUCKETS) -> StepPrediction:
        """``forward`` then ``backward`` (bucketed with ``layouts``) scheduled as this transform
        schedules a first compile, less what needs the other ranks (the agreed order, the bucket
        paths): the predicted peak and the simulated step (sharding "auto" compares choices by them)."""
        peak_bytes, step_ms, held_by_memory = 0, 0.0, 0
        memory_after = budget_after = None
        for trace in (forward, backward):
            annotated = classify_trace(trace, layouts)
            if not annotated.collectives:  # the same in every choice, and no collective to find its device by
                continue
            scheduled = schedule_trace(
                annotated,
                self.config,
                largest_block_bytes=self.prefetch_unit_bytes,
                cost_model=self._cost_model,
                memory_after=memory_after,
                budget_after=budget_after,
            )
            memory = scheduled.memory or estimate_memory(scheduled.trace, layouts=layouts, after=memory_after)
            final = classify_trace(scheduled.trace, layouts)  # coalesced launches are one collective each
            step_ms += simulate(final, list(range(len(final.nodes))), self._cost_model(annotated)).step_ms
            peak_bytes = max(peak_bytes, memory.peak_bytes)
            held_by_memory += scheduled.summary.held_by_memory if scheduled.summary is not None else 0
            memory_after, budget_after = memory, scheduled.budget_basis
        return StepPrediction(peak_bytes, step_ms, held_by_memory)

    def _chooses_paths(self, annotated: AnnotatedTrace) -> bool:
        """Once, at the first backward that reduce-scatters buckets (not under no_sync)."""
        first = self.bucket_paths is None and self._forward_memory is not None
        return first and annotated.runs_buckets and not get_skip_data_parallel_grad_sync()

    def _schedule(
        self, annotated: AnnotatedTrace, issue_order: list[int] | None, launches: list[list[int]] | None, *, caps: bool = True
    ) -> ScheduledTrace:
        backward = TraceTag.BACKWARD in annotated.trace.tags
        return schedule_trace(
            annotated,
            self.config,
            largest_block_bytes=self.prefetch_unit_bytes,
            cost_model=self._cost_model,
            issue_order=None if issue_order is None else IssueOrder.of_sequence(annotated, issue_order),
            launches=launches,
            memory_after=self._forward_memory if backward else None,
            budget_after=self._forward_budget_basis if backward else None,
            caps_pool_reduce_scatters=caps,
        )

    def _cost_model(self, annotated: AnnotatedTrace) -> CostModel:
        """The configured cost model, or the default for the device the collectives run on.
        Ranks may estimate differently: that moves collectives relative to compute, never the
        agreed issue order."""
        return self.config.cost_model if self.config.cost_model is not None else _device_cost_model(annotated)


def _process_group(annotated: AnnotatedTrace) -> ProcessGroup | None:
    return next((c.process_group for c in annotated.collectives if c.process_group is not None), None)


def _device_cost_model(annotated: AnnotatedTrace) -> CostModel:
    group = _process_group(annotated)
    start = annotated.nodes[annotated.collectives[0].start].bsym
    device = next(to_torch_device(a.device) for a in start.flat_proxy_args if isinstance(a, TensorProxy))
    return CostModel.for_device(device, group.size() if group is not None else 1)


def _path_choice_reads_uncapped(config: OverlapConfig, annotated: AnnotatedTrace) -> bool:
    """Whether the backward's first schedule lifts the cap on pool-holding reduce-scatters: where
    some may go from the backend's copy, which the cap must not count ([Note: bucket paths])."""
    tuning = config.tuning
    chooses_from_copy = _backend(annotated).copies_reduce_scatter_input and tuning.reduce_from_copy_max_slowdown is not None
    return chooses_from_copy and tuning.bucket_reduce_scatter_blocks is not None


def _backend(annotated: AnnotatedTrace):
    """The backend of the buckets the trace runs (all share the FSDP process group)."""
    return next(iter(annotated.layouts.values())).backend
