"""bucketing_strategy="auto" and block_types=, without spawning ranks: the planner on synthetic
cost models, its caps and digest, and block detection with and without named block types.
(Two-rank training with auto buckets and ranks whose plans differ: tests/test_e2e_bucketing.py
and tests/test_e2e_ranks_differ.py.)"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import thunder_overlap
from thunder_overlap import BucketingTransform, CostModel, OverlapConfig, OverlapScheduleTransform
from thunder_overlap._analysis.blocks import find_blocks, largest_block_bytes, parse_block_types, unsharded_bytes
from thunder_overlap._analysis.network import network_profile
from thunder_overlap._bucketing.auto_plan import AutoBucketCaps, Replicas, plan_auto_buckets, saturating_bytes
from thunder_overlap._bucketing.plan import BucketEnd, bucket_owner
from thunder_overlap._scheduling.limits import resolve_limits
from thunder_overlap.config import Tuning
from thunder_overlap.options import BucketingStrategy
from thunder_overlap.report._builtin_models import Block, TinyGPT, TinyGPTConfig

WORLD_SIZE = 8
MODEL = TinyGPTConfig(n_layer=6, vocab_size=104, n_embd=64)
# A launch costs 1 ms and the link moves 100 GB/s: a 64K-parameter block (256 KiB) would spend
# over 99% of its time on latency.
LATENCY_DOMINATED = CostModel.named("h100", "custom:1000:100")
# Latency ~0: any bucket saturates the link.
BANDWIDTH_DOMINATED = CostModel.named("h100", "custom:0.001:100")
SHARE = Tuning().auto_bucket_latency_share


def _shards(model: nn.Module, world_size: int = WORLD_SIZE) -> list[tuple[str, torch.Tensor]]:
    """Meta shards shaped as Thunder shards them (rows padded to the world size)."""
    shards = []
    for name, p in model.named_parameters():
        rows = -(-p.shape[0] // world_size)
        shard = torch.empty((rows, *p.shape[1:]), dtype=p.dtype, device="meta").requires_grad_(p.requires_grad)
        shards.append((name, shard))
    return shards


def _owners(model):
    return bucket_owner(model, BucketingStrategy.AUTO, [name for name, _ in find_blocks(model)])


def _plan(cost_model: CostModel, caps: AutoBucketCaps | None = None, model: nn.Module | None = None, **options):
    model = model if model is not None else TinyGPT(MODEL)
    caps = caps if caps is not None else AutoBucketCaps()
    return plan_auto_buckets(
        _shards(model), _owners(model), world_size=WORLD_SIZE, cost_model=cost_model, latency_share=SHARE, caps=caps, **options
    )


def _blocks_per_bucket(summary) -> list[int]:
    return [sum(o.startswith("blocks.") for o in b.owners) for b in summary.buckets]


def test_latency_dominated_gives_buckets_of_several_blocks_and_bandwidth_dominated_blocks():
    block = largest_block_bytes(TinyGPT(MODEL))
    _, latency_bound = _plan(LATENCY_DOMINATED, AutoBucketCaps(prefetch_bytes=3 * block))
    _, bandwidth_bound = _plan(BANDWIDTH_DOMINATED, AutoBucketCaps(prefetch_bytes=3 * block))
    # Latency-dominated: as large as the cap allows, three blocks at a time, cut between blocks.
    assert max(_blocks_per_bucket(latency_bound)) == 3
    assert all(b.unsharded_bytes <= 3 * block for b in latency_bound.buckets)
    assert {b.ended for b in latency_bound.buckets} <= {BucketEnd.BLOCK_BOUNDARY, BucketEnd.CAP, BucketEnd.END}
    assert latency_bound.target_bytes > 3 * block
    # Bandwidth-dominated: less than a block saturates the link, so buckets are blocks or smaller;
    # with latency ~0 no merge pays for its copies, so every weight matrix goes alone (as without
    # buckets) and only tiny neighbours (biases, norms) share a launch.
    assert max(b.unsharded_bytes for b in bandwidth_bound.buckets) < block
    matrices = {n for n, p in TinyGPT(MODEL).named_parameters() if p.ndim == 2 and p.requires_grad}
    assert all(len(b.parameters) == 1 for b in bandwidth_bound.buckets if matrices & set(b.parameters))
    assert {b.ended for b in bandwidth_bound.buckets} >= {BucketEnd.SATURATED, BucketEnd.COPY}
    assert all(b.latency_share <= SHARE for b in bandwidth_bound.buckets if matrices & set(b.parameters))
    assert len(latency_bound.buckets) < len(bandwidth_bound.buckets)


def test_where_buckets_gather_in_place_merging_copies_nothing_and_matrices_share_buckets():
    # On NCCL a bucket gathers each parameter into its place and sends its gradients where they
    # are: a merge adds no copy, so only saturation ends a bucket, never the copy it would add.
    caps = AutoBucketCaps(prefetch_bytes=3 * largest_block_bytes(TinyGPT(MODEL)))
    _, copying = _plan(BANDWIDTH_DOMINATED, caps)
    _, in_place = _plan(BANDWIDTH_DOMINATED, caps, merges_copy=False)
    assert BucketEnd.COPY in {b.ended for b in copying.buckets}
    assert BucketEnd.COPY not in {b.ended for b in in_place.buckets}
    assert len(in_place.buckets) < len(copying.buckets)


def test_hybrid_sharding_grows_buckets_until_the_all_reduce_across_replicas_saturates():
    # The shard group's link saturates with buckets below a block; the replicas' all-reduce of
    # one shard (1/8 of a bucket) over 16 ranks of 1 ms latency does not: the plan grows to the cap.
    model = TinyGPT(MODEL)
    block = largest_block_bytes(model)
    caps = AutoBucketCaps(prefetch_bytes=3 * block)
    _, shard_only = _plan(BANDWIDTH_DOMINATED, caps)
    slow_replicas = Replicas(16, network_profile("custom:1000:100"))
    _, hybrid = plan_auto_buckets(
        _shards(model),
        _owners(model),
        world_size=WORLD_SIZE,
        cost_model=BANDWIDTH_DOMINATED,
        latency_share=SHARE,
        caps=caps,
        replicas=slow_replicas,
    )
    assert max(b.unsharded_bytes for b in shard_only.buckets) < block
    assert hybrid.target_bytes == WORLD_SIZE * saturating_bytes(BANDWIDTH_DOMINATED, 16, SHARE, slow_replicas.network)
    assert hybrid.target_bytes > 3 * block
    assert max(_blocks_per_bucket(hybrid)) == 3
    assert len(hybrid.buckets) < len(shard_only.buckets)


def test_buckets_grow_with_latency_and_stay_contiguous_in_first_use_order():
    model = TinyGPT(MODEL)
    block = largest_block_bytes(model)
    order = [name for name, p in model.named_parameters() if p.requires_grad]
    counts = []
    for latency_us in (0.001, 1, 10, 100, 1000):
        plans, summary = _plan(CostModel.named("h100", f"custom:{latency_us}:100"), AutoBucketCaps(prefetch_bytes=4 * block))
        trainable = [s.name for p in plans if p.requires_grad for s in p.slots]
        assert trainable == order  # contiguous, in order, every parameter once
        counts.append(len(plans))
    assert counts == sorted(counts, reverse=True) and counts[0] > counts[-1]


def test_the_memory_budget_and_bucket_cap_cap_buckets():
    block = largest_block_bytes(TinyGPT(MODEL))
    slack = int(1.5 * block)
    _, by_memory = _plan(LATENCY_DOMINATED, AutoBucketCaps(prefetch_bytes=4 * block, memory_slack_bytes=slack))
    assert by_memory.cap_bytes == slack and by_memory.cap_source == "memory slack"
    assert all(b.unsharded_bytes <= slack for b in by_memory.buckets)
    assert max(_blocks_per_bucket(by_memory)) == 1  # a second block never fits beside the first
    # bucket_cap_mb below a block splits blocks, at the cap.
    cap = block // 3
    _, by_user = _plan(LATENCY_DOMINATED, AutoBucketCaps(bucket_cap_bytes=cap, prefetch_bytes=4 * block, memory_slack_bytes=slack))
    assert by_user.cap_source == "bucket_cap_mb"
    assert all(b.unsharded_bytes <= cap for b in by_user.buckets)
    assert BucketEnd.CAP in {b.ended for b in by_user.buckets}


def test_a_memory_slack_below_a_block_keeps_each_block_whole_in_a_bucket_of_its_own():
    # As block buckets keep it: the scheduler holds a prefetch back where the budget has no room,
    # and pieces would each pay a launch (benchmarks/README.md, the Llama-2-70B row).
    model = TinyGPT(MODEL)
    block = largest_block_bytes(model)
    slack = int(0.6 * block)
    plans, summary = _plan(LATENCY_DOMINATED, AutoBucketCaps(prefetch_bytes=4 * block, memory_slack_bytes=slack))
    assert (summary.cap_bytes, summary.cap_source) == (slack, "memory slack")
    holding_blocks = [b for b in summary.buckets if any(o.startswith("blocks.") for o in b.owners)]
    # Each block once, whole (every one of its parameters), with nothing of another block.
    assert [b.owners[0] for b in holding_blocks] == [f"blocks.{i}" for i in range(MODEL.n_layer)]
    assert max(_blocks_per_bucket(summary)) == 1
    for i, bucket in enumerate(holding_blocks):
        assert set(bucket.parameters) >= {n for n, _ in model.blocks[i].named_parameters(prefix=f"blocks.{i}")}
        assert bucket.unsharded_bytes > slack
    # Several owners share a bucket only within the slack.
    assert all(b.unsharded_bytes <= slack for b in summary.buckets if len(b.owners) > 1)
    assert "by memory slack (a block or parameter above it goes whole, alone)" in str(summary)
    # A bucket_cap_mb or prefetch limit as small does split them.
    _, by_user = _plan(LATENCY_DOMINATED, AutoBucketCaps(bucket_cap_bytes=slack, prefetch_bytes=4 * block))
    assert all(b.unsharded_bytes <= slack for b in by_user.buckets)


def test_a_cap_below_a_block_splits_each_block_into_buckets_of_its_own():
    model = TinyGPT(MODEL)
    block = largest_block_bytes(model)
    # 0.6 blocks: filling each bucket to the cap would carry a block's tail into the next block's
    # head (Llama-2-70B at 1024 ranks, when the memory slack split blocks, did).
    cap = int(0.6 * block)
    _, summary = _plan(LATENCY_DOMINATED, AutoBucketCaps(bucket_cap_bytes=cap, prefetch_bytes=4 * block))
    split = [b for b in summary.buckets if any(o.startswith("blocks.") for o in b.owners)]
    assert all(b.unsharded_bytes <= cap for b in summary.buckets)
    assert _blocks_per_bucket(summary).count(2) == 0, [b.owners for b in split]
    # Every block is in at least two pieces.
    pieces = [o for b in split for o in b.owners if o.startswith("blocks.")]
    assert all(pieces.count(f"blocks.{i}") >= 2 for i in range(MODEL.n_layer))


def test_small_parameters_merge_with_their_neighbours():
    model = TinyGPT(MODEL)
    block = largest_block_bytes(model)
    _, summary = _plan(BANDWIDTH_DOMINATED, AutoBucketCaps(prefetch_bytes=2 * block), model=model)
    # The final norm is too small to saturate anything: it joins the last block's bucket.
    assert not any(b.owners == ("norm_f",) for b in summary.buckets)
    assert any(set(b.owners) == {f"blocks.{MODEL.n_layer - 1}", "norm_f"} for b in summary.buckets)
    # The frozen position embedding cannot share a collective with trainable ones.
    assert [b.parameters for b in summary.buckets if "frozen" in b.label] == [("wpe.weight",)]


def test_mixed_precision_sizes_buckets_by_the_bytes_its_gathers_move():
    # float32 masters gathered in bf16 move half their bytes: the buckets are those of the same
    # model in bf16 (the same parameters together), and the summary counts what is gathered.
    from thunder_overlap import MixedPrecision

    policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = TinyGPT(MODEL)
    block = largest_block_bytes(model)
    caps = AutoBucketCaps(prefetch_bytes=block)  # one float32 block: two bf16 ones
    plans, summary = _plan(LATENCY_DOMINATED, caps, model=model, mixed_precision=policy)
    as_bf16, bf16_summary = _plan(LATENCY_DOMINATED, caps, model=TinyGPT(MODEL).to(torch.bfloat16))
    assert [[s.name for s in p.slots] for p in plans] == [[s.name for s in p.slots] for p in as_bf16]
    assert [b.unsharded_bytes for b in summary.buckets] == [b.unsharded_bytes for b in bf16_summary.buckets]
    assert {p.dtype for p in plans} == {torch.float32}  # the buckets hold the float32 masters
    # Not vacuous: counted in float32, each bucket would hold one block, not two.
    _, as_float32 = _plan(LATENCY_DOMINATED, caps, model=model)
    assert max(_blocks_per_bucket(as_float32)) == 1 < max(_blocks_per_bucket(summary)) == 2


def test_saturating_bytes_follow_the_latency_share():
    # 1 ms of latency per step, 7 steps on 8 ranks of a ring; 100 GB/s; 10% latency share.
    bytes_needed = saturating_bytes(LATENCY_DOMINATED, WORLD_SIZE, 0.1)
    latency = LATENCY_DOMINATED.latency_ms(WORLD_SIZE)
    transfer = LATENCY_DOMINATED.transfer_ms(bytes_needed, WORLD_SIZE)
    assert latency / (latency + transfer) == pytest.approx(0.1, rel=1e-6)
    assert saturating_bytes(LATENCY_DOMINATED, 1, 0.1) == 0  # one rank: no latency to hide
    # Two launches at once (gloo): the launch before's transfer hides the latency, so a bucket
    # saturates once the latency left over is 10% of its time: far smaller buckets.
    two_lanes = CostModel.named("h100", "custom:1000:100:ring:2")
    two_lane_bytes = saturating_bytes(two_lanes, WORLD_SIZE, 0.1)
    transfer = two_lanes.transfer_ms(two_lane_bytes, WORLD_SIZE)
    left = two_lanes.unhidden_latency_ms(two_lane_bytes, WORLD_SIZE)
    assert left == pytest.approx(latency - transfer) and left / (left + transfer) == pytest.approx(0.1, rel=1e-6)
    assert two_lane_bytes < bytes_needed / 8


def test_the_plan_digest_is_deterministic_and_follows_the_caps():
    block = largest_block_bytes(TinyGPT(MODEL))
    first = _plan(LATENCY_DOMINATED, AutoBucketCaps(prefetch_bytes=3 * block))[1].digest
    assert first == _plan(LATENCY_DOMINATED, AutoBucketCaps(prefetch_bytes=3 * block))[1].digest
    assert first != _plan(LATENCY_DOMINATED, AutoBucketCaps(prefetch_bytes=3 * block, bucket_cap_bytes=block))[1].digest


# --- through fsdp, on a fake group of 8 -----------------------------------------------------------


def test_fsdp_auto_summarises_its_plan(fake_group_8):
    config = OverlapConfig(cost_model=CostModel.named("h100", "custom:1000:100"))
    jm = thunder_overlap.fsdp(TinyGPT(MODEL), device="cpu", bucketing_strategy="AUTO", config=config)
    summary = BucketingTransform.of(jm).summaries.plan
    assert summary.strategy == "auto" and summary.world_size == WORLD_SIZE and summary.network == "custom:1000:100"
    # The default prefetch limit, 2 blocks as gathered, caps the latency-dominated buckets.
    assert summary.cap_source == "prefetch limit" and max(_blocks_per_bucket(summary)) == 2
    assert [p.label for p in BucketingTransform.of(jm).plans] == [b.label for b in summary.buckets]
    assert "latency" in str(summary) and "prefetch limit" in str(summary)
    # The scheduler then counts its in-flight limits in these buckets, not in blocks: a bucket
    # of two blocks can arrive while the one before it is still in flight.
    schedule = OverlapScheduleTransform.of(jm)
    largest_bucket = max(b.unsharded_bytes for b in summary.buckets)
    assert schedule.prefetch_unit_bytes == largest_bucket > schedule.largest_block_bytes
    limits = resolve_limits(config, schedule.prefetch_unit_bytes)
    assert limits.max_allgather_bytes >= 2 * largest_bucket and limits.max_reduce_scatter_bytes >= 2 * largest_bucket
    # bucket_cap_mb is a cap under auto too.
    capped = thunder_overlap.fsdp(TinyGPT(MODEL), device="cpu", bucketing_strategy="auto", bucket_cap_mb=0.1, config=config)
    capped_summary = BucketingTransform.of(capped).summaries.plan
    assert capped_summary.cap_source == "bucket_cap_mb" and capped_summary.cap_bytes == int(0.1 * 2**20)
    assert all(b.unsharded_bytes <= capped_summary.cap_bytes for b in capped_summary.buckets)
    assert capped_summary.digest != summary.digest


def test_layer_and_block_plans_are_summarised_too(fake_group_8):
    jm = thunder_overlap.fsdp(TinyGPT(MODEL), device="cpu", bucketing_strategy="block")
    summary = BucketingTransform.of(jm).summaries.plan
    assert summary.strategy == "block" and summary.target_bytes is None
    assert {b.ended for b in summary.buckets} == {BucketEnd.GROUP}


@pytest.mark.parametrize(
    ("cap", "message"),
    [
        (-1, r"bucket_cap_mb must be a positive finite number of MiB, or None for no cap, got -1"),
        (float("inf"), r"bucket_cap_mb must be a positive finite number .*got inf"),
        (float("nan"), r"bucket_cap_mb must be a positive finite number .*got nan"),
        ("25MB", r"bucket_cap_mb must be a positive finite number .*got '25MB'"),
        (1e-9, r"bucket_cap_mb=1e-09 is less than one byte"),
    ],
)
def test_a_nonsense_cap_is_a_clear_error(fake_group_8, cap, message):
    with pytest.raises(ValueError, match=message):
        thunder_overlap.fsdp(TinyGPT(MODEL), device="cpu", bucketing_strategy="auto", bucket_cap_mb=cap)


def test_a_latency_share_outside_0_1_is_a_clear_error():
    with pytest.raises(ValueError, match=r"auto_bucket_latency_share must be a number between 0 and 1, got 1.5"):
        OverlapConfig(_tuning=Tuning(auto_bucket_latency_share=1.5))


# --- block_types ---------------------------------------------------------------------------------


class Body(nn.Module):
    """A model body that is not a ModuleList: detection sees it as one "block"."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MyBlock(width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class MyBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.norm(x))


