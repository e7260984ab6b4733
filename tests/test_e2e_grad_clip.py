"""Gradient clipping by the whole model's norm on 2 gloo ranks, against one process.

Three AdamW steps, each clipped (``model.clip_grad_norm_``) with a ``max_norm`` below every
step's norm, for ZeRO2 without buckets, ZeRO3 with block buckets, ZeRO3 with layer buckets and the
inf-norm, and bf16/fp32 mixed precision; TinyGPT pads its vocabulary on 2 ranks, ties its head to
its embedding and freezes its position embedding. Checked:

- float32 runs, every step against the float64 single-process reference (``parity.check_steps``
  with ``Clipping``): each rank's total norm within 1e-5 relative of
  ``torch.nn.utils.clip_grad_norm_`` on the float64 model, the clipped gradients and the AdamW
  updates within float32's rounding bounds;
- every run, mixed precision's included: each step's total norm is what
  ``torch.nn.utils.clip_grad_norm_`` returns on one process holding the ranks' gradients put
  together, the same on both ranks, and the clipped shards are the gradients it leaves.

Then, on one model: padding rows do not count, a NaN on one rank raises on both with
``error_if_nonfinite``, and clipping inside ``no_sync`` (or after it, before a backward that
reduces) is refused.
"""

from __future__ import annotations

import math

import pytest
import torch

from thunder_overlap.options import MixedPrecision
from thunder_overlap.report._builtin_models import TinyGPT, TinyGPTConfig
from thunder_overlap.testing.parity import real_rows
from thunder_overlap.testing.training import TrainSetup, check_against_reference, global_batch, train_rank

pytestmark = pytest.mark.ranks

WORLD_SIZE = 2
MODEL = TinyGPTConfig(n_layer=2)
# The 2-norms of these steps' gradients are about 2, their inf-norms about 0.3.
MAX_NORM = {2.0: 0.5, math.inf: 0.05}


def _setup(sharding: str, bucketing: str, norm_type: float = 2.0, mixed_precision: MixedPrecision | None = None) -> TrainSetup:
    return TrainSetup(
        sharding=sharding, bucketing=bucketing, model=MODEL, micro_batch=2, seq_len=16, steps=3, optimizer="adamw", lr=1e-3,
        measure_memory=False, max_norm=MAX_NORM[norm_type], norm_type=norm_type, mixed_precision=mixed_precision,
    )  # fmt: skip


RUNS = {
    "zero2-none": _setup("zero2", "none"),
    "zero3-block": _setup("zero3", "block"),
    "zero3-layer-inf": _setup("zero3", "layer", norm_type=math.inf),
    "zero3-none-bf16": _setup("zero3", "none", mixed_precision=MixedPrecision(torch.bfloat16, torch.float32)),
}
FLOAT32_RUNS = [name for name, setup in RUNS.items() if setup.mixed_precision is None]


def _loss(model, rank: int, setup: TrainSetup) -> torch.Tensor:
    idx, targets = global_batch(setup, WORLD_SIZE, 0)
    rows = slice(rank * setup.micro_batch, (rank + 1) * setup.micro_batch)
    logits = model(idx[rows])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets[rows].reshape(-1))


def _misuse(rank: int) -> dict:
    """Padding, a NaN on one rank, and no_sync, on one ZeRO3 model with block buckets."""
    import thunder_overlap

    setup = RUNS["zero3-block"]
    torch.manual_seed(0)
    model = thunder_overlap.fsdp(TinyGPT(MODEL), device="cpu", sharding_strategy="zero3", bucketing_strategy="block")
    result: dict = {}
    with model.no_sync():
        _loss(model, rank, setup).backward()
        result["inside_no_sync"] = _error_of(lambda: model.clip_grad_norm_(1.0))
    result["after_no_sync"] = _error_of(lambda: thunder_overlap.grad_norm(model))
    _loss(model, rank, setup).backward()  # reduces both micro-batches' gradients
    norm = thunder_overlap.grad_norm(model)

    # Padding rows hold anything: they are no part of the model. Rank 1's last row of the
    # embedding (101 rows on 2 ranks) is padding; give it a large gradient.
    grad = model.get_parameter("wte.weight").grad
    real = real_rows(MODEL.vocab_size, rank, WORLD_SIZE)[1]
    result["padding_rows"] = grad.shape[0] - real
    grad[real:] = 1e3
    result["norms"] = (norm.item(), thunder_overlap.grad_norm(model).item())
    result["local_norm_with_padding"] = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None]).item()

    # A NaN on rank 0 alone: both ranks raise, whichever the norm (a sum and a maximum).
    if rank == 0:
        grad[0, 0] = math.nan
    for norm_type in (2.0, math.inf):
        result[f"nonfinite {norm_type}"] = _error_of(lambda n=norm_type: model.clip_grad_norm_(1.0, n, error_if_nonfinite=True))
        result[f"total {norm_type}"] = thunder_overlap.grad_norm(model, norm_type).item()
    return result


