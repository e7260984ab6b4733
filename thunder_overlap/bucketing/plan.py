"""Which parameters share a bucket, and where each one lives in the bucket's flat buffer.

A bucket is a group of parameter shards that one all-gather and one reduce-scatter move
together. ``plan_buckets`` groups the sharded parameters of a module by block (a transformer
block, as :func:`~thunder_overlap.analysis.blocks.find_blocks` finds them) or by layer (the module that
owns the parameter), splits each group by dtype and by ``requires_grad`` (a collective moves one
dtype, and frozen parameters have no gradient to reduce), and then by an optional size cap.

Slots are laid out back to back in the order of ``named_parameters()``; a slot's offset is where
its shard starts in the bucket's flat shard buffer (and in its flat gradient shard).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from thunder_overlap.analysis.blocks import find_blocks
from thunder_overlap.options import BucketingStrategy, parse_bucketing_strategy

__all__ = ["BucketPlan", "BucketSlot", "bucket_owner", "plan_buckets"]


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


def bucket_owner(module: nn.Module, strategy: BucketingStrategy | str) -> dict[str, str]:
    """Parameter name -> the name of the group it is bucketed with.

    ``LAYER``: the module that owns the parameter. ``BLOCK``: the transformer block holding
    it; parameters outside every block (embeddings, final norm, head) fall back to their module.
    Works on the original (possibly meta) module: only names are read.
    """
    parsed = parse_bucketing_strategy(strategy)
    if not parsed.has_buckets:
        raise ValueError(f"bucketing strategy {strategy!r} has no buckets; accepted: 'layer', 'block'")
    block_prefixes = [f"{name}." for name, _ in find_blocks(module)] if parsed is BucketingStrategy.BLOCK else []
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
    groups: dict[tuple[str, torch.dtype, bool], list[tuple[str, torch.Tensor]]] = {}
    for name, shard in shards:
        if name not in owners:
            raise KeyError(f"parameter {name!r} has no bucket owner; known: {sorted(owners)[:5]}...")
        groups.setdefault((owners[name], shard.dtype, shard.requires_grad), []).append((name, shard))

    plans: list[BucketPlan] = []
    for (owner, dtype, requires_grad), members in groups.items():
        label = owner or "<root>"
        if dtype != torch.float32 or not requires_grad:
            label += f" ({str(dtype).removeprefix('torch.')}{'' if requires_grad else ', frozen'})"
        pieces: list[list[tuple[str, torch.Tensor]]] = [[]]
        piece_bytes = 0
        for name, shard in members:
            unsharded = shard.numel() * shard.element_size() * world_size
            if cap_bytes is not None and pieces[-1] and piece_bytes + unsharded > cap_bytes:
                pieces.append([])
                piece_bytes = 0
            pieces[-1].append((name, shard))
            piece_bytes += unsharded
        for i, piece in enumerate(pieces):
            slots, offset = [], 0
            for name, shard in piece:
                slots.append(BucketSlot(name, tuple(shard.shape), offset))
                offset += shard.numel()
            suffix = f" [{i + 1}/{len(pieces)}]" if len(pieces) > 1 else ""
            plans.append(BucketPlan(label + suffix, dtype, requires_grad, tuple(slots)))
    return plans
