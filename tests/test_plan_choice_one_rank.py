"""Adopting block buckets in place of ``"auto"``'s at the first compile ([Note: auto against
block]) on a one-rank gloo group: the parameters stay the objects an optimizer made before the
first step holds, keep their values, and train like eager on the new buffers."""

from __future__ import annotations

import pytest
import torch

import thunder_overlap
from thunder_overlap import BucketingTransform
from thunder_overlap._transforms import _model_state
from thunder_overlap.report._builtin_models import TinyGPT, TinyGPTConfig

MODEL = TinyGPTConfig(n_layer=2, vocab_size=64, n_embd=32)

pytestmark = pytest.mark.slow


@pytest.fixture
def block_predicted_faster(monkeypatch) -> list[list[float]]:
    """Every plan choice finds block buckets (the second plan priced) twice as fast as it was
    predicted; records each one's own predictions."""
    priced: list[list[float]] = []

    def halved_block(step_ms, group):
        priced.append(list(step_ms))
        return [step_ms[0], step_ms[0] / 2]

    monkeypatch.setattr(_model_state, "summed_over_ranks", halved_block)
    return priced


@pytest.mark.parametrize("sharding", ["zero2", "zero3"])
def test_adopted_block_buckets_keep_the_parameters_and_train_like_eager(one_rank_gloo_group, block_predicted_faster, sharding):
    torch.manual_seed(0)
    eager = TinyGPT(MODEL)
    torch.manual_seed(0)
    jm = thunder_overlap.fsdp(TinyGPT(MODEL), sharding_strategy=sharding, bucketing_strategy="auto")
    bucketing = BucketingTransform.of(jm)
    auto_labels = [plan.label for plan in bucketing.plans]
    # A value set before the first step (a checkpoint loaded) must survive the new layout.
    with torch.no_grad():
        for model in (eager, jm):
            model.get_parameter("norm_f.weight").fill_(0.5)
    parameters = dict(jm.named_parameters())
    optimizers = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1) for m in (eager, jm)]
    for step in range(3):
        idx = torch.randint(0, MODEL.vocab_size, (2, 8), generator=torch.Generator().manual_seed(step))
        for model, optimizer in zip((eager, jm), optimizers, strict=True):
            optimizer.zero_grad()
            model(idx).square().mean().backward()
            optimizer.step()
    assert len(block_predicted_faster) == 1, "chosen once, at the first compile"
    assert auto_labels != [plan.label for plan in bucketing.plans] == [
        "wte", "wpe (float32, frozen)", "blocks.0", "blocks.1", "norm_f"
    ]  # fmt: skip
    assert bucketing.summaries.plan_choice.chosen == "block"
    # The same objects, now views of the new flat shards, which the optimizer updated in place.
    assert all(p is parameters[name] for name, p in jm.named_parameters())
    flat_storages = {bucket.flat_shard.untyped_storage().data_ptr() for bucket in bucketing.buckets}
    assert {p.untyped_storage().data_ptr() for p in parameters.values()} == flat_storages
    for name, p in eager.named_parameters():
        torch.testing.assert_close(jm.get_parameter(name), p, msg=name)
