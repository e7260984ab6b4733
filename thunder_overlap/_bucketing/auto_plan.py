"""``bucketing_strategy="auto"``: bucket boundaries from the cost model that schedules.

Every collective launch pays the network's latency however little it moves, so a bucket should be
large enough that latency is a small share of its time, and no larger than the memory that
prefetching it may take. For each dtype (and ``requires_grad``), parameters are packed greedily,
in first-use order (registration order, which the forward of a transformer follows), into
contiguous buckets:

- a bucket ends as soon as it saturates bandwidth, i.e. once its latency share of one all-gather
  is at most ``Tuning.auto_bucket_latency_share`` (``bytes >= latency x bandwidth x (1 -
  share) / share``, for the actual world size and network; where the backend runs k launches at
  once, the latency another launch's transfer hides does not count), even inside a block: a larger bucket
  saves little latency but arrives later, so the first compute that needs it waits longer, and
  its copy-out grows. Blocks smaller than that merge; on a fast network a block splits into a
  few saturating pieces (where the rest of the block saturates too, so that no bucket holds the
  tail of one block with the head of the next);
- no bucket exceeds the cap: the smallest of ``bucket_cap_mb``, the scheduler's all-gather byte
  limit counted in blocks (a bucket larger than what may be in flight cannot be prefetched at
  all; the scheduler then counts that limit in buckets, so that two may be in flight) and the
  memory budget's fixed slack (prefetching a bucket holds it beside the one in use, beyond the
  just-in-time peak); only ``bucket_cap_mb`` or the prefetch limit splits a block, into pieces in
  buckets of their own, and a block that fits under the cap alone is not split across buckets to
  fill one. A block larger than the memory slack stays whole in a bucket of its own, as ``block``
  buckets keep it: the scheduler holds its prefetch back where the budget has no room, and split
  pieces would pay a launch latency each, which at scale costs more than they hide
  (benchmarks/README.md, the Llama-2-70B row);
- small parameters (norms, biases, embeddings) merge with their neighbours, and a small remainder
  at the end merges into the bucket before it;
- where the backend runs a coalesced launch one collective after another (gloo), merging costs
  copies: a bucket of several tensors is gathered rank-major and copied out (and its gradients
  laid out into one): about ``COPY_BYTES_PER_BYTE`` bytes moved per byte, at memory bandwidth,
  which a one-tensor bucket skips. A parameter joins an unsaturated bucket only where the launch
  latency it saves exceeds the copy time it adds, so on a fast network a parameter that
  saturates the link on its own goes alone, as it would without buckets. Where a coalesced
  launch runs as one (NCCL), a bucket gathers each parameter in place and sends its gradients
  where they are, so merging copies nothing (``merges_copy=False``).

Inductor's pre-bucketing of FSDP collectives sizes buckets from the group's latency and bandwidth
and clips them to fixed bounds; here the size also respects the memory budget, and the latency and
bandwidth come from the same :class:`~thunder_overlap._analysis.cost_model.CostModel` that
schedules. The plan depends only on the parameters, the world size, the network profile and the
configuration, never on input shapes or measured timings, so every rank forms the same buckets
(ranks check: :func:`~thunder_overlap._bucketing.plan.plan_digest`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from thunder_overlap._analysis.cost_model import CostModel, NetworkProfile
from thunder_overlap._bucketing.plan import (
    BucketEnd,
    BucketPlan,
    BucketPlanSummary,
    make_plan,
    summarize_plans,
    unsharded_bytes_of,
)
from thunder_overlap.options import BucketingStrategy, MixedPrecision

__all__ = ["AutoBucketCaps", "Replicas", "plan_auto_buckets", "saturating_bytes"]


@dataclass(frozen=True)
class AutoBucketCaps:
    """The limits on one bucket's unsharded bytes (None: that limit does not apply)."""

    # The user's bucket_cap_mb.
    bucket_cap_bytes: int | None = None
    # The scheduler's all-gather bytes in flight (OverlapConfig's prefetch limit).
    prefetch_bytes: int | None = None
    # The memory budget's fixed slack over the just-in-time order's peak.
    memory_slack_bytes: int | None = None

    def binding(self) -> tuple[int | None, str | None]:
        """The smallest cap and where it comes from; (None, None) when there is none."""
        named = [
            (self.bucket_cap_bytes, "bucket_cap_mb"),
            (self.prefetch_bytes, "prefetch limit"),
            (self.memory_slack_bytes, "memory slack"),
        ]
        present = [(size, name) for size, name in named if size is not None]
        return min(present, key=lambda c: c[0]) if present else (None, None)

    @property
    def splitting(self) -> int | None:
        """The smallest cap that splits a block (the memory slack only stops merges)."""
        return min((c for c in (self.bucket_cap_bytes, self.prefetch_bytes) if c is not None), default=None)


