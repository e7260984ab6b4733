"""The parity checks' float32 bounds and their power, without ranks: a two-rank run simulated in
one process (float32, the ranks' shares averaged as a reduce-scatter would) passes
``parity.check_steps``; a wrong gradient share or update is named with its tensor, rank, element,
both values and the allowed error; and the optimizer bounds hold for torch's own float32 steps."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn

from thunder_overlap.testing.float_error import OptimizerReplay, adamw_step_spread, gamma, gradient_bound, rounding_count
from thunder_overlap.testing.parity import Clipping, RankSteps, check_steps, real_rows

WORLD_SIZE, STEPS, LR = 2, 3, 1e-2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))  # 3 rows: padded on 2 ranks


def _loss_terms(model: nn.Module, step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(WORLD_SIZE, 5, 4, generator=generator).to(next(model.parameters()).dtype)
    return [model(x[rank]).square().mean() for rank in range(WORLD_SIZE)]


def _shard(full: torch.Tensor, rank: int) -> torch.Tensor:
    start, rows = real_rows(full.shape[0], rank, WORLD_SIZE)
    chunk = -(-full.shape[0] // WORLD_SIZE)
    padded = torch.zeros(chunk, *full.shape[1:], dtype=full.dtype)
    padded[:rows] = full[start : start + rows]
    return padded


def _simulated_run(optimizer: str = "adamw", clip: Clipping | None = None) -> tuple[nn.Module, list[RankSteps]]:
    """float32, one process: each step averages the two ranks' gradients, as the reduce-scatter does,
    and clips them by their norm with ``clip``."""
    model = _model()
    initial = copy.deepcopy(model)
    params = dict(model.named_parameters())
    opt = torch.optim.AdamW(params.values(), lr=LR) if optimizer == "adamw" else torch.optim.SGD(params.values(), lr=LR)
    ranks = [RankSteps(rank, [], []) for rank in range(WORLD_SIZE)]
    for step in range(STEPS):
        for r in ranks:
            r.params.append({name: _shard(p.detach(), r.rank) for name, p in params.items()})
        shares = [torch.autograd.grad(term, list(params.values())) for term in _loss_terms(model, step)]
        for p, *rank_grads in zip(params.values(), *shares, strict=True):
            p.grad = sum(g / WORLD_SIZE for g in rank_grads)
        if clip is not None:
            total = torch.nn.utils.clip_grad_norm_(params.values(), clip.max_norm, clip.norm_type)
            for r in ranks:
                r.grad_norms.append(total.item())
        for r in ranks:
            r.grads.append({name: _shard(p.grad, r.rank) for name, p in params.items()})
        opt.step()
    for r in ranks:
        r.params.append({name: _shard(p.detach(), r.rank) for name, p in params.items()})
    return initial, ranks


def _check(initial: nn.Module, ranks: list[RankSteps], optimizer: str = "adamw", shards: int | None = None, clip: Clipping | None = None):
    roundings = rounding_count(initial.parameters(), tokens=5, seq_len=1, world_size=WORLD_SIZE)
    return check_steps(ranks, initial, _loss_terms, lambda: OptimizerReplay(optimizer, LR), roundings, shards=shards, clip=clip)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_a_float32_run_passes_every_check(optimizer):
    initial, ranks = _simulated_run(optimizer)
    check = _check(initial, ranks, optimizer)
    check.mismatches.assert_none()
    # Every real element (the ranks' shards together are the model) at every step, three times:
    # the starting parameters, the gradients and the updates.
    assert check.mismatches.compared == 3 * STEPS * sum(p.numel() for p in initial.parameters())
    assert len(check.losses) == STEPS


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_a_clipped_run_passes_and_one_clipped_by_each_ranks_own_norm_is_caught(norm_type):
    clip = Clipping(max_norm=0.05, norm_type=norm_type)
    initial, ranks = _simulated_run(clip=clip)
    assert all(n > clip.max_norm for n in ranks[0].grad_norms)  # every step clipped
    _check(initial, ranks, clip=clip).mismatches.assert_none()
    # Each rank's norm of its own shards instead, and its gradients scaled by what that gives.
    for r in ranks:
        for step, grads in enumerate(r.grads):
            unclipped = {name: g / clip.coefficient(r.grad_norms[step]) for name, g in grads.items()}
            local = torch.nn.utils.get_total_norm(list(unclipped.values()), norm_type).item()
            r.grad_norms[step] = local
            r.grads[step] = {name: g * clip.coefficient(local) for name, g in unclipped.items()}
    caught = {(m.what, m.rank) for m in _check(initial, ranks, clip=clip).mismatches.found if "norm" in m.what}
    if norm_type == 2.0:
        assert caught == {(f"step {step} total gradient norm", rank) for step in (1, 2, 3) for rank in (0, 1)}
    else:  # the rank whose shard holds the largest element has the right maximum
        assert {what for what, _ in caught} == {f"step {step} total gradient norm" for step in (1, 2, 3)}


def test_a_wrong_gradient_share_is_named_with_rank_element_values_and_allowance():
    initial, ranks = _simulated_run()
    ranks[1].grads[1]["0.weight"] = ranks[1].grads[1]["0.weight"] * 1.001  # a 0.1% error on rank 1, step 2
    check = _check(initial, ranks)
    with pytest.raises(AssertionError) as raised:
        check.mismatches.assert_none()
    message = str(raised.value)
    assert "step 2 gradient 0.weight on rank 1 at [" in message and "allowed" in message, message
    # Every element off is listed (3 rows of 4 on rank 1), none of the other tensors or ranks.
    gradient = [m for m in check.mismatches.found if m.what.startswith("step 2 gradient")]
    assert {(m.what, m.rank) for m in gradient} == {("step 2 gradient 0.weight", 1)} and len(gradient) == 12
    first = gradient[0]
    assert str(first).startswith(f"step 2 gradient 0.weight on rank 1 at {list(first.index)}: {first.actual!r} against {first.expected!r}")


def test_an_update_off_by_more_than_rounding_is_caught():
    initial, ranks = _simulated_run()
    ranks[0].params[2]["2.bias"] = ranks[0].params[2]["2.bias"] + 1e-5  # after step 2, rank 0
    check = _check(initial, ranks)
    assert {m.what for m in check.mismatches.found} >= {"step 2 parameter 2.bias after the optimizer"}
    assert {m.rank for m in check.mismatches.found if "after the optimizer" in m.what} == {0}


def test_replicas_holding_other_values_are_caught():
    initial, ranks = _simulated_run()
    # A third rank holding rank 0's shards, as its replica (hybrid sharding: ranks 0 and 1 form
    # the shard group), whose parameters after step 1 are one float32 ulp off.
    replica = copy.deepcopy(ranks[0])
    replica.rank = 2
    replica.params[1]["0.bias"] = torch.nextafter(replica.params[1]["0.bias"], torch.tensor(1.0))
    check = _check(initial, [*ranks, replica], shards=2)
    held = [m for m in check.mismatches.found if "starting parameter" in m.what]
    assert {(m.what, m.rank) for m in held} == {("step 2 starting parameter 0.bias", 2)} and all(m.allowed == 0 for m in held)


def test_the_replay_bounds_torchs_float32_adamw_and_sgd_steps():
    generator = torch.Generator().manual_seed(1)
    # Gradients from 1e-12 (where AdamW's eps dominates) to 1, of either sign.
    p32 = torch.randn(4096, generator=generator)
    grads = [torch.randn(4096, generator=generator) * 10.0 ** -torch.randint(0, 13, (4096,), generator=generator) for _ in range(5)]
    for optimizer in ("adamw", "sgd"):
        p = nn.Parameter(p32.clone())
        opt = torch.optim.AdamW([p], lr=LR) if optimizer == "adamw" else torch.optim.SGD([p], lr=LR)
        replay = OptimizerReplay(optimizer, LR)
        worst = 0.0
        for g in grads:
            before = p.detach().clone()
            p.grad = g.clone()
            opt.step()
            (expected, allowed), = replay.step({"p": before}, {"p": g}).values()
            assert torch.all((p.detach().double() - expected).abs() <= allowed), optimizer
            worst = max(worst, (allowed / (before.double().abs() + LR)).max().item())
        # Not vacuous: a few dozen roundings of the parameter or of the step, at most.
        assert worst < 100 * gamma(1), (optimizer, worst)


def test_adamw_step_spread_bounds_an_exact_step_with_a_perturbed_gradient():
    generator = torch.Generator().manual_seed(2)
    n = 100_000
    scale = 10.0 ** -torch.randint(0, 12, (n,), generator=generator).double()
    grad, first = (torch.randn(n, generator=generator, dtype=torch.float64) * scale for _ in range(2))
    exp_avg, exp_avg_sq = 0.1 * first, 0.001 * first * first  # the moments after a first step
    error = 1e-9
    perturbed = grad + (torch.rand(n, generator=generator, dtype=torch.float64) * 2 - 1) * error

    def update(g: torch.Tensor) -> torch.Tensor:
        m, v = 0.9 * exp_avg + 0.1 * g, 0.999 * exp_avg_sq + 0.001 * g * g
        return LR / (1 - 0.9**2) * m / ((v / (1 - 0.999**2)).sqrt() + 1e-8)

    spread = adamw_step_spread(error, grad, exp_avg, exp_avg_sq, 2, lr=LR)
    assert torch.all((update(perturbed) - update(grad)).abs() <= spread)
    # Where the gradients dwarf the error, the allowed change is a sliver of the update's lr.
    large = (grad.abs() > 1e3 * error) & (first.abs() > 1e3 * error)
    assert large.sum() > n / 4 and (spread[large] <= 1e-2 * LR).all()


def test_gradient_bound_scales_with_the_shares_magnitude_and_the_roundings():
    shares = [torch.tensor([1.0, -3.0], dtype=torch.float64), torch.tensor([-1.0, 1.0], dtype=torch.float64)]
    # Mean absolute share per element: [1, 2]; the largest, 2, times gamma.
    assert gradient_bound(shares, 100) == pytest.approx(2 * gamma(100))
    assert rounding_count([torch.zeros(3, 4), torch.zeros(5)], tokens=7, seq_len=2, world_size=2) == 7 + 2 + 1 + (3 + 4 + 2) + 5
