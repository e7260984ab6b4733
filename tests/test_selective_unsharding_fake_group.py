"""Sharding "auto" on a real model (traced on the fake process group, run on CPU): the blocks it
keeps unsharded to the backward are those a budget has room for, the backward needs first. A budget
above ZeRO2's peak is ZeRO2's schedule, one between ZeRO3's and ZeRO2's keeps some blocks and
holds, and so does one below ZeRO3's where keeping the blocks needed first spares enough; one
below every choice's is an error. tests/test_e2e_selective_unsharding.py trains with it on two
gloo ranks."""

from __future__ import annotations

import pytest
import thunder
import torch

import thunder_overlap
from thunder_overlap import OverlapConfig, OverlapScheduleTransform
from thunder_overlap._scheduling.unsharding import MemoryBudgetTooSmall
from thunder_overlap._transforms.zero3 import Zero3Transform
from thunder_overlap.report._builtin_models import TinyGPT, TinyGPTConfig
from thunder_overlap.report._schedule_view import schedule_stats
from thunder_overlap.testing.memory_check import measure_step
from thunder_overlap.testing.training import collective_sequence

pytestmark = pytest.mark.slow

# Three blocks: a budget halfway between ZeRO3's and ZeRO2's peaks still keeps some and re-gathers
# others, and every block more is seconds of each compile here.
MODEL = TinyGPTConfig(n_layer=3, n_embd=64)
BLOCKS = [f"blocks.{i}" for i in range(MODEL.n_layer)]


def _step(sharding: str, budget: int | None = None, **options):
    torch.manual_seed(0)
    config = OverlapConfig(memory_budget_bytes=budget) if budget is not None else None
    jm = thunder_overlap.fsdp(TinyGPT(MODEL), device="cpu", sharding_strategy=sharding, config=config, **options)
    jm(torch.randint(0, MODEL.vocab_size, (2, 32))).sum().backward()
    return jm


def _collectives(jm) -> tuple[list[str], list[str]]:
    return collective_sequence(thunder.last_traces(jm)[-1]), collective_sequence(thunder.last_backward_traces(jm)[-1])


def _backward_all_gathers(jm) -> int:
    return schedule_stats(thunder.last_backward_traces(jm)[-1]).allgathers


@pytest.fixture(scope="module")
def everything_fits(fake_group_2):
    """Sharding "auto" under a budget no step reaches: every unit kept."""
    return _step("auto", 1 << 40)


@pytest.fixture(scope="module")
def between(everything_fits):
    """Sharding "auto" under a budget halfway between ZeRO3's and ZeRO2's peaks, after one step:
    (the budget, the model, then its choice, final traces and schedule summaries as that step left
    them). Compiled once for the two tests that need it: one reads these, the other steps the model
    again at another shape."""
    fits = Zero3Transform.of(everything_fits).choice
    budget = (fits.zero3_peak_bytes + fits.zero2_peak_bytes) // 2
    jm = _step("auto", budget)
    traces = (thunder.last_traces(jm)[-1], thunder.last_backward_traces(jm)[-1])
    return budget, jm, Zero3Transform.of(jm).choice, traces, OverlapScheduleTransform.of(jm).summaries


def test_a_budget_above_zero2s_peak_is_zero2s_schedule(everything_fits):
    choice = Zero3Transform.of(everything_fits).choice
    assert choice.kept == choice.candidates
    assert choice.peak_bytes == choice.zero2_peak_bytes > choice.zero3_peak_bytes
    # The backward needs the tied embedding first (the output head's gradient), then norm_f's
    # weight, then the blocks last to first; parameters outside blocks are units of their own.
    assert choice.candidates == ("wte.weight", "norm_f.weight", *BLOCKS[::-1])
    assert _collectives(everything_fits) == _collectives(_step("zero2"))


