"""The state one ``fsdp()`` model's transforms share ([Note: model state] in docs/design.md).

:func:`~thunder_overlap.api.fsdp_transforms` makes one :class:`ModelState` per model and hands it
to each transform it builds. The transforms read and write it and never each other: the blocks
(found once), the buckets and the layouts they run with, which parameter each trace input is, the
rank agreement, and what the forward's schedule leaves for its backward's.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
import torch.nn as nn
from thunder.core.trace import TraceCtx

from thunder_overlap._analysis.blocks import BlockTypes, find_blocks, unsharded_bytes
from thunder_overlap._analysis.classify import AnnotatedTrace, parameter_names_of_inputs
from thunder_overlap._analysis.layout import BucketLayout
from thunder_overlap._analysis.memory_estimate import MemoryEstimate
from thunder_overlap._bucketing.buffers import BucketBuffers
from thunder_overlap._bucketing.module_plan import bucket_slots, make_buckets
from thunder_overlap._bucketing.path_choice import PathChoice
from thunder_overlap._bucketing.plan import BucketPlanSummary
from thunder_overlap._bucketing.plan_choice import PLANS_TIED, BucketPlanChoice, PlanCandidate
from thunder_overlap._bucketing.pool import BufferPool
from thunder_overlap._bucketing.trace_rewrite import BucketIndex, forward_input_names, rewrite_bucket_collectives
from thunder_overlap._scheduling.dispatch import ScheduledTrace
from thunder_overlap._scheduling.rank_agreement import IssueOrderAgreement, agree_settings, summed_over_ranks
from thunder_overlap._transforms.replicate import with_replica_all_reduces
from thunder_overlap.config import OverlapConfig

__all__ = ["ForwardHandoff", "ModelState"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ForwardHandoff:
    """What the backward's schedule takes from its forward's: Thunder compiles a backward right
    after its forward, whose outputs are the backward's inputs. ``memory`` is the forward's
    estimate as scheduled, ``budget_basis`` its just-in-time order's, which the budget is
    relative to, and ``schedule`` the forward's schedule, which the backward's compile may redo
    within the step's budget ([Note: the step's budget])."""

    memory: MemoryEstimate
    budget_basis: MemoryEstimate | None
    schedule: ScheduledTrace | None = None


@dataclass(eq=False)
class ModelState:
    """What the transforms of one model share, each piece written by one of them.

    Set when made: the scheduler's ``config``, the ``block_types`` blocks are found by, the
    ``settings`` ranks compare at the first compile (with the configuration's), the
    ``agreement_group`` they agree over (None: the group of the traces' collectives; hybrid
    sharding's is the world) and hybrid sharding's ``replicate_group``, across which a step's
    predictions all-reduce each reduced shard as the compile does.
    """

    config: OverlapConfig = field(default_factory=OverlapConfig)
    block_types: BlockTypes | None = None
    settings: Mapping[str, object] = field(default_factory=dict)
    agreement_group: dist.ProcessGroup | None = None
    replicate_group: dist.ProcessGroup | None = None

    # The blocks, found once (find_blocks), and the largest one's unsharded bytes, measured then:
    # once the shards are placed in the module its parameters are sharded.
    blocks: list[tuple[str, nn.Module]] | None = None
    largest_block_bytes: int | None = None

    # The buckets (BucketingTransform.transform_module): their buffers, the FSDP group they
    # reduce over, which were formed and why, and each parameter's (every alias of a tied one)
    # (index into buckets, slot).
    buckets: list[BucketBuffers] = field(default_factory=list)
    bucket_group: dist.ProcessGroup | None = None
    bucket_plan: BucketPlanSummary | None = None
    bucket_slots: dict[str, tuple[int, int]] = field(default_factory=dict)
    # The pool the buckets' unsharded buffers come from, and the module's parameters by name (the
    # mapping the module reads them from), which are views of the buckets' flat shards.
    pool: BufferPool = field(default_factory=BufferPool)
    module_parameters: Mapping[str, nn.Parameter] = field(default_factory=dict)
    # "auto"'s other plan, block buckets, until the first compile chooses between them ([Note:
    # auto against block]), and that choice.
    plan_alternative: PlanCandidate | None = None
    plan_choice: BucketPlanChoice | None = None

    # Computation-trace input name -> parameter name, from every prologue seen.
    parameter_of_input: dict[str, str] = field(default_factory=dict)

    # Rank agreement: the settings, compared once before any other exchange, then each pass's
    # issue order ([Note: rank agreement]).
    settings_agreed: bool = False
    agreement: IssueOrderAgreement = field(init=False)

    # Plain ZeRO3's just-in-time step peak with nothing kept, where it keeps what is free: the
    # least its passes' budgets are relative to, so that keeping takes no room from prefetching
    # ([Note: ZeRO3 keeps what is free]). Set by its choice at the first compile.
    regather_all_peak_bytes: int | None = None
    # The last forward's schedule, for its backward's; None where the forward has no collective.
    forward: ForwardHandoff | None = None
    # The buckets' paths, chosen at the first backward that reduce-scatters them.
    bucket_paths: PathChoice | None = None
    # The traces the schedule transform returned, by identity: what the report tells apart from
    # the traces before scheduling in Thunder's history (its unscheduled baseline).
    scheduled: weakref.WeakSet[TraceCtx] = field(default_factory=weakref.WeakSet)

    def __post_init__(self) -> None:
        self.settings = {**self.config.agreed_fields(), **self.settings}
        self.agreement = IssueOrderAgreement(exchange=self.config.tuning.check_ranks_agree)

    # --- blocks ---------------------------------------------------------------------------------

    def find_blocks(self, module: nn.Module) -> list[tuple[str, nn.Module]]:
        """The blocks of ``module`` (the model as the user gave it), found at the first call."""
        if self.blocks is None:
            self.blocks = find_blocks(module, self.block_types)
            self.largest_block_bytes = max((unsharded_bytes(block) for _, block in self.blocks), default=None)
        return self.blocks

    @property
    def prefetch_unit_bytes(self) -> int | None:
        """What the default in-flight limits count in: the largest block, or the largest bucket
        where buckets hold several blocks (``auto``)."""
        bucket = self.largest_bucket_bytes()
        if bucket is None or self.largest_block_bytes is None:
            return self.largest_block_bytes
        return max(self.largest_block_bytes, bucket)

    # --- inputs ---------------------------------------------------------------------------------

    def record_inputs(self, prologue_trace: TraceCtx, computation_trace: TraceCtx) -> None:
        """Records which parameter each input of ``computation_trace`` is, from its prologue."""
        self.parameter_of_input.update(parameter_names_of_inputs(prologue_trace, computation_trace))

    # --- buckets --------------------------------------------------------------------------------

    @property
    def layouts(self) -> dict[BucketBuffers, BucketLayout]:
        """Each bucket's layout, keyed by the bucket object the traces name: what analysis of
        this model's traces takes (``layouts=``); empty without buckets."""
        return {bucket: bucket.layout for bucket in self.buckets}

    def set_layouts(self, layouts: Mapping[BucketBuffers, BucketLayout]) -> None:
        """Runs each bucket with its layout in ``layouts`` from the next step on."""
        for bucket in self.buckets:
            bucket.layout = layouts.get(bucket, bucket.layout)

    def plan_digest(self) -> str | None:
        """The bucket plan's hash, which ranks compare before their first collective."""
        return self.bucket_plan.digest if self.bucket_plan is not None else None

    def largest_bucket_bytes(self) -> int | None:
        """The largest bucket's gathered (unsharded, padded) bytes; None without buckets."""
        plan = self.bucket_plan
        return max((b.unsharded_bytes for b in plan.buckets), default=None) if plan is not None else None

    def bucket_of_parameter(self, name: str) -> BucketBuffers | None:
        """The bucket holding parameter ``name`` (any alias); None if unbucketed."""
        located = self.bucket_slots.get(name)
        return self.buckets[located[0]] if located is not None else None

    def slot_of_input(self, name: str) -> tuple[int, int] | None:
        """(index into :attr:`buckets`, slot) of the parameter computation-trace input ``name`` is."""
        parameter = self.parameter_of_input.get(name)
        return self.bucket_slots.get(parameter) if parameter is not None else None

    def bucket_index(self) -> BucketIndex:
        return BucketIndex(self.buckets, self.bucket_group, self.slot_of_input)

    def bucketed(self, forward: TraceCtx, backward: TraceCtx) -> tuple[TraceCtx, TraceCtx]:
        """A forward and its backward with their collectives bucketed as the bucketing transform
        buckets them (nothing recorded), for estimates made before it runs (sharding "auto");
        unchanged without buckets."""
        if not self.buckets:
            return forward, backward
        index = self.bucket_index()
        bucketed_forward, _ = rewrite_bucket_collectives(forward, index)
        bucketed_backward, _ = rewrite_bucket_collectives(backward, index, forward_inputs=forward_input_names(forward))
        if self.replicate_group is not None:
            bucketed_backward, _ = with_replica_all_reduces(bucketed_backward, self.replicate_group)
        return bucketed_forward, bucketed_backward

    # --- auto's plan against block's ([Note: auto against block]) ---------------------------------

    def choose_plan(self, step_ms_of: Callable[[ModelState], float], group: dist.ProcessGroup | None) -> bool:
        """Prices the step with the buckets laid out and with :attr:`plan_alternative`'s
        (``step_ms_of`` a state with those buckets: ``inf`` where it cannot run), agrees with the
        ranks of ``group`` (None: this rank alone) on the faster and adopts it. True where the
        alternative was adopted; once per model, at its first compile with a backward."""
        alternative, self.plan_alternative = self.plan_alternative, None
        step_ms = [step_ms_of(self), step_ms_of(self.priced_with(alternative))]
        planned_ms, alternative_ms = summed_over_ranks(step_ms, group if self.config.tuning.check_ranks_agree else None)
        # A tie within the prediction's error goes to block buckets, the plan "auto" must not lose to.
        adopted = math.isfinite(alternative_ms) and not planned_ms < alternative_ms * (1 - PLANS_TIED)
        planned, other = self.bucket_plan, alternative.summary
        self.plan_choice = BucketPlanChoice(
            {planned.strategy: planned_ms, other.strategy: alternative_ms},
            other.strategy if adopted else planned.strategy,
            planned if adopted else other,
        )
        logger.info("%s", self.plan_choice)
        if adopted:
            self.adopt(alternative)
        return adopted

    def priced_with(self, candidate: PlanCandidate) -> ModelState:
        """A copy of this state with ``candidate``'s buckets, on the meta device: for pricing a
        step (:meth:`bucketed`, :attr:`layouts`), never to run one."""
        buckets, pool = make_buckets(
            candidate.plans, self._shards(), candidate.unsharded_numels, self.bucket_group, candidate.mixed_precision, priced_only=True
        )
        slots = bucket_slots(buckets, candidate.aliases)
        return replace(self, buckets=buckets, pool=pool, bucket_plan=candidate.summary, bucket_slots=slots)

    def adopt(self, candidate: PlanCandidate) -> None:
        """Lays ``candidate``'s buckets out in new flat buffers, with the values the parameters
        hold now, and points each parameter (the same object: an optimizer made before keeps it)
        at its new shard. Before any trace with the old buckets has run."""
        buckets, pool = make_buckets(
            candidate.plans, self._shards(), candidate.unsharded_numels, self.bucket_group, candidate.mixed_precision
        )
        slots = bucket_slots(buckets, candidate.aliases)
        for name, (index, slot) in slots.items():
            self.module_parameters[name].data = buckets[index].shard_view(slot)
        self.buckets, self.pool, self.bucket_plan, self.bucket_slots = buckets, pool, candidate.summary, slots

    def _shards(self) -> dict[str, torch.Tensor]:
        """Each bucketed parameter's shard as it is now, by name."""
        return {slot.name: bucket.shard_view(i) for bucket in self.buckets for i, slot in enumerate(bucket.plan.slots)}

    # --- rank agreement -------------------------------------------------------------------------

    def agreement_group_of(self, annotated: AnnotatedTrace) -> dist.ProcessGroup | None:
        """The group ranks agree over: the one given, else that of ``annotated``'s collectives."""
        return self.agreement_group if self.agreement_group is not None else annotated.process_group

    def agree_settings_once(self, group: dist.ProcessGroup | None) -> None:
        """Compares the settings and bucket plans with the other ranks', once, before any other
        exchange (settings that differ would make ranks exchange differently)."""
        if not self.settings_agreed:
            agree_settings(self.settings, self.plan_digest(), group)
            self.settings_agreed = True

