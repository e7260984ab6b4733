"""A transform asked to change a trace either does or says why not: ZeRO3 raises, bucketing warns."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import thunder_overlap
from thunder_overlap._analysis.classify import NodeKind
from thunder_overlap._transforms import zero3

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def gloo_group(one_rank_gloo_group):
    return one_rank_gloo_group


def test_zero3_that_cannot_regather_raises_instead_of_keeping_zero2_memory(gloo_group, monkeypatch):
    # Simulate a trace whose gathered parameters ZeRO3 does not recognise: waits are no longer
    # part of the chain it replays. Before, ZeRO3 then returned the forward unchanged, silently.
    chain = tuple(k for k in zero3._PARAMETER_CHAIN if k is not NodeKind.WAIT)
    monkeypatch.setattr(zero3, "_PARAMETER_CHAIN", chain)
    model = thunder_overlap.fsdp(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), sharding_strategy="zero3")
    with pytest.raises(
        RuntimeError,
        match=r"ZeRO3: the forward saves these gathered parameters .*gathered from 1\.weight\): .*wait.* Use sharding_strategy='zero2'",
    ):
        model(torch.ones(3, 4, requires_grad=True))


def test_zero3_without_saved_parameters_needs_no_regather(gloo_group):
    # Only a bias: its gradient needs nothing from the forward, so ZeRO3 has nothing to re-gather.
    class AddBias(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bias = nn.Parameter(torch.arange(4.0))

        def forward(self, x):
            return x + self.bias

    model = thunder_overlap.fsdp(AddBias(), sharding_strategy="zero3")
    model(torch.ones(3, 4)).sum().backward()
    assert torch.equal(model.get_parameter("bias").grad, torch.full((4,), 3.0))


class _HalfUsedLayer(nn.Module):
    """A module with two parameters, one of which the forward never reads."""

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Parameter(torch.ones(4, 4))
        self.unused = nn.Parameter(torch.ones(4, 4))

    def forward(self, x):
        return x @ self.used


def test_bucketing_warns_about_collectives_it_leaves_per_parameter(gloo_group):
    model = thunder_overlap.fsdp(_HalfUsedLayer(), bucketing_strategy="layer")
    with pytest.warns(
        UserWarning,
        match=r"bucketing \(backward\): 1 collectives stay per-parameter: "
        r"reduce_scatter\(.*\): bucket .*reduce-scatters 1 of its 2 gradients",
    ):
        model(torch.ones(3, 4, requires_grad=True)).sum().backward()
    assert thunder_overlap.BucketingTransform.of(model).summaries.backward.unbucketed
