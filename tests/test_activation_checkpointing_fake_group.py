"""Activation checkpointing's final traces, in one process on the fake process group (4 ranks):
the backward recomputes every block, and under ZeRO3 each parameter is gathered once there, by the
gather that serves both the recomputation and the gradients; ZeRO2 gathers nothing in the backward.
Numerics and measured memory: tests/test_e2e_activation_checkpointing.py."""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import thunder
import torch

import thunder_overlap
from thunder_overlap import OverlapConfig
from thunder_overlap._analysis.classify import CollectiveKind, NodeKind, classify_trace
from thunder_overlap._transforms.zero3 import Zero3Transform
from thunder_overlap.config import Tuning
from thunder_overlap.report._builtin_models import Llama, LlamaConfig, TinyGPT, TinyGPTConfig
from thunder_overlap.testing.training import saved_unsharded

MODEL = TinyGPTConfig(n_layer=2, n_embd=32)
LLAMA = LlamaConfig(vocab_size=64, n_embd=32, n_head=4, n_layer=2, intermediate_size=64, block_size=32)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fake_group_4")]


@functools.cache
def _stepped(model: str, sharding: str, bucketing: str, checkpointing: bool, hybrid: bool = False, keeps_free: bool = False):
    """The model after one step; cached, compiling dominates. ZeRO3 re-gathers every parameter
    unless ``keeps_free`` ([Note: ZeRO3 keeps what is free]), so that every block's recomputation
    is served by a re-gather; test_zero3_keeps_what_is_free_with_checkpointing checks the default."""
    mesh = None
    if hybrid:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2))
    torch.manual_seed(0)
    module = TinyGPT(MODEL) if model == "tinygpt" else Llama(LLAMA)
    jm = thunder_overlap.fsdp(
        module,
        device="cpu",
        sharding_strategy=sharding,
        bucketing_strategy=bucketing,
        activation_checkpointing=checkpointing,
        device_mesh=mesh,
        config=OverlapConfig(_tuning=Tuning(zero3_keeps_free_units=keeps_free)),
    )
    jm(torch.randint(0, 64, (2, 8))).sum().backward()
    return jm


def _traces(*args, **kwargs):
    """Final (forward, backward) traces of ``_stepped(*args, **kwargs)``."""
    jm = _stepped(*args, **kwargs)
    return thunder.last_traces(jm)[-1], thunder.last_backward_traces(jm)[-1]


@pytest.fixture(scope="module", autouse=True)
def _forget_traces_with_the_group():
    yield
    _stepped.cache_clear()


def _gathered(trace) -> list[tuple[str, ...]]:
    """The parameters each all-gather of ``trace`` gathers (a bucket's by the names it reads)."""
    annotated = classify_trace(trace, roles_only=True)
    gathers = []
    for c in annotated.collectives:
        if c.kind is CollectiveKind.ALL_GATHER:
            gathers.append(tuple(name for name in annotated.nodes[c.start].inputs if name.startswith("t_")))
    return gathers


def _compute_ops(trace) -> Counter:
    annotated = classify_trace(trace, roles_only=True)
    return Counter(n.name for n in annotated.nodes if n.kind is NodeKind.COMPUTE)


@pytest.mark.parametrize(("model", "bucketing"), [("tinygpt", "none"), ("llama", "block")])
def test_the_backward_recomputes_every_block_from_fewer_saved_tensors(model, bucketing):
    plain_forward, plain_backward = _traces(model, "zero3", bucketing, False)
    forward, backward = _traces(model, "zero3", bucketing, True)
    # Each block's linears run again in the backward: all but its last, whose output only feeds
    # the residual sum, which the backward does not need (TinyGPT: qkv, attention proj, fc of 4;
    # Llama: qkv, proj, fc_1, fc_2 of 5).
    recomputed = _compute_ops(backward)["linear"] - _compute_ops(plain_backward)["linear"]
    per_block = {"tinygpt": 3, "llama": 4}[model]
    assert recomputed == per_block * (MODEL.n_layer if model == "tinygpt" else LLAMA.n_layer), (recomputed, _compute_ops(forward))
    saved, plain_saved = (len(f.bound_symbols[-1].args[1][0]) for f in (forward, plain_forward))
    assert saved < plain_saved / 2, (saved, plain_saved)
    assert saved_unsharded(forward) == []


