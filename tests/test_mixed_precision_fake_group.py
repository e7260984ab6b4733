"""Mixed precision in real final traces, on the fake process group (2 ranks): what each
collective moves, what ZeRO3 re-gathers, and what stays in the parameters' dtype.

Numerics against FSDP2 on gloo ranks: tests/test_e2e_mixed_precision.py.
"""

from __future__ import annotations

import functools
import re

import pytest
import thunder
import torch
import torch.nn as nn
from thunder.core import dtypes, prims
from thunder.core.proxies import TensorProxy

import thunder_overlap
from thunder_overlap import MixedPrecision
from thunder_overlap._analysis.classify import CollectiveKind, NodeKind, classify_trace
from thunder_overlap._analysis.layout import NO_BUCKETS
from thunder_overlap._analysis.local_copies import local_copy_bytes
from thunder_overlap._transforms import BucketingTransform, MixedPrecisionTransform
from thunder_overlap.report._builtin_models import TinyGPT, TinyGPTConfig

MODEL = TinyGPTConfig(n_layer=2, n_embd=32)
BF16_FP32 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

# Every test here traces models with Thunder (seconds each).
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fake_group_2"), pytest.mark.filterwarnings("ignore::UserWarning")]


@functools.cache
def _tiny_gpt(sharding: str, policy: MixedPrecision | None, bucketing: str = "none"):
    """(model, final forward trace, final backward trace) after one step; cached, as tracing
    dominates this module's time."""
    torch.manual_seed(0)
    jm = thunder_overlap.fsdp(
        TinyGPT(MODEL), device="cpu", sharding_strategy=sharding, bucketing_strategy=bucketing, mixed_precision=policy
    )
    jm(torch.randint(0, MODEL.vocab_size, (2, 8))).float().sum().backward()
    return jm, thunder.last_traces(jm)[-1], thunder.last_backward_traces(jm)[-1]


@pytest.fixture(scope="module", autouse=True)
def _forget_traces_with_the_group():
    yield
    _tiny_gpt.cache_clear()  # they refer to this module's process group


def _collectives(*traces, layouts=NO_BUCKETS):
    return [c for trace in traces for c in classify_trace(trace, layouts=layouts).collectives]


@pytest.mark.parametrize("sharding", ["zero2", "zero3"])
def test_gathers_move_bf16_reductions_fp32_and_parameters_stay_fp32(sharding):
    jm, forward, backward = _tiny_gpt(sharding, BF16_FP32)
    collectives = _collectives(forward, backward)
    gathers = [c for c in collectives if c.kind is CollectiveKind.ALL_GATHER]
    reductions = [c for c in collectives if c.kind is CollectiveKind.REDUCE_SCATTER]
    assert gathers and reductions
    assert {c.dtype for c in gathers} == {dtypes.bfloat16}
    assert {c.dtype for c in reductions} == {dtypes.float32}
    assert {p.dtype for p in jm.parameters()} == {torch.float32}
    # TinyGPT's position embedding is frozen: gathered (in bf16), never reduced.
    assert {p.grad.dtype for p in jm.parameters() if p.requires_grad} == {torch.float32}


@pytest.mark.parametrize("sharding", ["zero2", "zero3"])
def test_gathers_move_exactly_half_the_bytes_of_float32(sharding):
    def gathered_bytes(policy):
        _, forward, backward = _tiny_gpt(sharding, policy)
        return sum(c.unsharded_bytes for c in _collectives(forward, backward) if c.kind is CollectiveKind.ALL_GATHER)

    def reduced_bytes(policy):
        _, forward, backward = _tiny_gpt(sharding, policy)
        return sum(c.unsharded_bytes for c in _collectives(forward, backward) if c.kind is CollectiveKind.REDUCE_SCATTER)

    assert gathered_bytes(BF16_FP32) * 2 == gathered_bytes(None) > 0
    assert reduced_bytes(BF16_FP32) == reduced_bytes(None) > 0