@dataclass(frozen=True)
class Replicas:
    """Hybrid sharding's replicas: each bucket's reduced shard is all-reduced over ``count``
    ranks on ``network`` (the replicate group's)."""

    count: int
    network: NetworkProfile


def saturating_bytes(cost_model: CostModel, world_size: int, latency_share: float, network: NetworkProfile | None = None) -> int:
    """The smallest unsharded size whose all-gather over ``world_size`` ranks on ``network``
    (default: the cost model's) spends at most ``latency_share`` of its time on latency that no
    concurrent launch hides (:meth:`CostModel.unhidden_latency_ms`): with launches in progress at
    once, ``latency - transfer <= share / (1 - share) x transfer``; one at a time, ``transfer >=
    latency x (1 - share) / share``. 0 on one rank (no latency). An all-reduce's two ring passes
    scale both terms alike, so the same size saturates an all-reduce of it."""
    network = network or cost_model.network
    latency_ms = cost_model.latency_ms(world_size, network)
    if latency_ms == 0 or world_size <= 1:
        return 0
    # transfer_ms is linear in bytes; measure its slope on a large size for precision.
    ms_per_byte = cost_model.transfer_ms(1 << 30, world_size, network) / (1 << 30)
    # Latency hidden per ms of transfer: none one at a time; with concurrent launches, the next
    # launch's latency passes during this one's transfer.
    hidden_per_transfer = 0 if network.concurrent_launches == 1 else 1
    transfer_ms = latency_ms / (hidden_per_transfer + latency_share / (1 - latency_share))
    return int(transfer_ms / ms_per_byte) + 1


@dataclass(frozen=True)
class _Parameter:
    name: str
    shard: torch.Tensor
    owner: str  # block, or module outside blocks
    unsharded_bytes: int


