"""Which parameters share a bucket, and where each one lives in the bucket's flat buffer.

A bucket is a group of parameter shards that one all-gather and one reduce-scatter move
together. ``plan_buckets`` groups the sharded parameters of a module by block (a transformer
block, as :func:`~thunder_overlap._analysis.blocks.find_blocks` finds them) or by layer (the module that
owns the parameter), splits each group by dtype and by ``requires_grad`` (a collective moves one
dtype, and frozen parameters have no gradient to reduce), and then by an optional size cap.
``bucketing_strategy="auto"`` sizes buckets with the cost model instead
(:mod:`~thunder_overlap._bucketing.auto_plan`).

Slots are laid out back to back in the order of ``named_parameters()``; a slot's offset is where
its shard starts in the bucket's flat shard buffer (and in its flat gradient shard).

Every strategy's plan is described by a :class:`BucketPlanSummary` (which buckets, how large,
their estimated latency share, why each ends where it does) and identified by
:func:`plan_digest`, which ranks compare before their first collective.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import torch
import torch.nn as nn

from thunder_overlap._analysis.cost_model import CostModel
from thunder_overlap.options import BucketingStrategy, MixedPrecision

__all__ = [
    "BucketChoice",
    "BucketEnd",
    "BucketPlan",
    "BucketPlanSummary",
    "BucketSlot",
    "bucket_owner",
    "plan_buckets",
    "plan_digest",
    "summarize_plans",
]


@dataclass(frozen=True)
class BucketSlot:
    """One parameter shard inside a bucket."""

    name: str
    # The shard's shape (padded as Thunder pads it): rows = ceil(unsharded rows / world size).
    shard_shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shard_shape)


@dataclass(frozen=True)
class BucketPlan:
    """The parameters one all-gather and one reduce-scatter move together."""

    label: str
    dtype: torch.dtype
    requires_grad: bool
    slots: tuple[BucketSlot, ...]

    @property
    def shard_numel(self) -> int:
        """Elements of this rank's flat shard: what the all-gather sends per rank."""
        return sum(s.numel for s in self.slots)


def bucket_owner(module: nn.Module, strategy: BucketingStrategy, block_names: Sequence[str] = ()) -> dict[str, str]:
    """Parameter name -> the name of the group it is bucketed with.

    ``LAYER``: the module that owns the parameter. ``BLOCK`` (and ``AUTO``, whose buckets prefer
    to end where a group does): the transformer block holding it, one of ``block_names`` (as
    :func:`~thunder_overlap._analysis.blocks.find_blocks` names them); parameters outside every
    block (embeddings, final norm, head) fall back to their module. Works on the original
    (possibly meta) module: only names are read.
    """
    if not strategy.has_buckets:
        raise ValueError(f"bucketing strategy {strategy.value!r} has no buckets; accepted: 'layer', 'block', 'auto'")
    by_block = strategy in (BucketingStrategy.BLOCK, BucketingStrategy.AUTO)
    block_prefixes = [f"{name}." for name in block_names] if by_block else []
    owners: dict[str, str] = {}
    for name, _ in module.named_parameters(remove_duplicate=False):
        block = next((p[:-1] for p in block_prefixes if name.startswith(p)), None)
        owners[name] = block if block is not None else name.rpartition(".")[0]
    return owners


def plan_buckets(
    shards: list[tuple[str, torch.Tensor]],
    owners: dict[str, str],
    *,
    world_size: int,
    cap_bytes: int | None = None,
) -> list[BucketPlan]:
    """Groups ``shards`` (name and sharded parameter, each tensor once) into buckets.

    Groups keep the order in which their first parameter appears, and slots the order of
    ``shards``. With ``cap_bytes``, a group is cut before the slot that would make the bucket's
    unsharded size (shard bytes x ``world_size``) exceed it; a parameter larger than the cap gets
    a bucket of its own.
    """
    return [plan for plan, _ in plan_buckets_with_ends(shards, owners, world_size=world_size, cap_bytes=cap_bytes)]


