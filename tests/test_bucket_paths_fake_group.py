"""Bucket paths chosen over gloo where the pool would otherwise hold a spare buffer: gathers per
parameter instead of a copy-out and reduce-scatters from the backend's copy instead of a lay-out
held to the wait (_bucketing/path_choice.py), on PyTorch's
fake process group as rank 0 of 2: real traces and the real bucket runtime, with each bucket told
that its backend runs a coalesced launch one collective at a time and copies a reduce-scatter's
input, as gloo does (the fake group otherwise stands for NCCL)."""

from __future__ import annotations

import pytest
import thunder
import torch

import thunder_overlap
from thunder_overlap._analysis.classify import NodeKind, classify_trace
from thunder_overlap._analysis.cost_model import CostModel
from thunder_overlap._analysis.layout import GatherPath, ReducePath
from thunder_overlap._analysis.memory_estimate import estimate_memory
from thunder_overlap._backends import GLOO
from thunder_overlap._bucketing.path_choice import GATHERED_PER_PARAMETER, REDUCED_FROM_COPY
from thunder_overlap.config import Tuning
from thunder_overlap.report._builtin_models import TinyGPT, TinyGPTConfig

# Every test here traces a model with Thunder several times (seconds each).
pytestmark = pytest.mark.slow

MODEL = TinyGPTConfig(n_layer=2, n_embd=64)


def _block_as_over_gloo(cost_model: CostModel, sharding: str = "zero2", model: TinyGPTConfig = MODEL, tokens=(4, 32), **options):
    """Block buckets whose coalesced launches run one collective at a time and whose backend
    copies a reduce-scatter's input, as over gloo (the fake group otherwise stands for NCCL):
    gathered rank-major and copied out, gradients laid out, unless chosen otherwise. Two steps:
    the first compiles and grows the pool."""
    torch.manual_seed(0)
    config = thunder_overlap.OverlapConfig(cost_model=cost_model, _tuning=Tuning(**options))
    jm = thunder_overlap.fsdp(TinyGPT(model), device="cpu", sharding_strategy=sharding, bucketing_strategy="block", config=config)
    bucketing = thunder_overlap.BucketingTransform.of(jm)
    bucketing.set_layouts({bucket: layout.as_on(GLOO) for bucket, layout in bucketing.layouts.items()})
    tokens = torch.randint(0, model.vocab_size, tokens)
    for _ in range(2):
        jm(tokens).sum().backward()
        for p in jm.parameters():
            p.grad = None
    return jm


def test_over_gloo_the_last_block_gathers_per_parameter_where_the_step_allows(fake_group_2):
    # Loopback gloo's 50 us per launch: ZeRO2's last block, whose rank-major buffer would sit
    # idle from the end of the forward to the end of the step, gathers per parameter instead.
    jm = _block_as_over_gloo(CostModel.named("cpu", "gloo-loopback"))
    schedule = thunder_overlap.OverlapScheduleTransform.of(jm)
    last_block = f"blocks.{MODEL.n_layer - 1}"
    gathered_per_parameter = schedule.bucket_paths.labels(GATHERED_PER_PARAMETER)
    assert last_block in gathered_per_parameter
    choice = schedule.bucket_paths.outcome(GATHERED_PER_PARAMETER)
    assert choice.peak_bytes[1] < choice.peak_bytes[0] and choice.step_ms[1] <= 1.01 * choice.step_ms[0]
    bucketing = thunder_overlap.BucketingTransform.of(jm)
    buckets = {b.plan.label: b for b in bucketing.buckets}
    assert {label for label, b in buckets.items() if b.layout.gather is GatherPath.IN_PLACE} == set(gathered_per_parameter)
    # The final forward launches a collective per parameter for it, and the cost model knows.
    forward = thunder.last_traces(jm)[-1]
    annotated = classify_trace(forward, bucketing.layouts)
    launches = {}
    for coll in annotated.collectives:
        bsym = annotated.nodes[coll.start].bsym
        if bsym.sym.name == "bucket_all_gather":
            launches[bsym.args[0].label] = coll.launches
    assert launches[last_block] == buckets[last_block].layout.tensors > 1
    assert all(n == 1 for label, n in launches.items() if label not in gathered_per_parameter)
    # The pool the steps grew is the plan from the final traces, one buffer per block: no spare
    # rank-major buffer, and the path choice's forward peak is the estimate's.
    estimate = estimate_memory(forward, layouts=bucketing.layouts)
    backward = estimate_memory(thunder.last_backward_traces(jm)[-1], layouts=bucketing.layouts, after=estimate)
    assert sorted(s.users for s in backward.pool.slots) == sorted(s.users for s in bucketing.pool.slots)
    block_numel = buckets[last_block].layout.unsharded_numel
    assert sum(b.numel() == block_numel for b in bucketing.pool.buffers) == MODEL.n_layer
    assert schedule.bucket_paths.forward_memory.peak_bytes == estimate.peak_bytes


def test_over_a_slow_link_no_bucket_gathers_per_parameter(fake_group_2):
    # 100 ms per launch: the memory would be saved, but the extra launches would hold the link.
    jm = _block_as_over_gloo(CostModel.named("cpu", "custom:100000:1:ring:2"))
    schedule = thunder_overlap.OverlapScheduleTransform.of(jm)
    choice = schedule.bucket_paths.outcome(GATHERED_PER_PARAMETER)
    assert choice.labels == ()
    assert choice.peak_bytes[1] < choice.peak_bytes[0]
    assert choice.step_ms[1] > 1.01 * choice.step_ms[0] and "slower" in choice.reason
    assert not any(b.layout.gather is GatherPath.IN_PLACE for b in thunder_overlap.BucketingTransform.of(jm).buckets)


