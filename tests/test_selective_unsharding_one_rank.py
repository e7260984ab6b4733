"""Sharding "auto" on one gloo rank (collectives run, as copies): accumulation under no_sync and
checkpoints keep working with some blocks kept unsharded, and compute what ZeRO3 computes."""

from __future__ import annotations

import pytest
import thunder
import torch

import thunder_overlap
from thunder_overlap import BucketingTransform, OverlapConfig, checkpoint
from thunder_overlap._transforms.zero3 import Zero3Transform
from thunder_overlap.config import Tuning
from thunder_overlap.report._builtin_models import TinyGPT, TinyGPTConfig
from thunder_overlap.report._schedule_view import schedule_stats

pytestmark = pytest.mark.slow

# Three blocks: the fewest for which the halfway budget keeps some blocks and re-gathers others
# (with two it keeps all four candidates); each block more is seconds of every compile here.
MODEL = TinyGPTConfig(n_layer=3, n_embd=64)


def _model(sharding: str, budget: int | None = None):
    torch.manual_seed(0)
    config = OverlapConfig(memory_budget_bytes=budget) if budget is not None else None
    return thunder_overlap.fsdp(TinyGPT(MODEL), device="cpu", sharding_strategy=sharding, bucketing_strategy="block", config=config)


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, MODEL.vocab_size, (2, 32), generator=torch.Generator().manual_seed(step))


def _backward_all_gathers(jm) -> int:
    return schedule_stats(thunder.last_backward_traces(jm)[-1], layouts=BucketingTransform.of(jm).layouts).allgathers


def _accumulate(jm) -> dict[str, torch.Tensor]:
    """Two micro-batches under no_sync, then one synchronised: the accumulated gradients."""
    with jm.no_sync():
        jm(_batch(0)).float().pow(2).mean().backward()
        jm(_batch(1)).float().pow(2).mean().backward()
    jm(_batch(2)).float().pow(2).mean().backward()
    return {name: p.grad.clone() for name, p in jm.named_parameters() if p.requires_grad}


@pytest.fixture(scope="module")
def halfway_budget(one_rank_gloo_group) -> int:
    jm = _model("auto", 1 << 40)
    jm(_batch(0)).sum().backward()
    choice = Zero3Transform.of(jm).choice
    return (choice.zero3_peak_bytes + choice.zero2_peak_bytes) // 2


def test_accumulation_under_no_sync_keeps_the_choice_and_zero3s_gradients(halfway_budget):
    jm = _model("auto", halfway_budget)
    grads = _accumulate(jm)
    choice = Zero3Transform.of(jm).choice
    assert 0 < len(choice.kept) < len(choice.candidates)
    # Kept or re-gathered, a block computes on the same gathered values.
    expected = _accumulate(_model("zero3"))
    assert grads.keys() == expected.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], expected[name], rtol=0, atol=0, msg=name)
    # The no_sync compile (a pass of its own) reused the first compile's choice.
    assert Zero3Transform.of(jm).choice is choice


def test_a_checkpoint_of_auto_loads_into_zero3(halfway_budget, tmp_path):
    jm = _model("auto", halfway_budget)
    optimizer = torch.optim.AdamW(jm.parameters(), lr=1e-2)
    jm(_batch(0)).float().pow(2).mean().backward()
    optimizer.step()
    checkpoint.save(tmp_path / "auto", jm, optimizer)
    expected = jm(_batch(1)).detach()

    zero3 = _model("zero3")
    checkpoint.load(tmp_path / "auto", zero3, torch.optim.AdamW(zero3.parameters(), lr=1e-2))
    torch.testing.assert_close(zero3(_batch(1)).detach(), expected, rtol=0, atol=0)


def test_zero3_keeping_what_its_backward_needs_first_computes_the_gradients_of_regathering_all(one_rank_gloo_group):
    # [Note: ZeRO3 keeps what is free]
    jm = _model("zero3")
    torch.manual_seed(0)
    config = OverlapConfig(_tuning=Tuning(zero3_keeps_free_units=False))
    plain = thunder_overlap.fsdp(TinyGPT(MODEL), device="cpu", sharding_strategy="zero3", bucketing_strategy="block", config=config)
    grads = []
    for model in (jm, plain):
        model(_batch(0)).float().pow(2).mean().backward()
        grads.append({name: p.grad for name, p in model.named_parameters()})
    choice = Zero3Transform.of(jm).choice
    # What the backward needs up to its first block, and that block: free at this batch.
    assert choice.candidates == ("wte", "norm_f", "blocks.2", "blocks.1", "blocks.0")
    assert choice.free and choice.kept == ("wte", "norm_f", "blocks.2") and choice.peak_bytes == choice.zero3_peak_bytes
    assert choice.sharding == "zero3" and "(wte, norm_f, blocks.2) at no memory" in choice.describe()
    for name in grads[1]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=0, atol=0, msg=name)
    # The kept buckets are the ones the backward no longer gathers; re-gathering every parameter
    # keeps none.
    assert _backward_all_gathers(jm) == _backward_all_gathers(plain) - 3
    assert Zero3Transform.of(plain).choice is None