class Head(nn.Module):
    def __init__(self, width: int, vocab: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def _sequential_model() -> nn.Sequential:
    return nn.Sequential(nn.Embedding(16, 32), Body(32, 4), Head(32, 16))


def test_a_top_level_sequential_warns_and_names_block_types():
    model = _sequential_model()
    with pytest.warns(UserWarning, match=r"'1' \(Body\) holds \d+% of the model's parameters.*block_types="):
        blocks = find_blocks(model)
    assert [name for name, _ in blocks] == ["0", "1", "2"]
    # Named, the blocks are the body's layers; the prefetch unit shrinks to one of them.
    named = find_blocks(model, parse_block_types(MyBlock))
    assert [name for name, _ in named] == [f"1.layers.{i}" for i in range(4)]
    assert largest_block_bytes(model, ("MyBlock",)) == unsharded_bytes(model[1].layers[0])
    # A ModuleList of alike blocks is a sound detection, however few: no warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(find_blocks(TinyGPT(TinyGPTConfig(n_layer=2)))) == 2


def _mlp_block(width: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))


class _StemBodyHead(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.stem = nn.Linear(width, width)
        self.body = nn.Sequential(*(_mlp_block(width) for _ in range(depth)))
        self.head = nn.Linear(width, width)


@pytest.mark.parametrize(
    ("build", "names"),
    [
        # A plain stack of identical blocks.
        (lambda: nn.Sequential(*(_mlp_block(8) for _ in range(4))), [str(i) for i in range(4)]),
        # A model whose largest container is such a stack.
        (lambda: _StemBodyHead(8, 4), [f"body.{i}" for i in range(4)]),
        # The stack inside a top-level Sequential of unlike modules: the stack's children, not three "blocks".
        (
            lambda: nn.Sequential(nn.Linear(8, 8), nn.Sequential(*(_mlp_block(8) for _ in range(4))), nn.Linear(8, 8)),
            [f"1.{i}" for i in range(4)],
        ),
    ],
)
def test_a_sequential_stack_of_identical_blocks_is_found_without_a_warning(build, names):
    model = build()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        blocks = find_blocks(model)
        assert [name for name, _ in blocks] == names
        assert largest_block_bytes(model) == unsharded_bytes(_mlp_block(8))


def test_a_top_level_sequential_around_unlike_layers_still_warns():
    # The body's layers differ in shape: no stack of identical blocks to descend into.
    body = nn.Sequential(_mlp_block(8), nn.Sequential(nn.Linear(8, 64), nn.GELU(), nn.Linear(64, 8)))
    with pytest.warns(UserWarning, match=r"'1' \(Sequential\) holds \d+% of the model's parameters.*block_types="):
        blocks = find_blocks(nn.Sequential(nn.Linear(8, 8), body, nn.Linear(8, 8)))
    assert [name for name, _ in blocks] == ["0", "1", "2"]


def test_block_types_match_outermost_modules_by_class_or_name():
    model = TinyGPT(TinyGPTConfig(n_layer=2))
    for block_types in ((Block,), ("Block",), (f"{Block.__module__}.Block",)):
        assert [name for name, _ in find_blocks(model, block_types)] == ["blocks.0", "blocks.1"]
    # A Linear inside a Block is part of that block, not a block of its own: outermost matches only.
    assert [name for name, _ in find_blocks(model, ("Block", "Linear"))][:2] == ["blocks.0", "blocks.1"]
    assert "blocks.0.fc" not in [name for name, _ in find_blocks(model, ("Block", "Linear"))]


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        ((), ValueError, r"block_types=\(\) names no module class"),
        ((3,), TypeError, r"block_types entries must be torch.nn.Module subclasses or class names .*got 3"),
        ((int,), TypeError, r"got <class 'int'>"),
        (7, TypeError, r"block_types must be a module class, a class name, or a list of them, got 7"),
    ],
)
def test_bad_block_types_are_clear_errors(value, error, message):
    with pytest.raises(error, match=message):
        parse_block_types(value)


