"""Two gloo ranks train with thunder_overlap; checked step by step against a float64 single-process
reference (thunder_overlap.testing.parity: tolerances from float32's rounding).

The model needs padding (vocabulary 101 on 2 ranks), ties its head to its embedding and has a
frozen parameter. One run per sharding strategy is shared by every test of this module.
"""

from __future__ import annotations

import pytest
import torch

from thunder_overlap._analysis.blocks import largest_block_bytes
from thunder_overlap.report._builtin_models import TinyGPT, TinyGPTConfig
from thunder_overlap.testing.training import TrainSetup, check_against_reference, shard_of, train_rank

pytestmark = pytest.mark.ranks

WORLD_SIZE = 2
MODEL = TinyGPTConfig(n_layer=2)
STRATEGIES = ("zero2", "zero3")


@pytest.fixture(scope="module")
def runs(local_ranks):
    results = {}
    for sharding in STRATEGIES:
        setup = TrainSetup(sharding=sharding, model=MODEL, steps=3)
        ranks = local_ranks(train_rank, WORLD_SIZE, (setup,))
        results[sharding] = (setup, ranks, check_against_reference(setup, WORLD_SIZE, ranks))
    return results


@pytest.mark.parametrize("sharding", STRATEGIES)
def test_losses_match_single_process_reference(runs, sharding):
    _, ranks, check = runs[sharding]
    # Each rank's loss is the mean over its half of the batch; their mean is the global loss.
    check.assert_mean_losses([r.losses for r in ranks])


@pytest.mark.parametrize("sharding", STRATEGIES)
def test_parameters_match_single_process_reference(runs, sharding):
    setup, ranks, check = runs[sharding]
    torch.manual_seed(setup.seed)
    initial = dict(TinyGPT(MODEL).named_parameters())
    # named_parameters() lists a tied weight once, under its first name.
    expected_names = set(initial)
    for r in ranks:
        assert set(r.shards) == expected_names
    moved = set()
    for r in ranks:
        for name, p in initial.items():
            before, rows = shard_of(p, r.rank, WORLD_SIZE)
            if not torch.allclose(r.shards[name][:rows], before, atol=1e-4):
                moved.add(name)
    assert moved == {n for n, p in initial.items() if p.requires_grad}, "some trainable parameter did not train, or a frozen one did"
    # Every step, rank, parameter and element: gradients, starting parameters, optimizer updates.
    check.mismatches.assert_none()


def test_frozen_parameter_is_not_updated(runs):
    setup, ranks, _ = runs["zero3"]
    torch.manual_seed(setup.seed)
    initial = TinyGPT(setup.model).wpe.weight.detach()
    for r in ranks:
        expected, rows = shard_of(initial, r.rank, WORLD_SIZE)
        assert torch.equal(r.shards["wpe.weight"][:rows], expected)


@pytest.mark.parametrize("sharding", STRATEGIES)
def test_every_rank_issues_the_same_collectives_in_the_same_order(runs, sharding):
    _, ranks, _ = runs[sharding]
    assert len(ranks[0].collectives) > 0
    assert all(r.collectives == ranks[0].collectives for r in ranks)


@pytest.mark.parametrize("sharding", STRATEGIES)
def test_parameters_issued_together_go_out_as_one_coalesced_launch(runs, sharding):
    # The forward issues the first parameters' all-gathers back to back; over gloo on a CPU
    # latency dominates such small collectives, so the cost model coalesces them. The numerics
    # tests above ran with these launches.
    _, ranks, _ = runs[sharding]
    names = [c.split("(")[0] for c in ranks[0].collectives]
    launches = ranks[0].forward_stats.coalesced_launches + ranks[0].backward_stats.coalesced_launches
    assert ranks[0].forward_stats.coalesced_launches >= 1
    assert names.count("coalesced_all_gather") >= 1
    assert names.count("coalesced_wait") == launches


def test_zero3_saves_sharded_parameters_for_backward_but_those_it_keeps(runs):
    zero2 = runs["zero2"][1][0]
    zero3 = runs["zero3"][1][0]
    assert zero2.saved_unsharded, "ZeRO2 keeps unsharded parameters for backward"
    # ZeRO3 keeps what its backward needs first, where that is free ([Note: ZeRO3 keeps what is
    # free]): here the tied embedding (the head) and the final norm, no block.
    assert zero3.kept_parameters == ["norm_f.weight", "wte.weight"]
    assert len(zero3.saved_unsharded) == len(zero3.kept_parameters)  # the head's unpadded view, the norm's weight


def test_zero3_regathers_in_backward_and_zero2_does_not(runs):
    assert runs["zero2"][1][0].backward_stats.allgathers == 0
    zero3 = runs["zero3"][1][0]
    # Every matmul weight of every block is needed by its input-gradient matmul: 4 per block.
    assert zero3.backward_stats.allgathers >= 4 * MODEL.n_layer
    # Every one hidden: the head weight, which the backward's first matmul needs at once, is kept
    # from the forward, and each block's re-gather goes out behind the compute before it.
    assert zero3.backward_stats.allgathers_overlapped == zero3.backward_stats.allgathers