def test_a_budget_between_keeps_the_blocks_needed_first_and_holds(between):
    budget, _, choice, (forward, backward), schedule = between
    assert 0 < len(choice.kept) < len(choice.candidates)
    assert choice.kept == choice.candidates[: len(choice.kept)]
    assert choice.zero3_peak_bytes < choice.peak_bytes <= budget
    assert choice.regather_bytes_saved > 0
    # The backward re-gathers fewer than ZeRO3, more than ZeRO2 (none).
    assert 0 < schedule_stats(backward).allgathers < _backward_all_gathers(_step("zero3"))
    # The scheduler prefetched within the same budget, and the traces run within it.
    for summary in (schedule.forward, schedule.backward):
        assert summary.peak_bytes <= summary.budget_bytes <= budget
    measured = measure_step(forward, backward)
    assert max(m.peak_bytes for m in measured) <= budget * 1.05


def test_a_budget_at_zero3s_peak_is_held(everything_fits):
    # A kept unit holds its gathered parameters besides the shard the module keeps, so no choice
    # needs less than ZeRO3 just in time: the budget that ZeRO3 fits is held, measured too.
    fits = Zero3Transform.of(everything_fits).choice
    budget = fits.zero3_peak_bytes
    jm = _step("auto", budget)
    choice = Zero3Transform.of(jm).choice
    assert choice.peak_bytes <= budget < choice.zero2_peak_bytes
    measured = measure_step(thunder.last_traces(jm)[-1], thunder.last_backward_traces(jm)[-1])
    assert max(m.peak_bytes for m in measured) <= budget * 1.05


def test_a_budget_below_every_choices_peak_is_an_error_naming_zero3s_and_the_least(everything_fits):
    zero3 = Zero3Transform.of(everything_fits).choice.zero3_peak_bytes
    units = len(BLOCKS) + 2  # the blocks, the tied embedding and norm_f
    says = (
        rf"memory_budget_bytes=4096 .* below the predicted peak of ZeRO3 itself, {zero3} B .* the least, keeping \d+ of {units} units, is"
    )
    with pytest.raises(MemoryBudgetTooSmall, match=says):
        _step("auto", 4096)


def test_a_batch_of_another_shape_keeps_the_first_compiles_choice(fake_group_2, between):
    _, jm, choice, (_, backward), _ = between
    zero3, regathers = Zero3Transform.of(jm), schedule_stats(backward).allgathers
    # A longer sequence needs more memory: a choice made now would keep fewer blocks, and this
    # rank's collectives would no longer pair with its peers' ([Note: selective unsharding]).
    jm(torch.randint(0, MODEL.vocab_size, (4, 32))).sum().backward()
    assert len(thunder.last_backward_traces(jm)) > 0 and zero3.choice is choice
    assert _backward_all_gathers(jm) == regathers


def test_mixed_precision_keeps_blocks_by_their_gathered_bf16_bytes(fake_group_2, everything_fits):
    policy = thunder_overlap.MixedPrecision(param_dtype=torch.bfloat16)
    fits = Zero3Transform.of(_step("auto", 1 << 40, mixed_precision=policy)).choice
    full = Zero3Transform.of(everything_fits).choice
    # Each unit gathers in bf16: half the bytes float32 gathers, so half the re-gathers saved.
    assert fits.regather_bytes_saved * 2 == full.regather_bytes_saved
    budget = (fits.zero3_peak_bytes + fits.zero2_peak_bytes) // 2
    jm = _step("auto", budget, mixed_precision=policy)
    choice = Zero3Transform.of(jm).choice
    assert 0 < len(choice.kept) < len(choice.candidates) and choice.peak_bytes <= budget
    schedule = OverlapScheduleTransform.of(jm).summaries
    assert max(schedule.forward.peak_bytes, schedule.backward.peak_bytes) <= budget


def test_zero3_under_a_budget_below_its_just_in_time_peak_says_so(fake_group_2):
    says = r"the forward needs \d+ B even with every collective just in time, over .*memory_budget_bytes=4096"
    with pytest.warns(UserWarning, match=says):
        _step("zero3", 4096)