def test_block_types_through_fsdp(fake_group_8):
    config = OverlapConfig(cost_model=CostModel.named("h100", "custom:0:100"))  # no latency: nothing to merge for
    with pytest.raises(ValueError, match=r"block_types: 'LlamaDecoderLayer' matches no module of Sequential; its module classes are "
                       r"\['Body', 'Embedding', 'Head', 'LayerNorm', 'Linear', 'ModuleList', 'MyBlock', 'Sequential'\]"):
        thunder_overlap.fsdp(_sequential_model(), device="cpu", bucketing_strategy="block", block_types="LlamaDecoderLayer")
    jm = thunder_overlap.fsdp(_sequential_model(), device="cpu", bucketing_strategy="block", block_types=[MyBlock], config=config)
    labels = [p.label for p in BucketingTransform.of(jm).plans]
    assert labels == ["0", *[f"1.layers.{i}" for i in range(4)], "2.proj"]
    auto = thunder_overlap.fsdp(_sequential_model(), device="cpu", bucketing_strategy="auto", block_types="MyBlock", config=config)
    # No latency: every piece saturates the link, so auto buckets are the named blocks or pieces of one.
    owners = [b.owners for b in BucketingTransform.of(auto).summaries.plan.buckets]
    assert {o for bucket in owners for o in bucket} >= {f"1.layers.{i}" for i in range(4)}
    assert all(sum(o.startswith("1.layers.") for o in bucket) <= 1 for bucket in owners)
    schedule = thunder_overlap.OverlapScheduleTransform.of(jm)
    assert schedule.largest_block_bytes == unsharded_bytes(_sequential_model()[1].layers[0])
