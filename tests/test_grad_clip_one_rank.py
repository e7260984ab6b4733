"""Gradient clipping on one gloo rank: torch.nn.utils.clip_grad_norm_'s results where the shard is
the whole parameter, the norm's dtype, the method on every way of sharding, and a clear error for
every misuse (the 2-rank behaviour is tests/test_e2e_grad_clip.py)."""

from __future__ import annotations

import copy
import math

import pytest
import thunder
import torch
import torch.nn as nn
from thunder.core.module import ThunderModule
from thunder.recipes import BaseRecipe

import thunder_overlap

# The model is too small to have blocks; prefetching's warning about it is beside the point here.
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:thunder_overlap. the blocks found:UserWarning")]


def _model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


def _backward(model: nn.Module, dtype: torch.dtype = torch.float32) -> None:
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1)).to(dtype)
    model(x).square().sum().backward()


@pytest.fixture(scope="module")
def compiled(one_rank_gloo_group) -> tuple[ThunderModule, nn.Module, list[torch.Tensor]]:
    plain = _model()
    model = thunder_overlap.fsdp(copy.deepcopy(plain), device="cpu")
    _backward(model)
    _backward(plain)
    return model, plain, _grads(model)


@pytest.fixture
def sharded(compiled) -> tuple[ThunderModule, nn.Module]:
    """A sharded model after one backward, and a plain copy with the same gradients (again for
    each test: clipping scales them)."""
    model, plain, grads = compiled
    for m in (model, plain):
        for p, g in zip(m.parameters(), grads, strict=True):
            p.grad = g.clone()
    return model, plain


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, math.inf, "inf"])
@pytest.mark.parametrize("foreach", [None, False, True])
def test_on_one_rank_it_is_torchs_clip_grad_norm(sharded, norm_type, foreach):
    ours, theirs = sharded
    assert [g.shape for g in _grads(ours)] == [g.shape for g in _grads(theirs)]  # one rank: no padding
    expected = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.1, norm_type, foreach=foreach)
    total = ours.clip_grad_norm_(0.1, norm_type, foreach=foreach)
    assert total.dtype == torch.float32 and total.shape == ()
    # The same elements in another grouping: a few float32 roundings of the norm apart.
    torch.testing.assert_close(total, expected, rtol=1e-6, atol=0)
    assert total > 0.1  # it clipped
    for g, h in zip(_grads(ours), _grads(theirs), strict=True):
        torch.testing.assert_close(g, h, rtol=1e-6, atol=0)
    torch.testing.assert_close(thunder_overlap.grad_norm(ours, norm_type), torch.tensor(0.1), rtol=1e-5, atol=0)


def test_a_norm_below_max_norm_leaves_the_gradients_as_they_are(sharded):
    model, _ = sharded
    before = _grads(model)
    total = thunder_overlap.clip_grad_norm_(model, 1e6)
    assert total == thunder_overlap.grad_norm(model)
    assert all(torch.equal(g, h) for g, h in zip(_grads(model), before, strict=True))


@pytest.mark.parametrize(("dtype", "norm_dtype"), [(torch.bfloat16, torch.float32), (torch.float64, torch.float64)])
def test_the_norm_accumulates_in_float32_or_float64_whatever_the_gradients_dtype(one_rank_gloo_group, dtype, norm_dtype):
    model = thunder_overlap.fsdp(_model(dtype), device="cpu")
    _backward(model, dtype)
    grads = _grads(model)
    total = thunder_overlap.grad_norm(model)
    assert total.dtype == norm_dtype
    expected = torch.linalg.vector_norm(torch.cat([g.to(norm_dtype).flatten() for g in grads]))
    torch.testing.assert_close(total, expected, rtol=1e-6, atol=0)