def test_over_gloo_zero3_hands_the_lay_outs_that_would_grow_the_pool_to_the_backends_copy(fake_group_2):
    # Held to its wait, the last block's laid-out gradients would be a third block buffer beside
    # the first block's parameters and their gather; handed to the backend's copy at the launch,
    # the pool needs two, as on NCCL.
    cost_model = CostModel.named("cpu", "gloo-loopback")
    jm = _block_as_over_gloo(cost_model, "zero3", per_tensor_gather_max_slowdown=None)
    schedule = thunder_overlap.OverlapScheduleTransform.of(jm)
    last_block = f"blocks.{MODEL.n_layer - 1}"
    assert schedule.bucket_paths.labels(REDUCED_FROM_COPY) == (last_block,)
    choice = schedule.bucket_paths.outcome(REDUCED_FROM_COPY)
    assert choice.peak_bytes[1] < choice.peak_bytes[0]
    # The simulator charges the backend's copy: a little slower, within the 2% allowed.
    assert choice.step_ms[0] < choice.step_ms[1] <= 1.02 * choice.step_ms[0]
    bucketing = thunder_overlap.BucketingTransform.of(jm)
    buckets = {b.plan.label: b for b in bucketing.buckets}
    assert {label for label, b in buckets.items() if b.layout.reduce is ReducePath.FROM_COPY} == {last_block}
    # The runtime's pool is the plan from the final traces: two block buffers.
    forward = estimate_memory(thunder.last_traces(jm)[-1], layouts=bucketing.layouts)
    backward = estimate_memory(thunder.last_backward_traces(jm)[-1], layouts=bucketing.layouts, after=forward)
    pool = bucketing.pool
    assert sorted(s.users for s in backward.pool.slots) == sorted(s.users for s in pool.slots)
    block_numel = buckets[last_block].layout.unsharded_numel
    assert sum(b.numel() == block_numel for b in pool.buffers) == 2
    # The backend's copy is held from the launch to the wait, outside the pool.
    assert f"{last_block} reduce-scatter" in {u for s in pool.slots for u in s.users}
    assert schedule.bucket_paths.backward_memory.peak_bytes == backward.peak_bytes


def test_zero3_keeps_its_lay_outs_where_the_backends_copy_is_too_slow(fake_group_2):
    # No slowdown allowed: the backend's copy costs time, so the pool keeps its third buffer. With
    # every parameter re-gathered: the backward's first re-gathers sit beside the last block's
    # lay-out (kept to the backward, the last block needs no third buffer).
    options = {"per_tensor_gather_max_slowdown": None, "reduce_from_copy_max_slowdown": 0.0, "zero3_keeps_free_units": False}
    jm = _block_as_over_gloo(CostModel.named("cpu", "gloo-loopback"), "zero3", **options)
    schedule = thunder_overlap.OverlapScheduleTransform.of(jm)
    choice = schedule.bucket_paths.outcome(REDUCED_FROM_COPY)
    assert choice.labels == () and "slower" in choice.reason
    assert choice.peak_bytes[1] < choice.peak_bytes[0]
    buckets = thunder_overlap.BucketingTransform.of(jm).buckets
    assert not any(b.layout.reduce is ReducePath.FROM_COPY for b in buckets)
    block_numel = max(b.layout.unsharded_numel for b in buckets)
    assert sum(b.numel() == block_numel for b in thunder_overlap.BucketingTransform.of(jm).pool.buffers) == 3


def _pool_reduce_scatters_in_flight(trace, layouts) -> int:
    """The most reduce-scatters holding a pool buffer (to their wait) in flight at once in ``trace``."""
    annotated = classify_trace(trace, layouts)
    in_flight = most = 0
    for node in annotated.nodes:
        if node.kind not in (NodeKind.COLLECTIVE, NodeKind.WAIT) or not annotated.collectives[node.collective].pool_bytes_to_wait:
            continue
        in_flight += 1 if node.kind is NodeKind.COLLECTIVE else -1
        most = max(most, in_flight)
    return most


def test_over_gloo_zero3_holds_one_laid_out_reduce_scatter_at_a_time(fake_group_2):
    # The parameter-dominated shape (a few tokens): two blocks gathered ahead in the backward.
    # Beside them, a second lay-out held to its wait is one more block buffer in the pool.
    shape = {"model": TinyGPTConfig(n_layer=4, n_embd=128, block_size=64), "tokens": (1, 16)}
    cost_model = CostModel.named("cpu", "gloo-loopback")
    results = {}
    for blocks in (1.0, None):
        jm = _block_as_over_gloo(cost_model, "zero3", bucket_reduce_scatter_blocks=blocks, **shape)
        bucketing = thunder_overlap.BucketingTransform.of(jm)
        block_numel = max(b.layout.unsharded_numel for b in bucketing.buckets)
        block_buffers = sum(b.numel() == block_numel for b in bucketing.pool.buffers)
        results[blocks] = (_pool_reduce_scatters_in_flight(thunder.last_backward_traces(jm)[-1], bucketing.layouts), block_buffers)
    assert results[1.0] == (1, 3)
    assert results[None][1] == 4
