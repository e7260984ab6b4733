"""Bucketing without rank processes: bucket plans (blocks, layers, dtypes, frozen parameters,
caps) and, on a one-rank gloo group, mixed dtypes training like eager. Two ranks:
tests/test_e2e_bucketing.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from thunder_overlap._analysis.blocks import find_blocks
from thunder_overlap._bucketing.plan import bucket_owner, plan_buckets
from thunder_overlap.options import BucketingStrategy
from thunder_overlap.report._builtin_models import TinyGPT, TinyGPTConfig
from thunder_overlap.testing.op_census import OpCensus

# --- planning -----------------------------------------------------------------------------------


def test_block_buckets_hold_whole_blocks_and_layer_buckets_one_module():
    model = TinyGPT(TinyGPTConfig(n_layer=2))
    shards = list(model.named_parameters())
    blocks = [name for name, _ in find_blocks(model)]
    block = plan_buckets(shards, bucket_owner(model, BucketingStrategy.BLOCK, blocks), world_size=2)
    layer = plan_buckets(shards, bucket_owner(model, BucketingStrategy.LAYER, blocks), world_size=2)
    assert [p.label for p in block] == ["wte", "wpe (float32, frozen)", "blocks.0", "blocks.1", "norm_f"]
    assert len(block[2].slots) == len(list(model.blocks[0].parameters()))
    assert {p.label for p in layer} >= {"blocks.0.attn.qkv", "blocks.1.fc", "norm_f"}
    assert all(len(p.slots) <= 2 for p in layer)  # weight and bias
    # Slots lie back to back in the flat shard.
    for plan in block + layer:
        offsets = [s.offset for s in plan.slots]
        assert offsets == [sum(s.numel for s in plan.slots[:i]) for i in range(len(plan.slots))]


def test_buckets_split_by_dtype_frozen_and_cap():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    model[0].bias.requires_grad_(False)
    model[1].to(torch.bfloat16)
    owners = {name: "all" for name, _ in model.named_parameters()}
    plans = plan_buckets(list(model.named_parameters()), owners, world_size=2)
    assert [(p.dtype, p.requires_grad, [s.name for s in p.slots]) for p in plans] == [
        (torch.float32, True, ["0.weight"]),
        (torch.float32, False, ["0.bias"]),
        (torch.bfloat16, True, ["1.weight", "1.bias"]),
    ]
    # 1.weight is 8*8*2 bytes = 128 unsharded; a 150-byte cap leaves no room for the bias beside it.
    capped = plan_buckets(list(model.named_parameters()), owners, world_size=2, cap_bytes=150)
    assert [[s.name for s in p.slots] for p in capped if p.dtype == torch.bfloat16] == [["1.weight"], ["1.bias"]]


# --- one rank: dtypes -----------------------------------------------------------------------------


class _MixedPrecisionModel(nn.Module):
    """An fp32 layer feeding a bf16 layer (with a frozen bias): three dtype/frozen buckets."""

    def __init__(self) -> None:
        super().__init__()
        self.fp32 = nn.Linear(8, 16)
        self.bf16 = nn.Linear(16, 4).to(torch.bfloat16)
        self.bf16.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bf16(torch.relu(self.fp32(x)).to(torch.bfloat16)).float()


def test_block_buckets_of_a_model_without_blocks_are_layer_buckets_and_say_so(one_rank_gloo_group):
    import thunder_overlap
    from thunder_overlap._transforms import BucketingTransform

    def labels(bucketing: str, **options) -> list[str]:
        jm = thunder_overlap.fsdp(TinyGPT(TinyGPTConfig(n_layer=1)), device="cpu", bucketing_strategy=bucketing, **options)
        return [p.label for p in BucketingTransform.of(jm).plans]

    # One block is not a stack of blocks: find_blocks finds none.
    said = r"bucketing_strategy='block' found no blocks in TinyGPT .* as with 'layer'\. Name the blocks with block_types="
    with pytest.warns(UserWarning, match=said):
        without_blocks = labels("block")
    assert without_blocks == labels("layer")
    # Named, the one block is one bucket.
    assert "blocks.0" in labels("block", block_types="Block") and "blocks.0" not in without_blocks


@pytest.mark.parametrize("sharding", ["zero2", "zero3"])
def test_mixed_dtypes_get_buckets_of_their_own_and_train_like_eager(one_rank_gloo_group, sharding):
    import thunder_overlap
    from thunder_overlap._transforms import BucketingTransform

    torch.manual_seed(0)
    eager = _MixedPrecisionModel()
    torch.manual_seed(0)
    jm = thunder_overlap.fsdp(_MixedPrecisionModel(), sharding_strategy=sharding, bucketing_strategy="block")
    plans = BucketingTransform.of(jm).plans
    assert sorted((str(p.dtype), p.requires_grad) for p in plans) == [
        ("torch.bfloat16", False), ("torch.bfloat16", True), ("torch.float32", True)
    ]
    optimizers = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1) for m in (eager, jm)]
    for step in range(3):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(step))
        for model, optimizer in zip((eager, jm), optimizers, strict=True):
            optimizer.zero_grad()
            model(x).square().sum().backward()
            optimizer.step()
    # On one rank a gathered bucket is already laid out parameter by parameter: no copy-out.
    with OpCensus() as census:
        jm(torch.randn(5, 8)).square().sum().backward()
    assert census.count("split_with_sizes_copy") == 0
    summaries = BucketingTransform.of(jm).summaries
    assert (summaries.forward.all_gathers, summaries.backward.reduce_scatters) == (3, 2)
    assert not summaries.forward.unbucketed and not summaries.backward.unbucketed
    for name, p in eager.named_parameters():
        torch.testing.assert_close(jm.get_parameter(name), p, msg=name)