def plan_auto_buckets(
    shards: list[tuple[str, torch.Tensor]],
    owners: dict[str, str],
    *,
    world_size: int,
    cost_model: CostModel,
    latency_share: float,
    caps: AutoBucketCaps = AutoBucketCaps(),
    replicas: Replicas | None = None,
    merges_copy: bool = True,
    mixed_precision: MixedPrecision | None = None,
) -> tuple[list[BucketPlan], BucketPlanSummary]:
    """Buckets for ``shards`` (name and sharded parameter, in first-use order, each tensor once)
    and why each was formed. ``owners`` maps a parameter to its block (or its module outside
    blocks), as :func:`~thunder_overlap._bucketing.plan.bucket_owner` gives for ``"auto"``.

    ``merges_copy``: whether a bucket of several tensors copies what it moves (gloo); False where
    a coalesced launch runs as one and buckets gather in place (NCCL). ``mixed_precision``: sizes
    and caps count the bytes each all-gather moves, in the dtype it gathers (bf16 for float32
    masters gathered in bf16: twice the parameters per bucket).

    Under hybrid sharding (``replicas``), a bucket must also saturate its all-reduce across the
    replicas, which moves one shard (1 / ``world_size`` of the bucket) over the replicate group's
    network: across nodes that usually asks for far larger buckets than the shard group does, and
    the caps decide."""
    streams: dict[tuple[torch.dtype, bool], list[_Parameter]] = {}
    for name, shard in shards:
        if name not in owners:
            raise KeyError(f"parameter {name!r} has no bucket owner; known: {sorted(owners)[:5]}...")
        parameter = _Parameter(name, shard, owners[name], unsharded_bytes_of(shard, world_size, mixed_precision))
        streams.setdefault((shard.dtype, shard.requires_grad), []).append(parameter)
    target = saturating_bytes(cost_model, world_size, latency_share)
    # Latency one bucket saves by merging: its all-gather's, and its all-reduce's two passes.
    merge_saves_ms = cost_model.latency_ms(world_size)
    if replicas is not None:
        target = max(target, world_size * saturating_bytes(cost_model, replicas.count, latency_share, replicas.network))
        merge_saves_ms += 2 * cost_model.latency_ms(replicas.count, replicas.network)
    cap, cap_source = caps.binding()
    # Bytes whose merging copy costs as much as the latency it saves.
    copy_break_even = _copy_break_even_bytes(cost_model, merge_saves_ms) if merges_copy else float("inf")

    planned: list[tuple[int, BucketPlan, BucketEnd]] = []
    position = {name: i for i, (name, _) in enumerate(shards)}
    for (dtype, requires_grad), stream in streams.items():
        buckets = _pack(stream, target, _Caps(cap, caps.splitting), copy_break_even)
        for members, ended, label in _labelled(buckets):
            plan = make_plan(label, [(p.name, p.shard) for p in members], dtype, requires_grad)
            planned.append((position[members[0].name], plan, ended))
    # Buckets in first-use order of their first parameter, whatever their dtype.
    planned.sort(key=lambda entry: entry[0])
    ordered = [(plan, ended) for _, plan, ended in planned]
    summary = summarize_plans(
        ordered,
        owners,
        strategy=BucketingStrategy.AUTO,
        world_size=world_size,
        cost_model=cost_model,
        target_bytes=target,
        cap=(cap, cap_source),
        mixed_precision=mixed_precision,
    )
    return [plan for plan, _ in ordered], summary


# Bytes moved per byte of a bucket holding several tensors, per collective: the all-gather's
# copy-out reads and writes it (2, per analysis/local_copies.py). The reduce-scatter's lay-out
# does the same only where the gradients need padding (others are sent where they are), so 2
# for every collective errs toward fewer merges.
COPY_BYTES_PER_BYTE = 2


def _copy_break_even_bytes(cost_model: CostModel, latency_ms: float) -> float:
    """Bytes a merge may add to a bucket's copies before they cost more than the ``latency_ms``
    the launches it saves paid (whole latencies: with concurrent launches a merge saves at most
    that, so this errs toward merging)."""
    ms_per_byte = cost_model.copy_ms(1 << 30) / (1 << 30)
    return latency_ms / (COPY_BYTES_PER_BYTE * ms_per_byte) if ms_per_byte > 0 else float("inf")


@dataclass(frozen=True)
class _Caps:
    # The smallest cap: no bucket holding more than one owner exceeds it.
    merge: int | None
    # The smallest cap that splits a block (the memory slack does not).
    split: int | None


