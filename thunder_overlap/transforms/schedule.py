"""Overlap scheduling of the forward and backward execution traces."""

from __future__ import annotations

import hashlib
import warnings

import torch
import torch.distributed as dist
from thunder.core.devices import to_torch_device
from thunder.core.proxies import TensorProxy
from thunder.core.trace import TraceCtx, TraceTag
from thunder.core.transform_common import Transform

from thunder_overlap.analysis.blocks import largest_block_bytes
from thunder_overlap.analysis.classify import AnnotatedTrace, NodeKind, classify_trace, find_swallowed_collectives
from thunder_overlap.config import OverlapConfig, ScheduleLimits
from thunder_overlap.analysis.cost_model import CostModel
from thunder_overlap.scheduling.scheduler import OverlapScheduler, ScheduleSummary, apply_order, stock_order

__all__ = ["OverlapScheduleTransform"]


class OverlapScheduleTransform(Transform):
    """Reorders collectives and waits around Thunder's compute order (see ``scheduling``).

    Compute keeps its order; all-gathers move up to prefetch within the configured limits,
    reduce-scatters move up to right after their gradient, waits move down to their first use.
    What the scheduler decided for the last forward and backward is kept in :attr:`summaries`.
    """

    def __init__(self, config: OverlapConfig | None = None) -> None:
        self.config = config if config is not None else OverlapConfig()
        self.limits: ScheduleLimits = self.config.limits(largest_block_bytes=None)
        self.summaries: dict[str, ScheduleSummary] = {}

    def transform_module(self, model) -> None:
        # The original module still has the unsharded shapes (on meta once FSDP released it).
        block_bytes = largest_block_bytes(model._model)
        if block_bytes is None and self.config.policy in ("memory_aware", "heuristic"):
            warnings.warn(
                f"thunder_overlap: {type(model._model).__name__} has no nn.ModuleList/nn.Sequential of blocks to "
                f"size prefetching by; limiting all-gathers in flight to {self.config.fallback_in_flight_allgathers} "
                "and leaving reduce-scatter bytes unbounded unless OverlapConfig sets limits",
                stacklevel=2,
            )
        self.limits = self.config.limits(block_bytes)

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
        if not annotated.collectives:
            return computation_trace
        scheduled = None
        if self.config.policy == "stock":
            order = stock_order(annotated)
        else:
            scheduler = OverlapScheduler(annotated, self.limits, self._cost_model(annotated))
            order = scheduler.schedule()
            scheduled = scheduler.checked_trace
            self.summaries["backward" if TraceTag.BACKWARD in computation_trace.tags else "forward"] = scheduler.summary
        if self.config.check_ranks_agree:
            _check_ranks_agree(annotated, order)
        if scheduled is None:
            scheduled = apply_order(annotated, order, provenance=f"thunder_overlap: {self.config.policy} schedule")
        return scheduled

    def _cost_model(self, annotated: AnnotatedTrace) -> CostModel | None:
        if self.limits.prefetch_time_margin is None:
            return None
        group = next((c.process_group for c in annotated.collectives if c.process_group is not None), None)
        cost_model = self.config.cost_model
        if cost_model is None:
            start = annotated.nodes[annotated.collectives[0].start].bsym
            device = next(to_torch_device(a.device) for a in start.flat_proxy_args if isinstance(a, TensorProxy))
            return CostModel.for_device(device, group.size() if group is not None else 1)
        if cost_model.is_measured and group is not None:
            return _agreed(cost_model, annotated, group)
        return cost_model


def _collective_order_digest(annotated: AnnotatedTrace, order: list[int]) -> str:
    """What must match across ranks for the collectives to pair up: kind, dtype and shape of
    each collective, in issue order (where each rank waits is its own business)."""
    signature = []
    for index in order:
        node = annotated.nodes[index]
        if node.kind is NodeKind.COLLECTIVE:
            out = node.bsym.flat_proxy_outs[0]
            signature.append(f"{node.name} {out.dtype} {list(out.shape)}")
    return hashlib.sha256("\n".join(signature).encode()).hexdigest()


def _check_ranks_agree(annotated: AnnotatedTrace, order: list[int]) -> None:
    group = next((c.process_group for c in annotated.collectives if c.process_group is not None), None)
    if group is None or group.size() == 1 or dist.get_backend(group) == "fake":
        return
    digests: list[str | None] = [None] * group.size()
    dist.all_gather_object(digests, _collective_order_digest(annotated, order), group=group)
    if len(set(digests)) > 1:
        mine = dist.get_rank(group)
        others = [r for r, d in enumerate(digests) if d != digests[mine]]
        raise RuntimeError(
            f"thunder_overlap: rank {mine} of the process group would issue its collectives in another order than "
            f"ranks {others}, which would hang at the first differing one. Give every rank the same model, inputs "
            "and OverlapConfig (a measured cost model is agreed automatically), or set check_ranks_agree=False "
            "to skip this check."
        )


def _agreed(cost_model: CostModel, annotated: AnnotatedTrace, group: dist.ProcessGroup) -> CostModel:
    """A cost model answering every op and collective of ``annotated`` with the first rank's
    estimates, so that measured timings, which differ a little on every rank, still give one
    schedule everywhere."""
    compute_ms = [cost_model.compute_ms(n.bsym) for n in annotated.nodes]
    collective_ms = [cost_model.collective_ms(c) for c in annotated.collectives]
    first_rank = [(compute_ms, collective_ms)]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
    dist.broadcast_object_list(first_rank, src=dist.get_global_rank(group, 0), group=group, device=device)
    compute_ms, collective_ms = first_rank[0]
    by_bsym = {id(n.bsym): ms for n, ms in zip(annotated.nodes, compute_ms)}
    by_collective = {id(c): ms for c, ms in zip(annotated.collectives, collective_ms)}
    return CostModel(
        cost_model.device,
        cost_model.network,
        user_estimate=lambda bsym: by_bsym.get(id(bsym)),
        collective_estimate=lambda collective: by_collective.get(id(collective)),
    )
