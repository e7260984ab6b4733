"""Memory estimator: aliases, copies, in-place ops, collectives, persistence, and the runtime
verifier on a real FSDP model (fake process group, 8 ranks, run on CPU)."""

from __future__ import annotations

import functools

import pytest
import thunder
import torch

import thunder_overlap
from thunder_overlap._analysis.layout import ReducePath
from thunder_overlap._analysis.memory_estimate import estimate_memory
from thunder_overlap._bucketing.path_choice import REDUCED_IN_POOL
from thunder_overlap.report._builtin_models import TinyGPT, TinyGPTConfig
from thunder_overlap.testing.live_memory import LiveMemoryTracker
from thunder_overlap.testing.memory_check import compare_memory, measure_memory, measure_step

X_BYTES = 64 * 32 * 4  # the f32[64, 32] input of the small functions below


def _trace_of(fn):
    jf = thunder.jit(fn)
    jf(torch.randn(64, 32))
    return thunder.last_traces(jf)[-1]


def _transposed_reshape(x):
    return x.transpose(0, 1).reshape(-1) + 1


def _contiguous_reshape(x):
    return x.reshape(32, 64) + 1


def _in_place(x):
    y = x * 2
    y.add_(1)
    return y


def test_reshape_of_a_transpose_copies():
    # x, then its reshaped copy, then the add's output: three storages at the add.
    estimate = estimate_memory(_trace_of(_transposed_reshape))
    assert estimate.input_bytes == X_BYTES
    assert estimate.peak_bytes == 3 * X_BYTES
    assert estimate.live_after[-1] == 2 * X_BYTES  # x (persistent) and the result


def test_reshape_of_a_contiguous_tensor_is_a_view():
    estimate = estimate_memory(_trace_of(_contiguous_reshape))
    assert estimate.peak_bytes == 2 * X_BYTES


def test_in_place_op_writes_into_its_buffer_without_double_counting():
    # y = x * 2; y.add_(1) becomes t = y + 1; copy_(t, y): at most x, y and t; the result is y.
    trace = _trace_of(_in_place)
    assert "copy_" in {b.sym.name for b in trace.bound_symbols}
    estimate = estimate_memory(trace)
    assert estimate.peak_bytes == 3 * X_BYTES
    assert estimate.live_after[-1] == 2 * X_BYTES


@pytest.mark.parametrize("fn", [_transposed_reshape, _contiguous_reshape, _in_place])
def test_small_functions_match_the_runtime_step_by_step(fn):
    trace = _trace_of(fn)
    x = torch.randn(64, 32)
    comparison = compare_memory(estimate_memory(trace), measure_memory(trace, [x]))
    assert comparison.first_divergence is None, comparison
    assert comparison.predicted_peak_bytes == comparison.measured_peak_bytes


def test_granularity_rounds_each_storage():
    estimate = estimate_memory(_trace_of(_contiguous_reshape), allocation_granularity=3000)
    assert estimate.input_bytes == 3000 * 3  # 8192 bytes round up to 9000


# ---------------------------------------------------------------------------------------------
# A real FSDP model

MODEL = TinyGPTConfig(n_layer=2, n_embd=64)


@pytest.fixture(scope="module")
def fake_group(fake_group_8):
    yield fake_group_8
    _traces.cache_clear()  # the traces refer to this module's group


@functools.cache
def _traces(sharding: str):
    torch.manual_seed(0)
    jm = thunder_overlap.fsdp(TinyGPT(MODEL), device="cpu", sharding_strategy=sharding)
    jm(torch.randint(0, MODEL.vocab_size, (4, 32))).sum().backward()
    return thunder.last_traces(jm)[-1], thunder.last_backward_traces(jm)[-1]


def _nbytes(proxy) -> int:
    return proxy.dtype.bytes * torch.Size(proxy.shape).numel()


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["zero2", "zero3"])
def test_estimate_matches_the_runtime_forward_and_backward(fake_group, sharding):
    forward, backward = _traces(sharding)
    predicted_forward = estimate_memory(forward)
    predicted_backward = estimate_memory(backward, after=predicted_forward)
    measured_forward, measured_backward = measure_step(forward, backward)
    for predicted, measured in ((predicted_forward, measured_forward), (predicted_backward, measured_backward)):
        comparison = compare_memory(predicted, measured)
        assert abs(comparison.peak_error) <= 0.05, comparison
        assert comparison.first_divergence is None, comparison


@pytest.mark.slow
def test_verifier_names_the_first_divergence(fake_group):
    forward, backward = _traces("zero3")
    # Pretend the parameters are not persistent: the forward then frees the shards it does not
    # hand to the backward (those no gradient needs, the frozen embedding's), which the module
    # keeps, so the backward's estimate starts without them.
    wrong = estimate_memory(backward, after=estimate_memory(forward, persistent_inputs=["idx"]))
    _, measured_backward = measure_step(forward, backward)
    comparison = compare_memory(wrong, measured_backward)
    assert comparison.first_divergence == 0
    assert comparison.first_divergence_code.startswith("# saved_for_backward")
    assert comparison.predicted_at_divergence < comparison.measured_at_divergence