def _pack(stream: list[_Parameter], target: int, caps: _Caps, copy_break_even: float) -> list[tuple[list[_Parameter], BucketEnd]]:
    """Greedy contiguous packing of one dtype's parameters (see the module's docstring)."""
    # Bytes from each parameter to the end of its owner's run (what the rest of its block weighs),
    # and the whole run's bytes.
    rest_of_owner = [0] * len(stream)
    for i in reversed(range(len(stream))):
        same_owner_next = i + 1 < len(stream) and stream[i + 1].owner == stream[i].owner
        rest_of_owner[i] = stream[i].unsharded_bytes + (rest_of_owner[i + 1] if same_owner_next else 0)
    owner_bytes = list(rest_of_owner)
    for i in range(1, len(stream)):
        if stream[i].owner == stream[i - 1].owner:
            owner_bytes[i] = owner_bytes[i - 1]

    buckets: list[tuple[list[_Parameter], BucketEnd]] = []
    current: list[_Parameter] = []
    size = 0
    for i, parameter in enumerate(stream):
        if current:
            ended = _end_before(stream[i - 1], parameter, size, rest_of_owner[i], owner_bytes[i - 1], owner_bytes[i], target, caps)
            # One tensor needs no copy-out; a second makes the whole bucket copy.
            copied_by_merge = parameter.unsharded_bytes + (size if len(current) == 1 else 0)
            if ended is None and copied_by_merge > copy_break_even:
                ended = BucketEnd.COPY
            if ended is not None:
                buckets.append((current, ended))
                current, size = [], 0
        current.append(parameter)
        size += parameter.unsharded_bytes
    buckets.append((current, BucketEnd.END))

    if len(buckets) >= 2:
        # A remainder too small to saturate (a final norm, a head's bias) joins the bucket before.
        (before, _), (last, _) = buckets[-2], buckets[-1]
        merged = _bytes(before) + _bytes(last)
        copied_by_merge = _bytes(last) + (_bytes(before) if len(before) == 1 else 0)
        if _bytes(last) < target and (caps.merge is None or merged <= caps.merge) and copied_by_merge <= copy_break_even:
            buckets[-2:] = [(before + last, BucketEnd.END)]
    return buckets


def _end_before(
    previous: _Parameter,
    parameter: _Parameter,
    size: int,
    rest: int,
    previous_owner_bytes: int,
    owner_bytes: int,
    target: int,
    caps: _Caps,
) -> BucketEnd | None:
    """Whether the bucket of ``size`` bytes ends before ``parameter``, and why. ``rest``: the
    bytes from ``parameter`` to the end of its owner; ``*_owner_bytes``: each owner's total."""
    new_owner = parameter.owner != previous.owner
    cap = caps.merge
    if cap is not None and new_owner and (owner_bytes > cap or previous_owner_bytes > cap):
        # A block larger than the cap goes in buckets of its own (pieces, where a splitting cap
        # binds), never shared with its neighbours: no bucket holds the tail of one block with
        # the head of the next.
        return BucketEnd.BLOCK_BOUNDARY
    if caps.split is not None and size + parameter.unsharded_bytes > caps.split:
        return BucketEnd.CAP
    if cap is not None and new_owner and size + rest > cap:
        return BucketEnd.CAP if size + parameter.unsharded_bytes > cap else BucketEnd.BLOCK_BOUNDARY
    # Inside a block, cut only where the rest of the block saturates on its own: a bucket then
    # never holds the tail of one block with the head of the next.
    if size >= target and (new_owner or rest >= target):
        return BucketEnd.SATURATED
    return None


def _bytes(members: list[_Parameter]) -> int:
    return sum(p.unsharded_bytes for p in members)


def _labelled(buckets: list[tuple[list[_Parameter], BucketEnd]]):
    """Each bucket with a label naming what it holds: one block (``blocks.3``, ``blocks.3
    [2/4]`` when it is split), two (``wte + blocks.0``) or a run (``blocks.0 .. blocks.3``)."""
    owners_of = [list(dict.fromkeys(p.owner for p in members)) for members, _ in buckets]
    pieces: dict[str, int] = {}
    for owners in owners_of:
        if len(owners) == 1:
            pieces[owners[0]] = pieces.get(owners[0], 0) + 1
    seen: dict[str, int] = {}
    for (members, ended), owners in zip(buckets, owners_of, strict=True):
        names = [o or "<root>" for o in owners]
        if len(owners) == 1:
            label = names[0]
            if pieces[owners[0]] > 1:
                seen[owners[0]] = seen.get(owners[0], 0) + 1
                label += f" [{seen[owners[0]]}/{pieces[owners[0]]}]"
        elif len(owners) == 2:
            label = f"{names[0]} + {names[1]}"
        else:
            label = f"{names[0]} .. {names[-1]}"
        yield members, ended, label
