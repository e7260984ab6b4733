"""MixedPrecision: its checks, what it casts per parameter dtype, and where fsdp refuses it.

What the casts do to the traces: tests/test_mixed_precision_fake_group.py; numerics against
FSDP2: tests/test_e2e_mixed_precision.py.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn
from thunder.distributed.transforms.fsdp_v2 import FSDPTransform

import thunder_overlap
from thunder_overlap import FSDPOverlap, MixedPrecision, checkpoint
from thunder_overlap._transforms import BucketingTransform, MixedPrecisionTransform
from thunder_overlap.options import BucketingStrategy, FSDPOptions

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

BF16, FP16, FP32, FP64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
ACCEPTED = r"\(torch\.float16, torch\.bfloat16, torch\.float32, torch\.float64\)"


@pytest.fixture(scope="module")
def gloo_group(one_rank_gloo_group):
    return one_rank_gloo_group


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))


def test_exported_with_the_other_options():
    assert "MixedPrecision" in thunder_overlap.__all__ and thunder_overlap.MixedPrecision is MixedPrecision


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"param_dtype": torch.int32}, rf"^MixedPrecision param_dtype must be a floating torch dtype {ACCEPTED} or None .*int32$"),
        ({"param_dtype": "bf16"}, r"^MixedPrecision param_dtype must be a floating torch dtype .*got 'bf16'$"),
        # Floating, but a float8 gather needs scales this policy has no place for.
        ({"param_dtype": torch.float8_e4m3fn}, r"param_dtype must be a floating torch dtype .*got torch\.float8_e4m3fn$"),
        ({"reduce_dtype": torch.bool}, r"^MixedPrecision reduce_dtype must be a floating torch dtype .*got torch\.bool$"),
        (
            {"param_dtype": FP32, "reduce_dtype": BF16},
            r"^MixedPrecision reduce_dtype=torch\.bfloat16 is not as wide as param_dtype=torch\.float32: .*"
            r"use reduce_dtype=torch\.float32, torch\.float64, or None for the parameter's own dtype$",
        ),
        # As wide, but neither holds the other's values.
        ({"param_dtype": BF16, "reduce_dtype": FP16}, r"reduce_dtype=torch\.float16 is not as wide as param_dtype=torch\.bfloat16"),
    ],
)
def test_bad_policies_name_the_value_and_what_is_accepted(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MixedPrecision(**kwargs)


@pytest.mark.parametrize(
    ("policy", "dtype", "expected"),
    [
        # reduce_dtype=None keeps the parameter's own dtype (FSDP2's would mean param_dtype).
        (MixedPrecision(BF16), FP32, (BF16, FP32)),
        (MixedPrecision(BF16, FP32), FP32, (BF16, FP32)),
        (MixedPrecision(BF16, BF16), FP32, (BF16, BF16)),
        (MixedPrecision(reduce_dtype=BF16), FP32, (FP32, BF16)),
        (MixedPrecision(FP32, FP64), FP32, (FP32, FP64)),
        # Clamped as FSDP2 clamps: nothing to cast for a parameter already in these dtypes.
        (MixedPrecision(BF16), BF16, None),
        (MixedPrecision(BF16, BF16), BF16, None),
        (MixedPrecision(FP32, FP32), FP32, None),
        (MixedPrecision(), FP32, None),
        (MixedPrecision(BF16), torch.int64, None),
    ],
)
def test_dtypes_per_parameter(policy, dtype, expected):
    assert policy.dtypes_for(dtype) == expected


def test_policies_that_cast_nothing_add_no_transform(gloo_group):
    def mixed_precision_transforms(policy):
        transforms = thunder_overlap.fsdp_transforms(device="cpu", process_group=gloo_group, mixed_precision=policy)
        return [i for i, t in enumerate(transforms) if isinstance(t, MixedPrecisionTransform)], transforms

    assert mixed_precision_transforms(None)[0] == [] and mixed_precision_transforms(MixedPrecision())[0] == []
    (index,), transforms = mixed_precision_transforms(MixedPrecision(BF16))
    # Right after Thunder's FSDP, whose synchronize ops it replaces before autodiff.
    assert isinstance(transforms[index - 1], FSDPTransform)
    assert transforms[index].policy == MixedPrecision(BF16)


def test_resolved_and_agreed_on_by_ranks(gloo_group):
    options = FSDPOptions.resolve(process_group=gloo_group, mixed_precision=MixedPrecision(BF16, FP32))
    assert options.mixed_precision == MixedPrecision(BF16, FP32)
    assert options.agreed_fields()["mixed_precision"] == MixedPrecision(BF16, FP32)
    assert FSDPOptions.resolve(process_group=gloo_group).mixed_precision == MixedPrecision()
    assert FSDPOverlap(process_group=gloo_group, mixed_precision=MixedPrecision(BF16)).options.mixed_precision.param_dtype is BF16


@pytest.mark.parametrize("entry", ["fsdp", "fsdp_transforms", "FSDPOverlap"])
def test_a_policy_must_be_a_mixed_precision(gloo_group, entry):
    with pytest.raises(TypeError, match=r"^mixed_precision must be a thunder_overlap\.MixedPrecision or None, got torch\.bfloat16 "):
        if entry == "fsdp":
            thunder_overlap.fsdp(_model(), mixed_precision=BF16)
        elif entry == "fsdp_transforms":
            thunder_overlap.fsdp_transforms(process_group=gloo_group, mixed_precision=BF16)
        else:
            FSDPOverlap(process_group=gloo_group, mixed_precision=BF16)


@pytest.mark.parametrize("bucketing", ["layer", "block", "auto"])
def test_buckets_refuse_a_reduce_dtype_other_than_the_parameters(gloo_group, bucketing):
    with pytest.raises(
        ValueError,
        match=r"^mixed_precision=MixedPrecision\(param_dtype=torch\.bfloat16, reduce_dtype=torch\.bfloat16\) casts this model's "
        rf"torch\.float32 parameters, which is not supported yet with bucketing_strategy='{bucketing}' and a reduce_dtype other "
        r"than the parameters' \(torch\.bfloat16 for torch\.float32\): they reduce in the parameters' dtype; leave reduce_dtype "
        r"None or equal to it, or use bucketing_strategy='none'$",
    ):
        thunder_overlap.fsdp(_model(), bucketing_strategy=bucketing, mixed_precision=MixedPrecision(BF16, BF16))


def test_buckets_gather_in_the_param_dtype(gloo_group):
    model = thunder_overlap.fsdp(_model(), bucketing_strategy="block", mixed_precision=MixedPrecision(BF16, FP32))
    bucketing = BucketingTransform.of(model)
    assert bucketing.buckets and all(b.flat_shard.dtype is FP32 and b.gather_dtype is BF16 for b in bucketing.buckets)
    assert {(layout.gather_dtype, layout.gather_itemsize) for layout in bucketing.layouts.values()} == {("torch.bfloat16", 2)}
    # The plan counts what each all-gather moves: bf16 bytes, half the float32 buffer's.
    gathered = [b.flat_shard.numel() * BF16.itemsize for b in bucketing.buckets]  # one rank: a shard is the bucket
    assert [b.unsharded_bytes for b in bucketing.summaries.plan.buckets] == gathered


def test_buckets_are_kept_where_the_policy_casts_nothing(gloo_group):
    model = thunder_overlap.fsdp(_model().to(BF16), bucketing_strategy="block", mixed_precision=MixedPrecision(BF16, BF16))
    assert all(p.dtype is BF16 for p in model.parameters())


def test_hybrid_sharding_refuses_a_reduce_dtype_other_than_the_parameters():
    transform = MixedPrecisionTransform(MixedPrecision(reduce_dtype=FP64), bucketing=BucketingStrategy.NONE, hybrid=True)
    with pytest.raises(
        ValueError, match=r"casts this model's torch\.float32 parameters, .*with hybrid sharding \(a 2-D device_mesh\) and a reduce_dtype"
    ):
        transform.transform_module(_model())
    # Reducing in the parameters' dtype, it is accepted.
    MixedPrecisionTransform(MixedPrecision(BF16, FP32), bucketing=BucketingStrategy.BLOCK, hybrid=True).transform_module(_model())


@pytest.mark.slow  # three compiles
def test_no_sync_sums_bf16_gradients_in_float32_into_the_next_reduction(gloo_group):
    # One rank: a reduce-scatter is a copy, so the next synced backward's gradient is the sum of
    # the micro-batches' bf16 gradients, each cast to float32 by the lay-out (FSDP2 accumulates
    # unsharded gradients in float32 too).
    def grads(accumulate: bool, micro_batches: int = 3) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = thunder_overlap.fsdp(_model(), bucketing_strategy="block", mixed_precision=MixedPrecision(BF16, FP32))
        batches = [torch.randn(3, 4, generator=torch.Generator().manual_seed(i)) for i in range(micro_batches)]
        for i, x in enumerate(batches):
            with model.no_sync() if accumulate and i < micro_batches - 1 else contextlib.nullcontext():
                model(x).float().sum().backward()
        return {n: p.grad for n, p in model.named_parameters()}

    summed, synced, first = grads(accumulate=True), grads(accumulate=False), grads(accumulate=False, micro_batches=1)
    assert {g.dtype for g in summed.values()} == {FP32}
    # The three micro-batches' sum, not the last one's gradient alone.
    assert all((summed[name] - first[name]).abs().max() > 0.1 for name in first)
    for name, expected in synced.items():
        # The same three float32 terms, added in another order: gamma_2 (1.2e-7) times their
        # absolute sum, which stays below 10 here.
        torch.testing.assert_close(summed[name], expected, rtol=0, atol=2e-6, msg=name)


@pytest.mark.slow  # four compiles
def test_a_checkpoint_keeps_float32_masters_and_loads_with_or_without_the_policy(gloo_group, tmp_path):
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    trained = thunder_overlap.fsdp(_model(), bucketing_strategy="block", mixed_precision=MixedPrecision(BF16, FP32))
    optimizer = torch.optim.SGD(trained.parameters(), lr=0.1)
    trained(x).float().sum().backward()
    optimizer.step()
    checkpoint.save(tmp_path / "ckpt", trained, optimizer)
    saved = {name: p.detach().clone() for name, p in trained.named_parameters()}
    for policy in (MixedPrecision(BF16, FP32), None):
        torch.manual_seed(1)  # other initial values: the load must overwrite every one
        model = thunder_overlap.fsdp(_model(), bucketing_strategy="block", **({"mixed_precision": policy} if policy else {}))
        checkpoint.load(tmp_path / "ckpt", model, torch.optim.SGD(model.parameters(), lr=0.1))
        for name, p in model.named_parameters():
            assert p.dtype is FP32, name
            torch.testing.assert_close(p.detach(), saved[name], rtol=0, atol=0, msg=name)
        # With the policy the next gather casts the loaded masters: the trained model's bf16
        # forward; without it, float32 linears on them (the same kernels: bit for bit).
        if policy is not None:
            expected = trained(x)
        else:
            hidden = nn.functional.linear(x, saved["0.weight"], saved["0.bias"])
            expected = nn.functional.linear(hidden, saved["1.weight"], saved["1.bias"])
        torch.testing.assert_close(model(x), expected, rtol=0, atol=0)


@pytest.mark.slow  # two compiles
def test_a_batch_of_another_shape_recompiles_under_the_policy(gloo_group):
    # Ranks whose batches differ in shape compile traces of their own (tests/test_e2e_ranks_differ.py);
    # under the policy each is the same bf16 computation on the bf16 cast of the float32 masters.
    torch.manual_seed(0)
    model = thunder_overlap.fsdp(_model(), bucketing_strategy="block", mixed_precision=MixedPrecision(BF16, FP32))
    cast = {name: p.detach().to(BF16) for name, p in model.named_parameters()}
    for rows in (3, 5):
        x = torch.randn(rows, 4, generator=torch.Generator().manual_seed(rows))
        hidden = nn.functional.linear(x.to(BF16), cast["0.weight"], cast["0.bias"])
        expected = nn.functional.linear(hidden, cast["1.weight"], cast["1.bias"])
        torch.testing.assert_close(model(x), expected, rtol=0, atol=0, msg=f"{rows} rows")