def test_buckets_gather_exactly_half_the_bytes_and_cast_each_flat_shard_once():
    def bucketed(policy):
        jm, forward, backward = _tiny_gpt("zero3", policy, "block")
        bucketing = BucketingTransform.of(jm)
        assert bucketing.summaries.forward.unbucketed == [] and bucketing.summaries.backward.unbucketed == []
        gathers = [c for c in _collectives(forward, backward, layouts=bucketing.layouts) if c.kind is CollectiveKind.ALL_GATHER]
        issues = [b for t in (forward, backward) for b in t.bound_symbols if b.sym.name.endswith("bucket_all_gather")]
        return bucketing, gathers, issues

    buckets, gathers, issues = bucketed(BF16_FP32)
    fp32_buckets, fp32_gathers, fp32_issues = bucketed(None)
    assert {c.dtype for c in gathers} == {dtypes.bfloat16}
    assert sum(c.unsharded_bytes for c in gathers) * 2 == sum(c.unsharded_bytes for c in fp32_gathers) > 0
    # No per-parameter cast is left: each gather casts its buckets' flat shards, which the cost
    # model prices as one read of float32 and one write of bfloat16; without a cast, nothing.
    assert not [b for t in _tiny_gpt("zero3", BF16_FP32, "block")[1:] for b in t.bound_symbols if b.sym.name == "shard_cast"]
    assert issues and fp32_issues
    for issue in issues:
        members = [m[0] for m in issue.args[1]] if issue.sym.name.startswith("coalesced") else [issue.args[0]]
        shard_numel = sum(buckets.layouts[b].unsharded_numel // buckets.layouts[b].world_size for b in members)
        assert local_copy_bytes(issue, buckets.layouts) == shard_numel * (4 + 2)
    assert {local_copy_bytes(issue, fp32_buckets.layouts) for issue in fp32_issues} == {0}


def test_zero3_backward_casts_the_float32_shards_it_regathers():
    _, _, backward = _tiny_gpt("zero3", BF16_FP32)
    annotated = classify_trace(backward)
    regathers = [c for c in annotated.collectives if c.kind is CollectiveKind.ALL_GATHER]
    assert regathers
    for collective in regathers:
        casts = [annotated.nodes[p] for p in collective.prologue]
        assert casts and all(n.name == "shard_cast" for n in casts), [n.name for n in casts]
        for node in casts:
            (shard,) = [a for a in node.bsym.flat_proxy_args if isinstance(a, TensorProxy)]
            assert annotated.is_input(shard.name) and shard.dtype == dtypes.float32
            assert node.kind is NodeKind.PROLOGUE


@pytest.mark.parametrize("policy", [MixedPrecision(torch.float32, torch.float32), MixedPrecision(reduce_dtype=torch.float32)])
def test_a_policy_that_casts_nothing_adds_nothing(policy):
    _, forward, backward = _tiny_gpt("zero3", policy)
    _, plain_forward, plain_backward = _tiny_gpt("zero3", None)
    assert str(forward) == str(plain_forward) and str(backward) == str(plain_backward)


class _Scaled(nn.Module):
    """Linear layers with a float32 buffer between them, applied as ``use`` says; "index_add"
    adds a gathered weight into the promoted activation, an op that refuses mixed dtypes."""

    def __init__(self, use: str) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 4)
        self.register_buffer("scale", torch.full((8,), 0.5))
        self.use = use

    def forward(self, x: torch.Tensor, steps: int) -> torch.Tensor:
        h = self.fc1(x)
        h = h * (self.scale.type_as(h) if self.use == "type_as" else self.scale)
        if self.use == "index_add":
            h = h.index_add(0, torch.tensor([0]), self.fc1.bias[None])
        return self.fc2(h) * steps


def _step(model: nn.Module, policy: MixedPrecision, sharding: str = "zero3"):
    torch.manual_seed(0)
    jm = thunder_overlap.fsdp(model, device="cpu", sharding_strategy=sharding, mixed_precision=policy)
    out = jm(torch.randn(2, 8), 3)
    out.float().sum().backward()
    return jm, out


def _downcasts(jm) -> list[str]:
    return next(t for t in thunder.compile_data(jm).transforms if isinstance(t, MixedPrecisionTransform)).downcasts


def test_a_matmul_given_a_promoted_activation_runs_in_bf16_and_is_listed():
    # The buffer promotes the activation to float32; fc2 then meets bf16 weights, and runs as
    # under autocast: its float32 input downcast to bf16.
    jm, out = _step(_Scaled("as is"), BF16_FP32)
    assert out.dtype is torch.bfloat16
    assert [re.sub(r":\d+", ":N", d) for d in _downcasts(jm)] == ["linear at linear.py:N (float32 inputs)"]
    forward = thunder.last_traces(jm)[-1]
    linears = [b for b in forward.bound_symbols if b.sym.name == "linear"]
    assert linears and all({a.dtype for a in b.flat_proxy_args if isinstance(a, TensorProxy)} == {dtypes.bfloat16} for b in linears)
    assert {p.grad.dtype for p in jm.parameters()} == {torch.float32}