def _error_of(call) -> str | None:
    try:
        call()
    except RuntimeError as error:
        return str(error)
    return None


def _session(rank: int, world_size: int) -> tuple[dict, dict]:
    assert world_size == WORLD_SIZE
    return {name: train_rank(rank, world_size, setup) for name, setup in RUNS.items()}, _misuse(rank)


@pytest.fixture(scope="module")
def session(local_ranks):
    per_rank = local_ranks(_session, WORLD_SIZE, (), timeout_s=900)
    runs = {name: [runs[name] for runs, _ in per_rank] for name in RUNS}
    return runs, [misuse for _, misuse in per_rank]


@pytest.mark.parametrize("name", RUNS)
def test_every_step_clips_and_every_rank_returns_the_same_norm(session, name):
    runs, _ = session
    norms = runs[name][0].grad_norms
    assert len(norms) == RUNS[name].steps
    assert all(n > RUNS[name].max_norm for n in norms), norms
    assert all(r.grad_norms == norms for r in runs[name])


@pytest.mark.parametrize("name", FLOAT32_RUNS)
def test_steps_match_the_float64_single_process_reference(session, name):
    runs, _ = session
    check = check_against_reference(RUNS[name], WORLD_SIZE, runs[name])
    # Per step and rank: the total norm against torch.nn.utils.clip_grad_norm_ on the float64 model
    # (1e-5 relative), the clipped gradient shards, the starting parameters and the AdamW updates.
    assert not check.mismatches.problems
    norms = [m for m in check.mismatches.found if "total gradient norm" in m.what]
    assert not norms, norms
    check.mismatches.assert_none()


def _put_together(shards: list[dict[str, torch.Tensor]], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The ranks' gradient shards (real rows, in rank order) as whole gradients."""
    full = {}
    for name, p in model.named_parameters():
        if name in shards[0]:
            pieces = [s[name][: real_rows(p.shape[0], rank, WORLD_SIZE)[1]] for rank, s in enumerate(shards)]
            full[name] = torch.cat(pieces)
    return full


@pytest.mark.parametrize("name", RUNS)
def test_norm_and_clipped_gradients_are_torchs_on_one_process_holding_the_same_gradients(session, name):
    runs, _ = session
    setup = RUNS[name]
    torch.manual_seed(0)
    model = TinyGPT(MODEL)
    for step in range(setup.steps):
        unclipped = _put_together([r.step_unclipped_grads[step] for r in runs[name]], model)
        for n, p in model.named_parameters():
            p.grad = unclipped.get(n)
        expected = torch.nn.utils.clip_grad_norm_(model.parameters(), setup.max_norm, setup.norm_type)
        # The same float32 values summed in another order: a few roundings of the sum apart.
        torch.testing.assert_close(torch.tensor(runs[name][0].grad_norms[step]), expected, rtol=1e-5, atol=0)
        clipped = _put_together([r.step_grads[step] for r in runs[name]], model)
        assert set(clipped) == set(unclipped) and "wpe.weight" not in clipped
        for n, g in clipped.items():
            # The coefficient from either norm: as far apart as the norms.
            torch.testing.assert_close(g, model.get_parameter(n).grad, rtol=1e-5, atol=0, msg=f"step {step + 1} {n}")


def test_padding_rows_do_not_count(session):
    _, misuse = session
    assert [m["padding_rows"] for m in misuse] == [0, 1]
    for m in misuse:
        before, after = m["norms"]
        assert before == after == misuse[0]["norms"][0]
    # Not vacuous: the padding written would have dominated a norm that counted it.
    assert misuse[1]["local_norm_with_padding"] > 100 * misuse[1]["norms"][0]


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_a_nonfinite_gradient_on_one_rank_raises_on_every_rank(session, norm_type):
    _, misuse = session
    for m in misuse:
        message = m[f"nonfinite {norm_type}"]
        assert message is not None and f"total norm of order {norm_type}" in message and "error_if_nonfinite=False" in message
        # Without the check, every rank gets the same non-finite total.
        assert not math.isfinite(m[f"total {norm_type}"])
    assert math.isnan(misuse[0]["total 2.0"]) and math.isnan(misuse[1]["total 2.0"])


def test_clipping_under_no_sync_is_refused_until_a_backward_reduces(session):
    _, misuse = session
    for m in misuse:
        assert m["inside_no_sync"] is not None and "inside no_sync()" in m["inside_no_sync"]
        assert m["after_no_sync"] is not None and "last backward ran under no_sync()" in m["after_no_sync"]