@pytest.mark.parametrize("sharding", STRATEGIES)
def test_collectives_overlap_compute(runs, sharding):
    result = runs[sharding][1][0]
    assert result.forward_stats.allgather_overlap_fraction >= 0.9
    assert result.backward_stats.reduce_scatters > 0
    assert result.backward_stats.reduce_scatter_overlap_fraction >= 0.8
    # Reduce-scatters are interleaved with matmuls, not all issued after the last one.
    picture = [token.split("x")[0] for token in result.backward_picture.split()]  # "RSx3" -> "RS"
    last_matmul = max(i for i, token in enumerate(picture) if token == "mm")
    assert picture.index("RS") < last_matmul


@pytest.mark.parametrize("sharding", STRATEGIES)
def test_allgather_bytes_in_flight_stay_within_two_blocks(runs, sharding):
    result = runs[sharding][1][0]
    block_bytes = largest_block_bytes(TinyGPT(MODEL))
    total_bytes = sum(p.numel() * p.element_size() for p in TinyGPT(MODEL).parameters())
    for stats in (result.forward_stats, result.backward_stats):
        assert stats.peak_allgather_bytes_in_flight <= 2 * block_bytes < total_bytes


def test_zero3_measured_peak_is_below_zero2(runs):
    zero2 = runs["zero2"][1][0].peak_step_bytes
    zero3 = runs["zero3"][1][0].peak_step_bytes
    assert 0 < zero3 < zero2


class RankDependentCollectiveEstimate:
    """Measured collective times as two ranks might see them: rank 1 thinks every collective is
    very slow (stretch prefetch as far as the other limits allow), rank 0 that they are free. On
    their own these give different schedules (see tests/test_scheduler_synthetic.py's distance tests)."""

    def __call__(self, collective) -> float:
        import torch.distributed as dist

        return 1e6 if dist.get_rank() == 1 else 0.0


class SlowCollectiveEstimate:
    def __call__(self, collective) -> float:
        return 1e6


def _issue_order(collectives: list[str]) -> list[str]:
    """The collectives of ``RankResult.collectives`` without their waits, in issue order."""
    return [c for c in collectives if "wait" not in c.split("(")[0]]


# Two blocks leave the placement of each collective a choice (and compile in half the time of four).
ESTIMATES_MODEL = TinyGPTConfig(n_layer=2)


def test_ranks_with_rank_dependent_estimates_issue_one_order(local_ranks):
    from thunder_overlap._analysis.cost_model import CostModel
    from thunder_overlap.config import OverlapConfig, Tuning

    cost_model = CostModel.named("cpu", "gloo-loopback", collective_estimate=RankDependentCollectiveEstimate())
    config = OverlapConfig(cost_model=cost_model, _tuning=Tuning(max_prefetch_compute_ops=1))
    setup = TrainSetup(sharding="zero3", model=ESTIMATES_MODEL, steps=1, config=config, measure_memory=False)
    ranks = local_ranks(train_rank, WORLD_SIZE, (setup,))
    # Each rank places collectives by its own estimates; which comes before which is agreed.
    assert _issue_order(ranks[0].collectives) == _issue_order(ranks[1].collectives)
    # Not vacuous: rank 1's estimates on both ranks give another placement.
    slow = CostModel.named("cpu", "gloo-loopback", collective_estimate=SlowCollectiveEstimate())
    slow_config = OverlapConfig(cost_model=slow, _tuning=Tuning(max_prefetch_compute_ops=1))
    slow_setup = TrainSetup(sharding="zero3", model=ESTIMATES_MODEL, steps=1, config=slow_config, measure_memory=False)
    (slow_rank, _) = local_ranks(train_rank, WORLD_SIZE, (slow_setup,))
    assert slow_rank.forward_picture != ranks[0].forward_picture



def test_memory_estimate_predicts_the_measured_peak_with_reduce_scatters_in_flight(local_ranks):
    # A step small enough that the gathered parameters and the gradients in flight are its peak.
    # gloo's reduce-scatter copies its input where no dispatch mode sees it and holds the copy,
    # not the input, until the wait: the tracker counts the copy, and so does the estimate, where
    # NCCL would hold the input itself. Where an input outlives its launch (two square weights'
    # gradients here, at width 128) both are alive: counting the input in the copy's place, the
    # prediction was 5.0% under the measurement here (37% over without the tracker's copy).
    setup = TrainSetup(sharding="zero3", model=TinyGPTConfig(n_layer=2, n_embd=128), micro_batch=1, seq_len=8, steps=1)
    result = local_ranks(train_rank, WORLD_SIZE, (setup,))[0]
    predicted, measured = result.predicted_peak_step_bytes, result.peak_step_bytes
    assert abs(predicted - measured) <= 0.02 * measured, (predicted, measured)


def test_memory_estimate_counts_the_cast_shards_mixed_precision_buckets_hold(local_ranks):
    import thunder_overlap

    # Gathering bf16 from float32 masters, each bucket casts its flat shard into a bf16 shard of
    # its own, held for the module's life as the pool is: the estimate counts both from the
    # step's start, as the tracker does (BucketingTransform.held_buffers). Without the cast
    # shards the prediction was 7.1% under the measurement here.
    policy = thunder_overlap.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    setup = TrainSetup(sharding="zero3", bucketing="block", model=ESTIMATES_MODEL, steps=1, mixed_precision=policy)
    result = local_ranks(train_rank, WORLD_SIZE, (setup,))[0]
    predicted, measured = result.predicted_peak_step_bytes, result.peak_step_bytes
    assert abs(predicted - measured) <= 0.02 * measured, (predicted, measured)