def test_an_op_that_refuses_mixed_dtypes_is_an_error_naming_it_and_the_promotion():
    with pytest.raises(RuntimeError) as error:
        _step(_Scaled("index_add"), BF16_FP32)
    message = str(error.value)
    refused = (
        r"thunder_overlap mixed precision: index_add at test_mixed_precision_fake_group\.py:\d+ refuses its inputs once "
        r"parameters are gathered in bfloat16 \("
    )
    assert re.match(refused, message), message
    # The float32 activation is traced back to the model's line that promoted it.
    promoted_here = r"\(\w+: float32, \w+: int64, \w+: bfloat16\).* \w+ comes from mul at test_mixed_precision_fake_group\.py:\d+\."
    assert re.search(promoted_here, message), message
    assert "buffer.type_as(activation)" in message


class _UpcastNorm(nn.Module):
    """RMSNorm as litgpt and transformers write it: computed in float32, cast back to the
    input's dtype, which the trace holds as the float32 it was when traced."""

    def __init__(self, cast_back: str) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 4)
        self.cast_back = cast_back

    def forward(self, x: torch.Tensor, steps: int) -> torch.Tensor:
        h = self.fc1(x)
        normed = h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6)
        normed = normed.to(dtype=h.dtype) if self.cast_back == "to(h.dtype)" else normed.type_as(h)
        return self.fc2(normed) * steps


def test_a_dtype_read_from_a_tensor_when_traced_ends_at_the_next_matmul():
    jm, out = _step(_UpcastNorm("to(h.dtype)"), BF16_FP32)
    assert out.dtype is torch.bfloat16
    assert [re.sub(r":\d+", ":N", d) for d in _downcasts(jm)] == ["linear at linear.py:N (float32 inputs)"]
    jm, out = _step(_UpcastNorm("type_as(h)"), BF16_FP32)
    assert out.dtype is torch.bfloat16 and _downcasts(jm) == []


def test_a_buffer_cast_like_the_activation_follows_it():
    jm, out = _step(_Scaled("type_as"), BF16_FP32)
    assert out.dtype is torch.bfloat16
    assert {p.grad.dtype for p in jm.parameters()} == {torch.float32}


def test_forward_arguments_are_cast_and_flat_args_keep_the_inputs():
    jm, _ = _step(_Scaled("type_as"), BF16_FP32)
    retraced = next(t for t in thunder.last_traces(jm) if "mixed precision" in str(t.get_provenance()))
    x = retraced.args[0]
    casts = [b for b in retraced.bound_symbols if b.sym.name == "convert_element_type"]
    # The float argument only: the float32 buffer and the parameters' shards are inputs too.
    assert "t_scale" in [a.name for a in retraced.args]
    assert [(b.args[0].name, b.args[1]) for b in casts] == [(x.name, dtypes.bfloat16)]
    (returned,) = next(b for b in retraced.bound_symbols if b.sym.id is prims.PrimIDs.RETURN).args
    assert returned["flat_args"][0] is x
    assert [o.dtype for o in returned["output"]] == [dtypes.bfloat16]


def test_a_frozen_parameter_is_gathered_in_bf16_and_gets_no_gradient():
    model = _Scaled("type_as")
    model.fc1.weight.requires_grad_(False)
    jm, _ = _step(model, BF16_FP32, sharding="zero2")
    grads = {n: None if p.grad is None else p.grad.dtype for n, p in jm.named_parameters()}
    assert grads == {"fc1.weight": None, "fc1.bias": torch.float32, "fc2.weight": torch.float32, "fc2.bias": torch.float32}
    gathers = [c for c in _collectives(thunder.last_traces(jm)[-1]) if c.kind is CollectiveKind.ALL_GATHER]
    assert {c.dtype for c in gathers} == {dtypes.bfloat16}


def test_a_narrow_reduce_dtype_lands_in_float32_gradients():
    jm, _ = _step(_Scaled("type_as"), MixedPrecision(torch.bfloat16, torch.bfloat16))
    backward = thunder.last_backward_traces(jm)[-1]
    reductions = [c for c in _collectives(backward) if c.kind is CollectiveKind.REDUCE_SCATTER]
    assert reductions and {c.dtype for c in reductions} == {dtypes.bfloat16}
    assert {p.grad.dtype for p in jm.parameters()} == {torch.float32}
