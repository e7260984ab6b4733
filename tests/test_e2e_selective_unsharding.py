"""Sharding "auto" on two gloo ranks, 3 blocks: with a budget halfway between ZeRO3's and ZeRO2's
predicted peaks, the backward re-gathers some blocks and not others, the step's measured peak stays
within the budget, and training matches the float64 single-process reference step by step. Ranks
whose first batches differ in shape keep what both have room for."""

from __future__ import annotations

from dataclasses import replace

import pytest

from thunder_overlap import OverlapConfig, Zero3Transform
from thunder_overlap.report._builtin_models import TinyGPT, TinyGPTConfig
from thunder_overlap.testing.training import TrainSetup, check_against_reference, train_rank

pytestmark = pytest.mark.ranks

# Three blocks: compiling dominates this module's time, in proportion to the blocks, and three
# leave a budget halfway between ZeRO3's and ZeRO2's peaks room for some blocks and not others,
# and ranks at 8 and 16 tokens room for different blocks.
MODEL = TinyGPTConfig(n_layer=3, n_embd=64)


def _measured_step_peak(rank) -> int:
    """The step's peak in the budget's units: what it allocated plus the inputs it held."""
    return rank.peak_step_bytes + rank.held_inputs_bytes


def _auto_between_zero3_and_zero2(rank: int, world_size: int):
    """Sharding "auto" trained under a budget halfway between the ZeRO3 and ZeRO2 peaks it
    predicts for this model and batch (priced by a probe whose budget everything fits, traced
    but not run): the setup, this rank's result and the probe's choice."""
    import thunder
    import torch

    import thunder_overlap
    from thunder_overlap.testing.training import global_batch

    # Block buckets: a kept block's bucket buffer stays out of the pool until its backward
    # (unbucketed runs are checked on the fake group, tests/test_selective_unsharding_fake_group.py).
    setup = TrainSetup(sharding="auto", bucketing="block", model=MODEL, steps=2)
    everything_fits = OverlapConfig(memory_budget_bytes=1 << 40)
    torch.manual_seed(0)  # the ranks' initial weights must agree
    probe = thunder_overlap.fsdp(TinyGPT(MODEL), device="cpu", sharding_strategy="auto", bucketing_strategy="block", config=everything_fits)
    idx, _ = global_batch(setup, world_size, 0)
    thunder.compile_data(probe).get_computation_and_inputs(idx[rank * setup.micro_batch : (rank + 1) * setup.micro_batch])
    fits = Zero3Transform.of(probe).choice
    setup = replace(setup, config=OverlapConfig(memory_budget_bytes=(fits.zero3_peak_bytes + fits.zero2_peak_bytes) // 2))
    return setup, train_rank(rank, world_size, setup), fits


def test_a_budget_between_zero3_and_zero2_is_kept_and_trains_like_the_reference(local_ranks):
    runs = local_ranks(_auto_between_zero3_and_zero2, 2)
    setup, fits = runs[0][0], runs[0][2]
    ranks = [result for _, result, _ in runs]
    budget = setup.config.memory_budget_bytes
    assert fits.kept == fits.candidates  # the probe's budget held every block
    # Some blocks kept gathered from the forward (ZeRO3 keeps none), others re-gathered in the
    # backward (ZeRO2 re-gathers none).
    assert ranks[0].saved_unsharded and ranks[0].backward_stats.allgathers > 0
    for rank in ranks:
        assert _measured_step_peak(rank) <= budget * 1.05, (rank.rank, _measured_step_peak(rank), budget)
        assert rank.collectives == ranks[0].collectives  # one choice on both ranks
    check = check_against_reference(setup, 2, ranks)
    check.assert_mean_losses([r.losses for r in ranks])
    check.mismatches.assert_none()


SMALL = TinyGPTConfig(n_layer=3, n_embd=64)


def _small(budget: int):
    import torch

    import thunder_overlap

    torch.manual_seed(0)
    config = OverlapConfig(memory_budget_bytes=budget)
    return thunder_overlap.fsdp(TinyGPT(SMALL), device="cpu", sharding_strategy="auto", config=config)


def _step(jm, seq_len: int) -> None:
    import torch

    jm(torch.randint(0, SMALL.vocab_size, (2, seq_len), generator=torch.Generator().manual_seed(seq_len))).sum().backward()


def _priced_at_8_tokens():
    """What sharding "auto" predicts at 8 tokens, every block kept (the same on both ranks)."""
    probe = _small(1 << 40)
    _step(probe, 8)
    return Zero3Transform.of(probe).choice


def _ranks_with_other_first_shapes(rank: int, priced) -> tuple[tuple[str, ...], tuple[str, ...] | None, list[str]]:
    """Both ranks take ZeRO2's peak at 8 tokens as their budget; then rank 0 starts at 8 tokens
    (room for every block) and rank 1 at 16 (room for fewer), and each then retraces alone for
    the other's shape. Returns the kept units, what this rank would have kept alone, and the last
    backward's collectives in issue order."""
    import thunder

    from thunder_overlap.testing.training import collective_sequence

    jm = _small(priced.zero2_peak_bytes)
    for seq_len in (8, 16) if rank == 0 else (16, 8):
        _step(jm, seq_len)
    choice = Zero3Transform.of(jm).choice
    # The collectives in issue order (waits may sit elsewhere: compute follows each rank's shapes).
    issued = [entry for entry in collective_sequence(thunder.last_backward_traces(jm)[-1]) if "wait" not in entry.split("(")[0]]
    return choice.kept, choice.kept_alone, issued


def _ranks_at_other_first_shapes(rank: int, world_size: int) -> dict:
    """Both runs below on this rank, priced by one probe (compiling dominates their time)."""
    priced = _priced_at_8_tokens()
    return {"other first shapes": _ranks_with_other_first_shapes(rank, priced), "without room": _one_rank_without_room(rank, priced)}


@pytest.fixture(scope="module")
def first_shapes(local_ranks) -> list[dict]:
    return local_ranks(_ranks_at_other_first_shapes, 2, ())


def test_ranks_whose_first_batches_differ_keep_what_both_have_room_for(first_shapes):
    (kept_0, alone_0, backward_0), (kept_1, alone_1, backward_1) = (ranks["other first shapes"] for ranks in first_shapes)
    own_0, own_1 = alone_0 or kept_0, alone_1 or kept_1
    # Alone, the ranks would choose differently (the precondition: else this test checks nothing).
    assert own_0 != own_1, (own_0, own_1)
    # Both keep what both chose, the other's shape retraced with it.
    common = own_0[: len(own_1)] if own_0[: len(own_1)] == own_1 else own_1[: len(own_0)]
    assert common in (own_0, own_1) and len(common) > 0, (own_0, own_1)
    assert kept_0 == kept_1 == common
    assert backward_0 == backward_1


def _one_rank_without_room(rank: int, priced) -> str | None:
    """ZeRO3's peak at 8 tokens as the budget: rank 1's first batch has 16, more than fits."""
    from thunder_overlap import MemoryBudgetTooSmall

    jm = _small(priced.zero3_peak_bytes)
    try:
        _step(jm, 8 if rank == 0 else 16)
    except MemoryBudgetTooSmall as e:
        return str(e)
    return None


def test_a_rank_without_room_for_zero3_stops_every_rank(first_shapes):
    says_0, says_1 = (ranks["without room"] for ranks in first_shapes)
    assert says_1 is not None and "is below the predicted peak of ZeRO3 itself" in says_1
    # Rank 0 had room, and stops rather than wait for rank 1 at its next collective.
    assert says_0 is not None and "ranks [1] have no room for ZeRO3 itself" in says_0
