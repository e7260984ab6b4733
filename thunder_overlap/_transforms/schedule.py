"""Overlap scheduling of the forward and backward execution traces.

Each compile of a pass classifies its trace (with the buckets' layouts), schedules it and returns
the scheduled trace. The first compile of a pass is where every rank is present: ranks agree on
their settings, then on the pass's issue order and launches (``_scheduling/rank_agreement.py``);
the backward's first compile also chooses the buckets' paths in one step
(``_bucketing/path_choice.py``), whose layouts the model's buckets run with from then on.
Retraces schedule once, in the agreed order, with the final layouts.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, replace

from thunder.core.trace import TraceCtx
from thunder.core.transform_common import Transform
from thunder.distributed import get_skip_data_parallel_grad_sync
from torch.distributed import ProcessGroup

from thunder_overlap._analysis.classify import AnnotatedTrace, classify_trace, find_swallowed_collectives
from thunder_overlap._analysis.cost_model import CostModel
from thunder_overlap._analysis.layout import BucketLayouts
from thunder_overlap._analysis.passes import Pass
from thunder_overlap._bucketing.path_choice import PathChoice, choose_bucket_paths
from thunder_overlap._scheduling.dispatch import ScheduledTrace, schedule_trace
from thunder_overlap._scheduling.issue_order import IssueOrder, issue_order_of
from thunder_overlap._scheduling.prediction import cost_model_of
from thunder_overlap._scheduling.rank_agreement import IssueOrderAgreement, agreed_subset, collective_keys
from thunder_overlap._scheduling.step_budget import forward_within_step_budget
from thunder_overlap._scheduling.summary import ScheduleSummary
from thunder_overlap._transforms._lookup import transform_of
from thunder_overlap._transforms._model_state import ForwardHandoff, ModelState
from thunder_overlap.config import OverlapConfig

__all__ = ["OverlapScheduleTransform", "ScheduleSummaries"]

logger = logging.getLogger(__name__)


@dataclass
class ScheduleSummaries:
    """What the scheduler decided for the last forward and backward."""

    forward: ScheduleSummary | None = None
    backward: ScheduleSummary | None = None


class OverlapScheduleTransform(Transform):
    """Reorders collectives and waits around Thunder's compute order (see ``_scheduling``).

    Compute keeps its order; all-gathers move up to prefetch within the configured limits,
    reduce-scatters move up to right after their gradient, waits move down to their first use.
    ``state`` is the model's (:class:`ModelState`): the configuration, the blocks that size the
    default prefetch limits, the buckets and their layouts, the settings ranks compare at the
    first compile and the group they agree over. After a step, :attr:`summaries` holds what was
    decided and :attr:`bucket_paths` the paths chosen.
    """

    def __init__(self, state: ModelState) -> None:
        self.state = state
        self.summaries = ScheduleSummaries()

    @staticmethod
    def of(module) -> OverlapScheduleTransform | None:
        """The schedule transform of a module ``thunder_overlap.fsdp`` returned, if any."""
        return transform_of(module, OverlapScheduleTransform)

    @property
    def config(self) -> OverlapConfig:
        return self.state.config

    @property
    def agreement(self) -> IssueOrderAgreement:
        return self.state.agreement

    @property
    def bucket_paths(self) -> PathChoice | None:
        return self.state.bucket_paths

    @property
    def largest_block_bytes(self) -> int | None:
        return self.state.largest_block_bytes

    @property
    def prefetch_unit_bytes(self) -> int | None:
        """What the default in-flight limits count in: the largest block, or the largest bucket
        where buckets hold several blocks (``auto``)."""
        return self.state.prefetch_unit_bytes

    def transform_module(self, model) -> None:
        self.state.find_blocks(model._model)  # found once per model, by whichever asks first
        if self.state.largest_block_bytes is None and self.config.policy.limits_by_block:
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
        state = self.state
        annotated = classify_trace(computation_trace, state.layouts)
        pass_ = Pass.of(computation_trace)
        if not annotated.collectives:
            if pass_ is Pass.FORWARD:
                state.forward = None
            return computation_trace
        group = state.agreement_group_of(annotated)
        state.agree_settings_once(group)
        if pass_ is Pass.BACKWARD and state.forward is not None and state.forward.schedule is not None:
            self._forward_within_step_budget(state.forward.schedule, annotated)
        scheduled = self._schedule_pass(annotated, pass_, group)
        self._warn_if_over_budget(pass_, scheduled.summary)
        if pass_ is Pass.FORWARD:
            self.summaries.forward = scheduled.summary
            state.forward = ForwardHandoff(scheduled.memory, scheduled.budget_basis, scheduled)
        else:
            self.summaries.backward = scheduled.summary
        state.scheduled.add(scheduled.trace)
        return scheduled.trace

    def _forward_within_step_budget(self, forward: ScheduledTrace, backward: AnnotatedTrace) -> None:
        """Schedules the forward again in the memory its backward needs anyway where that pays
        ([Note: the step's budget]), in its agreed issue order and launches, and rewrites the
        forward trace Thunder holds in place: Thunder builds its callable after the backward's
        transforms, and the schedule transform is the last to see the forward."""
        keys = collective_keys(forward.annotated)
        order, launches = self.agreement.agreed_order(Pass.FORWARD, keys), self.agreement.agreed_launches(Pass.FORWARD, keys)

        def reschedule(step_peak_bytes: int) -> ScheduledTrace:
            return self._schedule(forward.annotated, order, launches, step_peak_bytes=step_peak_bytes)

        widened = forward_within_step_budget(forward, backward, reschedule, self._cost_model(forward.annotated))
        if widened is None:
            return
        forward.trace.bound_symbols = widened.trace.bound_symbols
        forward.trace.names |= widened.trace.names  # the names of coalesced launches
        widened = replace(widened, trace=forward.trace)
        logger.info("forward rescheduled within the step's memory budget: %s", widened.summary.describe())
        self.summaries.forward = widened.summary
        self.state.forward = ForwardHandoff(widened.memory, widened.budget_basis, widened)

    def _warn_if_over_budget(self, pass_: Pass, summary: ScheduleSummary | None) -> None:
        """Says so where even no prefetch at all is over ``memory_budget_bytes``: the pass then
        runs just in time, over the budget (sharding "auto" refuses such a budget up front)."""
        budget = self.config.memory_budget_bytes
        if budget is None or summary is None or summary.baseline_peak_bytes is None or summary.baseline_peak_bytes <= budget:
            return
        warnings.warn(
            f"thunder_overlap: the {pass_} needs {summary.baseline_peak_bytes} B even with every collective just in time, "
            f"over OverlapConfig.memory_budget_bytes={budget}; it prefetches nothing and runs over the budget. Raise the "
            "budget, or shrink the batch or the model per rank",
            stacklevel=3,
        )

    def _schedule_pass(self, annotated: AnnotatedTrace, pass_: Pass, group: ProcessGroup | None) -> ScheduledTrace:
        """Schedules once, in the agreed order where this pass compiled before; at its first
        compile, agrees on the order (rescheduling only where this rank's differed) and, for the
        backward, chooses the bucket paths."""
        keys = collective_keys(annotated)
        state = self.state
        agreed = self.agreement.agreed_order(pass_, keys)
        if agreed is not None:
            return self._schedule(annotated, agreed, self.agreement.agreed_launches(pass_, keys))
        chooses_paths = pass_ is Pass.BACKWARD and self._chooses_paths(annotated)
        uncapped = chooses_paths and _path_choice_reads_uncapped(self.config, annotated)
        scheduled = self._schedule(annotated, None, None, caps=not uncapped)
        own, own_launches = issue_order_of(annotated, scheduled.order), [list(launch.members) for launch in scheduled.launches]
        agreed = self.agreement.agree(pass_, keys, own, group, own_launches)
        launches = self.agreement.agreed_launches(pass_, keys)
        if agreed != own or launches != own_launches:
            scheduled = self._schedule(annotated, agreed, launches, caps=not uncapped)
        if not chooses_paths:
            return scheduled

        def reschedule(layouts: BucketLayouts) -> ScheduledTrace:
            return self._schedule(classify_trace(annotated.trace, layouts), agreed, launches)

        tuning = self.config.tuning
        forward = state.forward
        # A policy without a budget (stock) estimated no memory for its forward.
        forward_trace = forward.memory.trace if forward.memory is not None else forward.schedule.trace
        state.bucket_paths = choose_bucket_paths(
            forward_trace,
            scheduled,
            state.layouts,
            max_slowdowns=(tuning.reduce_from_copy_max_slowdown, tuning.per_tensor_gather_max_slowdown)
            if _backend(annotated).has_bucket_path_choices
            else (None, None),
            reduce_in_pool=self.config.reduce_in_pool,
            cost_model=self._cost_model,
            agree=(lambda labels: agreed_subset(labels, group)) if tuning.check_ranks_agree else list,
            reschedule=reschedule if uncapped else None,
        )
        state.set_layouts(state.bucket_paths.layouts)
        state.forward = ForwardHandoff(state.bucket_paths.forward_memory, forward.budget_basis, forward.schedule)
        return state.bucket_paths.backward

    def _chooses_paths(self, annotated: AnnotatedTrace) -> bool:
        """Once, at the first backward that reduce-scatters buckets (not under no_sync)."""
        first = self.state.bucket_paths is None and self.state.forward is not None
        return first and annotated.runs_buckets and not get_skip_data_parallel_grad_sync()

    def _schedule(
        self,
        annotated: AnnotatedTrace,
        issue_order: list[int] | None,
        launches: list[list[int]] | None,
        *,
        caps: bool = True,
        step_peak_bytes: int | None = None,
    ) -> ScheduledTrace:
        forward = self.state.forward if Pass.of(annotated.trace) is Pass.BACKWARD else None
        return schedule_trace(
            annotated,
            self.config,
            largest_block_bytes=self.prefetch_unit_bytes,
            cost_model=self._cost_model,
            issue_order=None if issue_order is None else IssueOrder.of_sequence(annotated, issue_order),
            launches=launches,
            memory_after=forward.memory if forward is not None else None,
            budget_after=forward.budget_basis if forward is not None else None,
            step_peak_bytes=step_peak_bytes,
            basis_floor_bytes=self.state.regather_all_peak_bytes,
            caps_pool_reduce_scatters=caps,
        )

    def _cost_model(self, annotated: AnnotatedTrace) -> CostModel:
        return cost_model_of(self.config, annotated)


def _path_choice_reads_uncapped(config: OverlapConfig, annotated: AnnotatedTrace) -> bool:
    """Whether the backward's first schedule lifts the cap on pool-holding reduce-scatters: where
    some may go from the backend's copy, which the cap must not count ([Note: bucket paths])."""
    tuning = config.tuning
    chooses_from_copy = _backend(annotated).copies_reduce_scatter_input and tuning.reduce_from_copy_max_slowdown is not None
    return chooses_from_copy and tuning.bucket_reduce_scatter_blocks is not None


def _backend(annotated: AnnotatedTrace):
    """The backend of the buckets the trace runs (all share the FSDP process group)."""
    return next(iter(annotated.layouts.values())).backend