def test_the_method_comes_with_every_way_of_sharding(one_rank_gloo_group):
    # Given when the module is made (no trace yet), bound to it.
    jitted = thunder.jit(_model(), transforms=thunder_overlap.fsdp_transforms(device="cpu"))
    # Without nvFuser, Thunder's default recipe has no fuser: name one.
    compiled = thunder.compile(_model(), recipe=BaseRecipe(fuser="torch.compile"), plugins=[thunder_overlap.FSDPOverlap(device="cpu")])
    for model in (jitted, compiled, thunder_overlap.fsdp(_model(), device="cpu")):
        assert model.clip_grad_norm_.__self__ is model and model.clip_grad_norm_.__func__ is thunder_overlap.clip_grad_norm_


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"max_norm": -1.0}, ValueError, r"^max_norm must be a number >= 0, got -1\.0$"),
        ({"max_norm": math.nan}, ValueError, r"^max_norm must be a number >= 0, got nan$"),
        ({"max_norm": "1"}, ValueError, r"^max_norm must be a number >= 0, got '1'$"),
        ({"max_norm": True}, ValueError, r"^max_norm must be a number >= 0, got True$"),
        ({"norm_type": 0}, ValueError, r"^norm_type must be a positive number \(a p-norm's p\) or inf .*, got 0$"),
        ({"norm_type": -math.inf}, ValueError, r"^norm_type must be .*, got -inf$"),
        ({"norm_type": "fro"}, ValueError, r"^norm_type must be .*, got 'fro'$"),
        ({"norm_type": None}, ValueError, r"^norm_type must be .*, got None$"),
        ({"foreach": 1}, TypeError, r"^foreach must be None, True or False, got 1$"),
        ({"error_if_nonfinite": "yes"}, TypeError, r"^error_if_nonfinite must be True or False, got 'yes'$"),
    ],
)
def test_bad_arguments_are_named(sharded, kwargs, error, message):
    model, _ = sharded
    before = _grads(model)
    with pytest.raises(error, match=message):
        thunder_overlap.clip_grad_norm_(model, **{"max_norm": 1.0, **kwargs})
    assert all(torch.equal(g, h) for g, h in zip(_grads(model), before, strict=True))


def test_before_any_backward_is_an_error_saying_when_to_call_it(one_rank_gloo_group):
    model = thunder_overlap.fsdp(_model(), device="cpu")
    when = r"no parameter has a gradient; call it after loss\.backward\(\) and before optimizer\.zero_grad\(\)"
    with pytest.raises(RuntimeError, match=when):
        model.clip_grad_norm_(1.0)
    with pytest.raises(RuntimeError, match=r"thunder_overlap\.grad_norm: no parameter has a gradient"):
        thunder_overlap.grad_norm(model)


def test_models_that_are_not_thunder_overlaps_are_refused_naming_what_to_use(one_rank_gloo_group):
    with pytest.raises(TypeError, match=r"takes a model that thunder_overlap\.fsdp returned, got a Sequential; .*"
                       r"torch\.nn\.utils\.clip_grad_norm_\(model\.parameters\(\), \.\.\.\) is right"):  # fmt: skip
        thunder_overlap.clip_grad_norm_(_model(), 1.0)
    with pytest.raises(TypeError, match=r"this ThunderModule is sharded by no FSDP \(thunder\.jit alone\)"):
        thunder_overlap.clip_grad_norm_(thunder.jit(_model()), 1.0)
    stock = thunder.distributed.fsdp(thunder.jit(_model()), device=torch.device("cpu"))
    stock_message = r"sharded by Thunder's own FSDP \(thunder\.distributed\.fsdp\)\. Shard it with thunder_overlap\.fsdp"
    with pytest.raises(TypeError, match=stock_message):
        thunder_overlap.grad_norm(stock)


@pytest.mark.parametrize("foreach", [None, False])
def test_clip_grad_value_is_torchs_on_the_shards(sharded, foreach):
    model, plain = sharded
    thunder_overlap.clip_grad_value_(model, 0.05, foreach=foreach)
    before = [p.grad.clone() for p in plain.parameters()]
    torch.nn.utils.clip_grad_value_(plain.parameters(), 0.05)
    assert any(not torch.equal(g, p.grad) for g, p in zip(before, plain.parameters(), strict=True))  # some were clamped
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


def test_clip_grad_value_names_bad_arguments_and_other_models(sharded):
    model, _ = sharded
    with pytest.raises(ValueError, match=r"^clip_value must be a number >= 0, got -1$"):
        thunder_overlap.clip_grad_value_(model, -1)
    with pytest.raises(TypeError, match=r"^foreach must be None, True or False, got 'no'$"):
        thunder_overlap.clip_grad_value_(model, 1.0, foreach="no")
    with pytest.raises(TypeError, match=r"torch\.nn\.utils\.clip_grad_value_\(model\.parameters\(\), \.\.\.\) is right"):
        thunder_overlap.clip_grad_value_(_model(), 1.0)