def plan_buckets_with_ends(
    shards: list[tuple[str, torch.Tensor]],
    owners: dict[str, str],
    *,
    world_size: int,
    cap_bytes: int | None = None,
    mixed_precision: MixedPrecision | None = None,
) -> list[tuple[BucketPlan, BucketEnd]]:
    """:func:`plan_buckets`, each bucket with why it ends: its group does, or the cap (counted in
    the bytes each all-gather moves under ``mixed_precision``)."""
    groups: dict[tuple[str, torch.dtype, bool], list[tuple[str, torch.Tensor]]] = {}
    for name, shard in shards:
        if name not in owners:
            raise KeyError(f"parameter {name!r} has no bucket owner; known: {sorted(owners)[:5]}...")
        groups.setdefault((owners[name], shard.dtype, shard.requires_grad), []).append((name, shard))

    planned: list[tuple[BucketPlan, BucketEnd]] = []
    for (owner, dtype, requires_grad), members in groups.items():
        pieces: list[list[tuple[str, torch.Tensor]]] = [[]]
        piece_bytes = 0
        for name, shard in members:
            unsharded = unsharded_bytes_of(shard, world_size, mixed_precision)
            if cap_bytes is not None and pieces[-1] and piece_bytes + unsharded > cap_bytes:
                pieces.append([])
                piece_bytes = 0
            pieces[-1].append((name, shard))
            piece_bytes += unsharded
        for i, piece in enumerate(pieces):
            suffix = f" [{i + 1}/{len(pieces)}]" if len(pieces) > 1 else ""
            ended = BucketEnd.GROUP if i == len(pieces) - 1 else BucketEnd.CAP
            planned.append((make_plan(owner + suffix, piece, dtype, requires_grad), ended))
    return planned


def gather_dtype_of(dtype: torch.dtype, mixed_precision: MixedPrecision | None) -> torch.dtype:
    """The dtype a parameter (or bucket) of ``dtype`` is all-gathered in."""
    cast = mixed_precision.dtypes_for(dtype) if mixed_precision is not None else None
    return dtype if cast is None else cast[0]


def unsharded_bytes_of(shard: torch.Tensor, world_size: int, mixed_precision: MixedPrecision | None = None) -> int:
    """What one all-gather of ``shard`` on ``world_size`` ranks produces, padding included, in the
    dtype ``mixed_precision`` gathers it in: what the collective moves and a prefetch holds."""
    return shard.numel() * gather_dtype_of(shard.dtype, mixed_precision).itemsize * world_size


def make_plan(owner_label: str, members: list[tuple[str, torch.Tensor]], dtype: torch.dtype, requires_grad: bool) -> BucketPlan:
    """A bucket of ``members`` (name and shard), slots back to back in that order."""
    label = owner_label or "<root>"
    if dtype != torch.float32 or not requires_grad:
        label += f" ({str(dtype).removeprefix('torch.')}{'' if requires_grad else ', frozen'})"
    slots, offset = [], 0
    for name, shard in members:
        slots.append(BucketSlot(name, tuple(shard.shape), offset))
        offset += shard.numel()
    return BucketPlan(label, dtype, requires_grad, tuple(slots))


# --- what was planned, and why ------------------------------------------------------------------


class BucketEnd(str, Enum):
    """Why a bucket ends where it does."""

    # auto: it reached the size that saturates bandwidth.
    SATURATED = "saturated"
    # The next parameter would take it over the cap (bucket_cap_mb, the prefetch limit or the
    # memory slack, whichever is smallest).
    CAP = "cap"
    # auto: the next block fits under the cap on its own but not beside this bucket; cutting here
    # keeps it whole.
    BLOCK_BOUNDARY = "block boundary"
    # auto: adding the next parameter would cost more copy time (its bucket's copy-out and
    # lay-out) than the launch latency it saves.
    COPY = "copy"
    # auto: the last parameters of its dtype (a small remainder merges into the bucket before it).
    END = "end"
    # layer/block: its module or block ends.
    GROUP = "group"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class BucketChoice:
    """One bucket of a plan and why it was formed so."""

    label: str
    parameters: tuple[str, ...]
    # The blocks and modules (outside blocks) it holds parameters of, in order.
    owners: tuple[str, ...]
    unsharded_bytes: int
    # Share of one all-gather's estimated time that is launch latency.
    latency_share: float
    ended: BucketEnd