@pytest.mark.slow
def test_parameters_are_persistent_and_reduce_scatter_inputs_live_until_their_future_dies(fake_group):
    forward, backward = _traces("zero3")
    predicted_forward = estimate_memory(forward)
    inputs = [b.flat_proxy_outs[0] for b in forward.bound_symbols if b.sym.name == "unpack_trivial"]
    assert predicted_forward.persistent_bytes == sum(_nbytes(p) for p in inputs)
    predicted = estimate_memory(backward, after=predicted_forward)
    names = [b.sym.name for b in backward.bound_symbols]
    deleted = [{p.name for p in b.flat_proxy_args} for b in backward.bound_symbols]
    checked = 0
    for i, bsym in enumerate(backward.bound_symbols):
        if "reduce_scatter" not in bsym.sym.name:
            continue
        gradient = bsym.flat_proxy_args[0].name
        future = bsym.flat_proxy_outs[0].name
        deleted_at = next(j for j in range(i + 1, len(names)) if names[j] == "python_del" and gradient in deleted[j])
        future_dies = next(j for j in range(i + 1, len(names)) if names[j] == "python_del" and future in deleted[j])
        if deleted_at < future_dies:
            assert predicted.freed[deleted_at] == 0  # the collective still holds the gradient
            assert predicted.freed[future_dies] >= _nbytes(bsym.flat_proxy_args[0])
            checked += 1
    assert checked > 0


# ---------------------------------------------------------------------------------------------
# Buckets: the pool's buffers, planned from the traces and counted for the whole step


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["zero2", "zero3"])
def test_bucketed_step_peak_and_pool_match_the_runtime(fake_group, sharding):
    torch.manual_seed(0)
    jm = thunder_overlap.fsdp(TinyGPT(MODEL), device="cpu", sharding_strategy=sharding, bucketing_strategy="block")
    tokens = torch.randint(0, MODEL.vocab_size, (4, 33))

    def forward_backward():
        jm(tokens[:, :-1]).sum().backward()

    forward_backward()  # compiles; the pool grows to what a step needs
    for p in jm.parameters():
        p.grad = None
    pool = thunder_overlap.BucketingTransform.of(jm).pool
    with LiveMemoryTracker() as measured:
        for buffer in pool.buffers:  # held all step long, also before the step first writes one
            measured.track(buffer)
        forward_backward()
    layouts = thunder_overlap.BucketingTransform.of(jm).layouts
    forward = estimate_memory(thunder.last_traces(jm)[-1], layouts=layouts)
    backward = estimate_memory(thunder.last_backward_traces(jm)[-1], layouts=layouts, after=forward)
    # The plan is the pool the step grew, buffer for buffer.
    assert sorted(s.users for s in backward.pool.slots) == sorted(s.users for s in pool.slots)
    assert backward.pool.nbytes == pool.allocated_bytes
    # The tracker counts the pool and what the step wrote (gradient shards included), not the
    # parameters and the batch it was given, which each estimate holds as persistent inputs.
    predicted = max(forward.peak_beyond_inputs_bytes, backward.peak_beyond_inputs_bytes)
    assert abs(predicted - measured.peak_bytes) <= 0.05 * measured.peak_bytes, (predicted, measured.peak_bytes)


def _zero2_block_step(reduce_in_pool: bool):
    torch.manual_seed(0)
    config = thunder_overlap.OverlapConfig(reduce_in_pool=reduce_in_pool)
    jm = thunder_overlap.fsdp(TinyGPT(MODEL), device="cpu", sharding_strategy="zero2", bucketing_strategy="block", config=config)
    jm(torch.randint(0, MODEL.vocab_size, (4, 32))).sum().backward()
    layouts = thunder_overlap.BucketingTransform.of(jm).layouts
    forward = estimate_memory(thunder.last_traces(jm)[-1], layouts=layouts)
    backward = estimate_memory(thunder.last_backward_traces(jm)[-1], layouts=layouts, after=forward)
    return jm, backward


@pytest.mark.slow
def test_zero2_buckets_reduce_in_the_pool_and_the_summary_counts_it(fake_group):
    jm, backward = _zero2_block_step(reduce_in_pool=True)
    buckets = thunder_overlap.BucketingTransform.of(jm).buckets
    trainable = [b for b in buckets if b.plan.requires_grad]
    # Every gathered buffer is idle once its block's backward is done: every bucket takes one.
    assert all(b.layout.reduce is ReducePath.IN_POOL for b in trainable)
    assert {f"{b.plan.label} reduce-scatter in place" for b in trainable} <= {u for s in backward.pool.slots for u in s.users}
    # The path choice predicts the step as it runs, with the paths it chose.
    paths = thunder_overlap.OverlapScheduleTransform.of(jm).bucket_paths
    assert paths.backward_memory.peak_bytes == backward.peak_bytes
    assert set(paths.labels(REDUCED_IN_POOL)) == {b.plan.label for b in trainable}
    _, own_shards = _zero2_block_step(reduce_in_pool=False)
    assert own_shards.pool.nbytes == backward.pool.nbytes  # the pool did not grow for it
    assert backward.peak_bytes < own_shards.peak_bytes

