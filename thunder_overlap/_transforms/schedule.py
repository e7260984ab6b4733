"""Overlap scheduling of the forward and backward execution traces."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import replace

from thunder.core.devices import to_torch_device
from thunder.core.proxies import TensorProxy
from thunder.core.trace import TraceCtx, TraceTag
from thunder.core.transform_common import Transform
from torch.distributed import ProcessGroup

from thunder_overlap._analysis.blocks import BlockTypes, largest_block_bytes
from thunder_overlap._analysis.classify import AnnotatedTrace, classify_trace, find_swallowed_collectives
from thunder_overlap._analysis.cost_model import CostModel
from thunder_overlap._analysis.memory_estimate import MemoryEstimate, estimate_memory
from thunder_overlap._bucketing.path_choice import BucketChange, BucketPathChoice, apply_choice, choose_buckets
from thunder_overlap._bucketing.per_tensor_gathers import GATHER_PER_TENSOR
from thunder_overlap._bucketing.reduce_from_copy import REDUCE_FROM_COPY
from thunder_overlap._bucketing.reduce_in_pool import reduce_in_pool_where_idle
from thunder_overlap._scheduling.dispatch import ScheduledTrace, schedule_trace
from thunder_overlap._scheduling.issue_order import IssueOrder, issue_order_of
from thunder_overlap._scheduling.rank_agreement import IssueOrderAgreement, collective_keys
from thunder_overlap._scheduling.summary import ScheduleSummary
from thunder_overlap.config import OverlapConfig

__all__ = ["OverlapScheduleTransform"]


class OverlapScheduleTransform(Transform):
    """Reorders collectives and waits around Thunder's compute order (see ``scheduling``).

    Compute keeps its order; all-gathers move up to prefetch within the configured limits,
    reduce-scatters move up to right after their gradient, waits move down to their first use.
    What the scheduler decided for the last forward and backward is kept in :attr:`summaries`.

    ``block_types`` names the module classes that form blocks (None: detected), which size the
    default prefetch limits; ``plan_digest`` returns the bucket plan's hash (None without
    buckets), which ranks compare when they agree on the issue order; ``largest_bucket_bytes``
    returns the largest bucket's bytes, the unit of prefetching where buckets outgrow blocks;
    ``agreement_group`` is the group ranks agree on their issue order over (None: the group of
    the traces' collectives; hybrid sharding passes the world).
    """

    def __init__(
        self,
        config: OverlapConfig | None = None,
        *,
        block_types: BlockTypes | None = None,
        plan_digest: Callable[[], str | None] | None = None,
        largest_bucket_bytes: Callable[[], int | None] | None = None,
        agreement_group: ProcessGroup | None = None,
    ) -> None:
        self.config = config if config is not None else OverlapConfig()
        self.block_types = block_types
        # Sizes the default prefetch limits; None until transform_module sees the model.
        self.largest_block_bytes: int | None = None
        self._largest_bucket_bytes = largest_bucket_bytes
        self.summaries: dict[str, ScheduleSummary] = {}
        self.agreement = IssueOrderAgreement(exchange=self.config.check_ranks_agree, plan_digest=plan_digest)
        # The last forward's memory estimate: Thunder compiles a backward right after its
        # forward, whose outputs are the backward's inputs (persistent shards, shared storages).
        self._forward_memory: MemoryEstimate | None = None
        # Where the traces' collectives use several groups (hybrid sharding), ranks must agree
        # across all of them: the world. None: the group of the traces' collectives.
        self.agreement_group = agreement_group
        # The buckets whose reduce-scatters go from the backend's copy, then those gathered per
        # parameter: as chosen (with the predictions behind the choice) and as agreed by the
        # ranks, at the backward's first compile.
        self.reduce_from_copy_choice: BucketPathChoice | None = None
        self.reduces_from_copy: list[str] = []
        self.per_tensor_gather_choice: BucketPathChoice | None = None
        self.per_tensor_gathers: list[str] = []

    def transform_module(self, model) -> None:
        # The original module still has the unsharded shapes (on meta once FSDP released it).
        self.largest_block_bytes = largest_block_bytes(model._model, self.block_types)
        if self.largest_block_bytes is None and self.config.policy in ("memory_aware", "heuristic"):
            warnings.warn(
                f"thunder_overlap: {type(model._model).__name__} has no nn.ModuleList/nn.Sequential of blocks to "
                f"size prefetching by (name them with block_types=); limiting all-gathers in flight to "
                f"{self.config.fallback_in_flight_allgathers} "
                "and leaving reduce-scatter bytes unbounded unless OverlapConfig sets limits",
                stacklevel=2,
            )

    @property
    def prefetch_unit_bytes(self) -> int | None:
        """What the default in-flight limits count in (``OverlapConfig.prefetch_blocks`` of
        them): the largest block, or the largest bucket where buckets hold several blocks
        (``auto``), so that one bucket can arrive while the one before it is still in flight."""
        bucket = self._largest_bucket_bytes() if self._largest_bucket_bytes is not None else None
        if bucket is None or self.largest_block_bytes is None:
            return self.largest_block_bytes
        return max(self.largest_block_bytes, bucket)

    @staticmethod
    def of(module) -> OverlapScheduleTransform | None:
        """The schedule transform of a module ``thunder_overlap.fsdp`` returned, if any."""
        from thunder import compile_data

        return next((t for t in compile_data(module).transforms if isinstance(t, OverlapScheduleTransform)), None)

    def transform_trace_post_optimization(self, computation_trace: TraceCtx, **kwargs) -> TraceCtx:
        swallowed = find_swallowed_collectives(computation_trace)
        if swallowed:
            executors = [ex.name for ex in kwargs.get("executors_list", ())]
            raise RuntimeError(
                f"thunder_overlap: collectives were fused into {swallowed}, so they cannot be scheduled. "
                f"Executors in use: {executors}. Leave out executors that fuse communication "
                "(such as 'torchcompile'); nvFuser and the torch executor keep collectives top-level."
            )
        annotated = classify_trace(computation_trace)
        pass_name = "backward" if TraceTag.BACKWARD in computation_trace.tags else "forward"
        if not annotated.collectives:
            if pass_name == "forward":
                self._forward_memory = None
            return computation_trace
        keys = collective_keys(annotated)
        agreed = self.agreement.agreed_order(pass_name, keys)
        first_compile = agreed is None
        agreed_launches = self.agreement.agreed_launches(pass_name, keys)
        # The backward's first compile chooses which lay-outs go to the backend's copy, from a
        # schedule whose cap on reduce-scatters holding pool buffers is lifted: capped, the
        # choice would be made for a schedule that is about to change (see _choose_bucket_paths).
        chooses_paths = pass_name == "backward" and first_compile and self._forward_memory is not None and annotated.runs_buckets
        config = replace(self.config, bucket_reduce_scatter_blocks=None) if chooses_paths else self.config
        scheduled = self._schedule(annotated, agreed, agreed_launches, config)
        if agreed is None:
            # This pass compiles for the first time, on every rank at once: agree on its order
            # and on which collectives launch together.
            own = issue_order_of(annotated, scheduled.order)
            own_launches = [list(launch.members) for launch in scheduled.launches]
            group = self.agreement_group if self.agreement_group is not None else _process_group(annotated)
            agreed = self.agreement.agree(pass_name, keys, own, group, own_launches)
            agreed_launches = self.agreement.agreed_launches(pass_name, keys)
            if agreed != own or agreed_launches != own_launches:
                scheduled = self._schedule(annotated, agreed, agreed_launches, config)
        if chooses_paths:
            scheduled = self._choose_bucket_paths(scheduled, annotated, agreed, agreed_launches)
        if scheduled.summary is not None:
            self.summaries[pass_name] = scheduled.summary
        if pass_name == "forward":
            self._forward_memory = scheduled.memory
        return scheduled.trace

    def _choose_bucket_paths(
        self, scheduled: ScheduledTrace, annotated: AnnotatedTrace, issue_order: list[int], launches: list[list[int]] | None
    ) -> ScheduledTrace:
        """Once, at the backward's first compile, where every rank is there to agree, given the
        backward ``scheduled`` without the cap on reduce-scatters holding pool buffers: buckets
        reduce-scatter from the backend's copy where holding their lay-out to the wait would make
        the pool hold a buffer the step can spare (``OverlapConfig.reduce_from_copy_max_slowdown``);
        the backward is scheduled again, capped, in the agreed issue order and launches; buckets
        gather per parameter where their copy-out would make the pool hold a spare buffer
        (``per_tensor_gather_max_slowdown``), then reduce in place in pool buffers idle to the
        step's end (``reduce_in_pool``). Returns the backward as it then runs; the summaries'
        predicted peaks follow."""
        group = self.agreement_group if self.agreement_group is not None else _process_group(annotated)
        exchange = self.config.check_ranks_agree
        memory = scheduled.memory
        self.reduce_from_copy_choice, self.reduces_from_copy = self._choose(
            REDUCE_FROM_COPY, self.config.reduce_from_copy_max_slowdown, scheduled.trace, group, exchange
        )
        if self.config.bucket_reduce_scatter_blocks is not None:
            # Capped now, the lay-outs still held to their wait are the ones counted: a cap
            # applied before that choice would count those going to the backend's copy, which
            # hold their buffer for the launch only, force waits for them that buy no buffer,
            # and let the choice leave out a bucket it would have taken.
            scheduled = self._schedule(classify_trace(annotated.trace), issue_order, launches, self.config)
            memory = scheduled.memory
        elif self.reduces_from_copy:
            memory = None  # estimated before those buckets changed
        self.per_tensor_gather_choice, self.per_tensor_gathers = self._choose(
            GATHER_PER_TENSOR, self.config.per_tensor_gather_max_slowdown, scheduled.trace, group, exchange
        )
        if self.per_tensor_gathers:
            memory = None
        if self.config.reduce_in_pool:
            memory = memory or estimate_memory(scheduled.trace, after=self._forward_memory)
            if reduce_in_pool_where_idle(memory, group, exchange=exchange):
                memory = None
        summary = scheduled.summary
        if memory is None and summary is not None and summary.peak_bytes is not None:
            summary.peak_bytes = estimate_memory(scheduled.trace, after=self._forward_memory).peak_bytes
        return scheduled

    def _choose(
        self, change: BucketChange, max_slowdown: float | None, backward: TraceCtx, group: ProcessGroup | None, exchange: bool
    ) -> tuple[BucketPathChoice | None, list[str]]:
        """The choice of buckets to switch to ``change`` (None where ``max_slowdown`` is), and
        the labels the ranks agreed on; a change the forward sees re-estimates its memory."""
        if max_slowdown is None:
            return None, []
        forward = self._forward_memory.trace
        reduce_in_pool = self.config.reduce_in_pool
        choice = choose_buckets(forward, backward, change, self._cost_model, max_slowdown=max_slowdown, reduce_in_pool=reduce_in_pool)
        labels = apply_choice(choice, change, group, exchange=exchange)
        if labels:
            self._forward_memory = estimate_memory(forward)
            forward_summary = self.summaries.get("forward")
            if forward_summary is not None and forward_summary.peak_bytes is not None:
                forward_summary.peak_bytes = self._forward_memory.peak_bytes
        return choice, labels

    def _schedule(
        self, annotated: AnnotatedTrace, issue_order: list[int] | None, launches: list[list[int]] | None, config: OverlapConfig
    ) -> ScheduledTrace:
        is_backward = TraceTag.BACKWARD in annotated.trace.tags
        return schedule_trace(
            annotated,
            config,
            largest_block_bytes=self.prefetch_unit_bytes,
            cost_model=self._cost_model,
            issue_order=None if issue_order is None else IssueOrder.of_sequence(annotated, issue_order),
            launches=launches,
            memory_after=self._forward_memory if is_backward else None,
        )

    def _cost_model(self, annotated: AnnotatedTrace) -> CostModel:
        """The configured cost model, or the default for the device the collectives run on.
        Ranks may estimate differently (measured timings, other shapes): that moves collectives
        relative to compute, never the agreed issue order."""
        if self.config.cost_model is not None:
            return self.config.cost_model
        group = _process_group(annotated)
        start = annotated.nodes[annotated.collectives[0].start].bsym
        device = next(to_torch_device(a.device) for a in start.flat_proxy_args if isinstance(a, TensorProxy))
        return CostModel.for_device(device, group.size() if group is not None else 1)


def _process_group(annotated: AnnotatedTrace):
    return next((c.process_group for c in annotated.collectives if c.process_group is not None), None)
