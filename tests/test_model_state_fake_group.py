"""One model's transforms share one state and nothing else ([Note: model state]): the blocks are
found once per model, whichever way the transforms are applied, and no transform holds another.
In one process on the fake process group (4 ranks)."""

from __future__ import annotations

import pytest
import thunder
import torch
from thunder.core.transform_common import Transform

import thunder_overlap
from thunder_overlap import OverlapConfig
from thunder_overlap._transforms import _model_state
from thunder_overlap._transforms._model_state import ModelState
from thunder_overlap._transforms.schedule import OverlapScheduleTransform
from thunder_overlap.report._builtin_models import TinyGPT, TinyGPTConfig
from thunder_overlap.report._report import unscheduled_trace

MODEL = TinyGPTConfig(n_layer=2, n_embd=32)
# Every option whose transform reads the blocks: checkpointing, sharding "auto" (its units),
# block buckets and the schedule (its prefetch limits). The budget keeps every unit.
OPTIONS = dict(
    device="cpu",
    sharding_strategy="auto",
    bucketing_strategy="block",
    activation_checkpointing=True,
    config=OverlapConfig(memory_budget_bytes=1 << 30),
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fake_group_4")]


@pytest.fixture
def find_blocks_calls(monkeypatch) -> list[str]:
    """The class of each model whose blocks were searched for, in order."""
    calls: list[str] = []
    find_blocks = _model_state.find_blocks

    def counted(module, block_types=None):
        calls.append(type(module).__name__)
        return find_blocks(module, block_types)

    monkeypatch.setattr(_model_state, "find_blocks", counted)
    return calls


def _step(jm) -> None:
    jm(torch.randint(0, 64, (2, 8))).sum().backward()


def test_fsdp_finds_the_blocks_once_and_records_the_traces_it_scheduled(find_blocks_calls):
    torch.manual_seed(0)
    jm = thunder_overlap.fsdp(TinyGPT(MODEL), **OPTIONS)
    _step(jm)
    assert find_blocks_calls == ["TinyGPT"]
    # The report's baseline is the newest trace the schedule transform did not return.
    scheduled = OverlapScheduleTransform.of(jm).state.scheduled
    for history in (thunder.last_traces(jm), thunder.last_backward_traces(jm)):
        assert [i for i, trace in enumerate(history) if trace in scheduled] == [len(history) - 1]
        assert unscheduled_trace(jm, history) is history[-2]


def test_fsdp_transforms_find_the_blocks_once(find_blocks_calls):
    torch.manual_seed(0)
    _step(thunder.jit(TinyGPT(MODEL), transforms=thunder_overlap.fsdp_transforms(**OPTIONS)))
    assert find_blocks_calls == ["TinyGPT"]


def test_transforms_share_one_state_and_hold_no_other_transform():
    transforms = thunder_overlap.fsdp_transforms(**OPTIONS)
    states = {id(t.state) for t in transforms if isinstance(getattr(t, "state", None), ModelState)}
    assert len(states) == 1
    # Every transform of this package that reads the blocks holds the state.
    holders = sorted(type(t).__name__ for t in transforms if hasattr(t, "state"))
    assert holders == ["ActivationCheckpointingTransform", "BucketingTransform", "OverlapScheduleTransform", "Zero3Transform"]
    for transform in transforms:
        held = [name for name, value in vars(transform).items() if isinstance(value, Transform)]
        assert not held, f"{type(transform).__name__} holds other transforms: {held}"


def test_each_call_makes_a_new_state():
    first, second = thunder_overlap.fsdp_transforms(**OPTIONS), thunder_overlap.fsdp_transforms(**OPTIONS)
    state_of = lambda transforms: next(t.state for t in transforms if hasattr(t, "state"))  # noqa: E731
    assert state_of(first) is not state_of(second)
