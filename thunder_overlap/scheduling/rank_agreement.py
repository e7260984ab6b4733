"""Ranks agree: every rank must issue the same collectives in the same order, or they hang.

:func:`check_ranks_agree` compares a digest of the collective issue order across the ranks of a
process group; :func:`agreed_cost_model` makes a measured cost model (whose timings differ a
little on every rank) answer with the first rank's estimates, so that every rank schedules alike.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from thunder_overlap.analysis.classify import AnnotatedTrace, NodeKind
from thunder_overlap.analysis.cost_model import CostModel

__all__ = ["agreed_cost_model", "check_ranks_agree"]


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


def check_ranks_agree(annotated: AnnotatedTrace, order: list[int]) -> None:
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


def agreed_cost_model(cost_model: CostModel, annotated: AnnotatedTrace, group: dist.ProcessGroup) -> CostModel:
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