@pytest.mark.parametrize(
    ("model", "bucketing", "hybrid"), [("tinygpt", "none", False), ("llama", "block", False), ("tinygpt", "block", True)]
)
def test_zero3_gathers_each_parameter_once_in_the_backward(model, bucketing, hybrid):
    _, plain = _traces(model, "zero3", bucketing, False, hybrid)
    _, checkpointed = _traces(model, "zero3", bucketing, True, hybrid)
    gathers = _gathered(checkpointed)
    # One gather serves a block's recomputation and its gradients: a second one for the
    # recomputation would gather its parameters twice.
    twice = [name for name, count in Counter(name for gather in gathers for name in gather).items() if count > 1]
    assert twice == []
    # What the backward gathered without checkpointing, and what the recomputation needs besides
    # (biases, norms' weights), in no more launches: the recomputation adds no gather of its own.
    gathered = {name for gather in gathers for name in gather}
    assert gathered >= {name for gather in _gathered(plain) for name in gather}
    assert len(gathers) <= len(_gathered(plain))
    n_layer = MODEL.n_layer if model == "tinygpt" else LLAMA.n_layer
    assert gathered >= {f"t_blocks_{i}_norm_1_weight" for i in range(n_layer)}
    if bucketing == "block":
        # One per block, and one for the output head's bucket, which the backward needs first
        # (launched with the last block's where the cost model coalesces them).
        assert n_layer <= len(gathers) <= n_layer + 1


def test_zero3_keeps_what_is_free_with_checkpointing():
    # By default ZeRO3 keeps what its backward needs first where that is free: the same units
    # with checkpointing as without here. Their parameters stay saved gathered, so neither the
    # recomputation nor the gradients gather them again; every other weight the backward reads
    # is gathered once, for both.
    jm = _stepped("llama", "zero3", "block", True, keeps_free=True)
    kept = Zero3Transform.of(jm).choice.kept
    assert kept == Zero3Transform.of(_stepped("llama", "zero3", "block", False, keeps_free=True)).choice.kept
    assert kept and f"blocks.{LLAMA.n_layer - 1}" in kept
    kept_shards = {"t_" + name.replace(".", "_") for name in Zero3Transform.of(jm).kept_parameters()}
    gathers = _gathered(thunder.last_backward_traces(jm)[-1])
    gathered = [name for gather in gathers for name in gather]
    assert len(gathered) == len(set(gathered)) and not kept_shards & set(gathered)
    _, regather_all = _traces("llama", "zero3", "block", True)
    assert set(gathered) == {name for gather in _gathered(regather_all) for name in gather} - kept_shards


def test_zero2_gathers_nothing_in_the_backward():
    _, backward = _traces("tinygpt", "zero2", "none", True)
    assert _gathered(backward) == []
    assert _compute_ops(backward)["linear"] > 0  # it recomputes all the same


def test_zero3_gathers_before_each_block_recomputes():
    # Each re-gather is issued before the compute that precedes its first use: it is prefetched
    # behind the backward of the block after it, not waited for where the recomputation starts.
    _, backward = _traces("llama", "zero3", "block", True)
    annotated = classify_trace(backward, roles_only=True)
    checked = 0
    for c in annotated.collectives:
        if c.kind is not CollectiveKind.ALL_GATHER:
            continue
        between = [n for n in annotated.nodes[c.start + 1 : c.wait] if n.kind is NodeKind.COMPUTE]
        if any(n.kind is NodeKind.COMPUTE for n in annotated.nodes[: c.start]):
            assert any(n.name == "matmul" for n in between), (annotated.nodes[c.start].name, [n.name for n in between])
            checked += 1
    assert checked >= 1  # block 0's re-gather at least is issued behind block 1's backward


def test_no_sync_accumulates_with_checkpointing_and_no_reduce_scatter():
    torch.manual_seed(0)
    jm = thunder_overlap.fsdp(
        Llama(LLAMA), device="cpu", sharding_strategy="zero3", bucketing_strategy="block", activation_checkpointing=True
    )
    idx = torch.randint(0, 64, (2, 8))
    with jm.no_sync():
        jm(idx).sum().backward()
    backward = thunder.last_backward_traces(jm)[-1]
    annotated = classify_trace(backward, roles_only=True)
    assert not any(c.kind is CollectiveKind.REDUCE_SCATTER for c in annotated.collectives)
    assert _compute_ops(backward)["linear"] > 0  # the recomputation runs in the accumulating step too
    jm(idx).sum().backward()  # the step that reduce-scatters what was accumulated
    assert all(p.grad is not None for p in jm.parameters() if p.requires_grad)