@dataclass(frozen=True)
class BucketPlanSummary:
    """The buckets a strategy formed, with the cost model's view of each."""

    strategy: str
    world_size: int
    network: str
    # Latency one launch pays on world_size ranks.
    latency_ms: float
    # auto: the smallest bucket whose latency share is at most Tuning.auto_bucket_latency_share.
    target_bytes: int | None
    # The binding cap and which limit it comes from ("bucket_cap_mb", "prefetch limit", "memory
    # slack"); a block larger than the memory slack, or a parameter larger than any cap, exceeds
    # it, whole in a bucket of its own.
    cap_bytes: int | None
    cap_source: str | None
    buckets: tuple[BucketChoice, ...]
    # plan_digest of the plans: ranks compare it before their first collective.
    digest: str

    def __str__(self) -> str:
        mib = 2**20
        head = f"{self.strategy} buckets on {self.world_size} ranks over {self.network} ({self.latency_ms * 1e3:.0f} us per launch)"
        if self.target_bytes is not None:
            head += f", saturating at {self.target_bytes / mib:.2f} MiB"
        if self.cap_bytes is not None:
            head += f", capped at {self.cap_bytes / mib:.2f} MiB by {self.cap_source}"
            if any(b.unsharded_bytes > self.cap_bytes for b in self.buckets):
                head += " (a block or parameter above it goes whole, alone)"
        rows = [
            f"  {b.label:<40} {b.unsharded_bytes / mib:10.3f} MiB  latency {b.latency_share:6.1%}  {b.ended}" for b in self.buckets
        ]
        return "\n".join([head, *rows])


def plan_digest(plans: list[BucketPlan]) -> str:
    """A short hash of ``plans``: equal on every rank that formed the same buckets."""
    described = [
        (p.label, str(p.dtype), p.requires_grad, [(s.name, list(s.shard_shape), s.offset) for s in p.slots]) for p in plans
    ]
    return hashlib.sha256(repr(described).encode()).hexdigest()[:16]


def latency_share(cost_model: CostModel, unsharded_bytes: int, world_size: int) -> float:
    """Share of one all-gather of ``unsharded_bytes`` that is launch latency no concurrent
    launch hides (:meth:`CostModel.unhidden_latency_ms`; 0 on one rank)."""
    latency = cost_model.unhidden_latency_ms(unsharded_bytes, world_size)
    total = latency + cost_model.transfer_ms(unsharded_bytes, world_size)
    return latency / total if total > 0 else 0.0


def summarize_plans(
    planned: list[tuple[BucketPlan, BucketEnd]],
    owners: dict[str, str],
    *,
    strategy: BucketingStrategy,
    world_size: int,
    cost_model: CostModel,
    target_bytes: int | None = None,
    cap: tuple[int | None, str | None] = (None, None),
    mixed_precision: MixedPrecision | None = None,
) -> BucketPlanSummary:
    """The summary of ``planned`` buckets (with why each ends) under ``cost_model``; each bucket's
    bytes are what its all-gather moves (in the dtype ``mixed_precision`` gathers it in)."""
    choices = []
    for plan, ended in planned:
        size = plan.shard_numel * gather_dtype_of(plan.dtype, mixed_precision).itemsize * world_size
        bucket_owners = tuple(dict.fromkeys(owners[s.name] for s in plan.slots))
        choices.append(
            BucketChoice(
                plan.label, tuple(s.name for s in plan.slots), bucket_owners, size, latency_share(cost_model, size, world_size), ended
            )
        )
    plans = [plan for plan, _ in planned]
    return BucketPlanSummary(
        strategy=str(strategy),
        world_size=world_size,
        network=cost_model.network.name,
        latency_ms=cost_model.latency_ms(world_size),
        target_bytes=target_bytes,
        cap_bytes=cap[0],
        cap_source=cap[1],
        buckets=tuple(choices),
        digest=plan_digest(plans),
    )

