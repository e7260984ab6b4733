"""Hybrid sharding (HSDP) on four gloo ranks, a (2 replicate x 2 shard) device mesh.

ZeRO2 without buckets and ZeRO3 with block buckets train three AdamW steps in one spawn of the
four ranks, the second clipping every step's gradient by the whole model's norm (reduced over the
shard dimension only: the replicas hold the same gradients); every step of every run, its norm
included, is checked against a float64 single-process reference over the whole batch
(thunder_overlap.testing.parity: the bounds come from float32's rounding, not from one machine's
last digits), and its final traces are read: all-gathers within the shard group,
one all-reduce across the replicate group per reduce-scatter, issued beside compute.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from thunder_overlap.report._builtin_models import TinyGPT, TinyGPTConfig
from thunder_overlap.testing.float_error import rounding_count
from thunder_overlap.testing.parity import Mismatches, check_gradient_shards, reference_gradients
from thunder_overlap.testing.training import TrainSetup, check_against_reference, global_batch, shard_group_rank, train_rank

pytestmark = pytest.mark.ranks

WORLD_SIZE = 4
REPLICAS = 2
MODEL = TinyGPTConfig(n_layer=2)
# Each sharding and each bucketing once (the crossed pairs run without replicas in
# test_e2e_bucketing): what HSDP adds, the all-reduce across replicas, comes after a parameter's
# reduce-scatter in the first and a bucket's in the second. The second clips every step.
RUNS = [("zero2", "none"), ("zero3", "block")]
CLIPPED_RUN = ("zero3", "block")
# Below every step's 2-norm (about 1 on this model and batch), so every step clips.
MAX_NORM = 0.5


def _setup(sharding: str, bucketing: str) -> TrainSetup:
    # AdamW's defaults (eps 1e-8): its update, about lr x gradient / (|gradient| + eps), turns a
    # rounding in a near-zero gradient into a change of up to lr, which a comparison of the final
    # parameters would have to allow. check_against_reference compares each step from the ranks'
    # own parameters instead: gradients against float64, each update against a float64 replay on
    # the rank's own gradient, so no rounding is amplified into the allowance.
    max_norm = MAX_NORM if (sharding, bucketing) == CLIPPED_RUN else None
    return TrainSetup(
        sharding=sharding, bucketing=bucketing, model=MODEL, steps=3, replicas=REPLICAS, optimizer="adamw", lr=1e-3, max_norm=max_norm
    )


def _hsdp(seed: int, sharding: str, bucketing: str):
    from torch.distributed.device_mesh import init_device_mesh

    import thunder_overlap

    torch.manual_seed(seed)
    mesh = init_device_mesh("cpu", (REPLICAS, WORLD_SIZE // REPLICAS))
    return thunder_overlap.fsdp(TinyGPT(MODEL), device="cpu", sharding_strategy=sharding, bucketing_strategy=bucketing, device_mesh=mesh)


def _micro_batch_loss(model, rank: int, micro: int, seq_len: int | None = None) -> torch.Tensor:
    idx, targets = global_batch(_setup("zero2", "none"), WORLD_SIZE, micro)
    rows = slice(2 * rank, 2 * rank + 2)
    idx, targets = idx[:, :seq_len], targets[:, :seq_len]
    logits = model(idx[rows])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets[rows].reshape(-1))


def _no_sync_and_checkpoint(rank: int, directory: str) -> dict:
    """Two micro-batches with the first under no_sync, then an optimizer step, and a checkpoint
    of that model (ZeRO2, block buckets) loaded by another HSDP configuration (ZeRO3, none)."""
    from thunder_overlap import checkpoint
    from thunder_overlap.checkpoint import StateDictOptions

    result: dict = {}
    model = _hsdp(0, "zero2", "block")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with model.no_sync():
        _micro_batch_loss(model, rank, 0).backward()
    result["grads_none_under_no_sync"] = all(p.grad is None for p in model.parameters())
    _micro_batch_loss(model, rank, 1).backward()
    result["accumulated_grads"] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    optimizer.step()
    full = StateDictOptions(full_state_dict=True)
    checkpoint.save(Path(directory) / "hsdp", model, optimizer)
    result["saved"] = checkpoint.get_state_dict(model, optimizer, options=full)
    result["original_state_dict"] = {k: v.clone() for k, v in model.original_state_dict().items()}
    loading = _hsdp(1, "zero3", "none")
    loading_optimizer = torch.optim.AdamW(loading.parameters(), lr=1e-3)
    checkpoint.load(Path(directory) / "hsdp", loading, loading_optimizer)
    result["loaded"] = checkpoint.get_state_dict(loading, loading_optimizer, options=full)

    # A new sequence length retraces; the gradients still average over the whole world. Then
    # Thunder's state dict round trip keeps the live shards.
    model = _hsdp(0, "zero3", "none")
    _micro_batch_loss(model, rank, 0).backward()
    model.zero_grad(set_to_none=True)
    _micro_batch_loss(model, rank, 0, seq_len=8).backward()
    result["retraced_grads"] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    pointers = [p.data_ptr() for p in model.parameters()]
    model.load_state_dict({k: v * 0.5 for k, v in model.state_dict().items()})
    result["load_state_dict_kept_shards"] = pointers == [p.data_ptr() for p in model.parameters()]
    result["halved_original_state_dict"] = {k: v.clone() for k, v in model.original_state_dict().items()}
    return result


def _session(rank: int, world_size: int, setups: list[TrainSetup], directory: str):
    return [train_rank(rank, world_size, setup) for setup in setups], _no_sync_and_checkpoint(rank, directory)


@pytest.fixture(scope="module")
def session(tmp_path_factory, local_ranks):
    directory = tmp_path_factory.mktemp("hsdp")
    setups = [_setup(*run) for run in RUNS]
    per_rank = local_ranks(_session, WORLD_SIZE, (setups, str(directory)))
    return directory, setups, per_rank


@pytest.fixture(scope="module")
def runs(session):
    _, setups, per_rank = session
    return {run: (setup, [ranks[i] for ranks, _ in per_rank]) for i, (run, setup) in enumerate(zip(RUNS, setups, strict=True))}


class _Checks(dict):
    """run -> its check against the float64 reference (a few seconds each), made on first use."""

    def __init__(self, runs) -> None:
        super().__init__()
        self.runs = runs

    def __missing__(self, run):
        setup, results = self.runs[run]
        self[run] = check_against_reference(setup, WORLD_SIZE, results)
        return self[run]


@pytest.fixture(scope="module")
def checks(runs):
    return _Checks(runs)


@pytest.mark.parametrize("run", RUNS, ids=["-".join(r) for r in RUNS])
def test_first_gradients_are_the_average_over_the_whole_world(checks, run):
    # The reduction itself: reduce-scatter in the shard group, all-reduce across replicas. A
    # missing all-reduce leaves each replica its own half-batch gradient; a wrong divisor scales it.
    checks[run].mismatches.about("step 1 gradient").assert_none()


@pytest.mark.parametrize("run", RUNS, ids=["-".join(r) for r in RUNS])
def test_losses_and_parameters_match_the_single_process_reference(runs, checks, run):
    _, results = runs[run]
    check = checks[run]
    check.assert_mean_losses([r.losses for r in results])
    # Every step, rank, parameter and element: gradients, the parameters each step starts from,
    # and each optimizer update (thunder_overlap.testing.parity).
    check.mismatches.assert_none()


def test_clipping_uses_the_whole_worlds_norm_the_same_on_every_rank(runs, checks):
    _, results = runs[CLIPPED_RUN]
    norms = results[0].grad_norms
    assert len(norms) == 3 and all(n > MAX_NORM for n in norms), norms
    assert all(r.grad_norms == norms for r in results)
    # Each rank's norm against torch.nn.utils.clip_grad_norm_ on the float64 model, 1e-5 relative:
    # a norm reduced over the whole world would count every element twice (sqrt(2) too large).
    assert not [m for m in checks[CLIPPED_RUN].mismatches.found if "total gradient norm" in m.what]
    assert not checks[CLIPPED_RUN].mismatches.problems


@pytest.mark.parametrize("run", RUNS, ids=["-".join(r) for r in RUNS])
def test_gathers_and_reduce_scatters_stay_in_the_shard_group_all_reduces_cross_replicas(runs, run):
    setup, results = runs[run]
    for r in results:
        shard_rank, shard_size = shard_group_rank(r.rank, WORLD_SIZE, setup)
        first = r.rank - shard_rank
        shard_group, replicate_group = tuple(range(first, first + shard_size)), tuple(range(shard_rank, WORLD_SIZE, shard_size))
        everything = r.forward_groups + r.backward_groups
        assert {kind for kind, _, _ in everything} == {"all_gather", "reduce_scatter", "all_reduce"}
        for kind, ranks, _ in everything:
            assert ranks == (replicate_group if kind == "all_reduce" else shard_group), kind
        # The forward gathers every parameter once: shard_size times this rank's shards, so
        # each rank sends 1/shard_size of the model (a full-world FSDP would gather 4 shards).
        gathered = sum(numel for kind, _, numel in r.forward_groups if kind == "all_gather")
        assert gathered == shard_size * sum(s.numel() for s in r.shards.values())
        # Each all-reduce moves what its reduce-scatter produced: reduced shards, not gradients.
        reduced = sorted(numel for kind, _, numel in r.backward_groups if kind == "reduce_scatter")
        assert sorted(numel for kind, _, numel in r.backward_groups if kind == "all_reduce") == reduced


@pytest.mark.parametrize("run", RUNS, ids=["-".join(r) for r in RUNS])
def test_backward_has_one_all_reduce_per_reduce_scatter_beside_compute(runs, run):
    _, results = runs[run]
    stats = results[0].backward_stats
    assert stats.reduce_scatters > 0
    assert stats.all_reduces == stats.reduce_scatters
    names = [c.split("(")[0] for c in results[0].collectives]
    issued = [n for n in names if n.endswith("all_reduce")]
    waits = [n for n in names if n.endswith("all_reduce_wait")]
    assert len(issued) == len(waits) == stats.all_reduces
    assert stats.all_reduces_beside_compute >= 0.75 * stats.all_reduces
    assert all(r.collectives == results[0].collectives for r in results)


def _check_gradients_against_float64(per_rank, key: str, terms, tokens_per_rank: int, seq_len: int) -> None:
    """Every rank's ``extra[key]`` gradient shards against the float64 mean of ``terms(model)``
    (each rank's loss), within float32's rounding bound (thunder_overlap.testing.float_error)."""
    torch.manual_seed(0)
    model = TinyGPT(MODEL).double()
    shares = reference_gradients(model, terms(model))
    roundings = rounding_count(model.parameters(), tokens=tokens_per_rank, seq_len=seq_len, world_size=WORLD_SIZE)
    mismatches = Mismatches()
    for rank, (_, extra) in enumerate(per_rank):
        placement = shard_group_rank(rank, WORLD_SIZE, _setup("zero2", "none"))
        check_gradient_shards(mismatches, key, rank, extra[key], shares, placement, roundings)
    mismatches.assert_none()


def test_no_sync_skips_both_reductions_and_the_next_backward_sends_the_sum(session):
    _, _, per_rank = session
    assert all(extra["grads_none_under_no_sync"] for _, extra in per_rank)

    def terms(model):  # each rank sums its two micro-batches' gradients; the ranks' average is expected
        return [_micro_batch_loss(model, rank, 0) + _micro_batch_loss(model, rank, 1) for rank in range(WORLD_SIZE)]

    _check_gradients_against_float64(per_rank, "accumulated_grads", terms, tokens_per_rank=2 * 2 * 32, seq_len=32)


def test_a_checkpoint_saved_under_hsdp_loads_into_another_hsdp_configuration_and_one_process(session):
    from thunder_overlap import checkpoint

    directory, _, per_rank = session
    saved_model, saved_optim = per_rank[0][1]["saved"]
    for rank, (_, extra) in enumerate(per_rank):
        # Every rank sees the same full state: replicas hold the same shards.
        for name, value in extra["saved"][0].items():
            assert torch.equal(value, saved_model[name]), f"{name} on rank {rank}"
        loaded_model, loaded_optim = extra["loaded"]
        for name, value in saved_model.items():
            assert torch.equal(loaded_model[name], value), f"{name} on rank {rank}"
        for name, state in saved_optim["state"].items():
            for key, value in state.items():
                assert torch.equal(torch.as_tensor(loaded_optim["state"][name][key]), torch.as_tensor(value)), f"{name}.{key}"
        for name, value in extra["original_state_dict"].items():
            assert torch.equal(value, saved_model[name]), f"original_state_dict {name} on rank {rank}"
    torch.manual_seed(1)
    plain = TinyGPT(MODEL)
    checkpoint.load(directory / "hsdp", plain)
    for name, value in plain.state_dict().items():
        if name in saved_model:
            assert torch.equal(value, saved_model[name]), name


def test_a_retrace_for_a_new_sequence_length_and_a_state_dict_round_trip_work_under_hsdp(session):
    _, _, per_rank = session

    def terms(model):
        return [_micro_batch_loss(model, rank, 0, seq_len=8) for rank in range(WORLD_SIZE)]

    _check_gradients_against_float64(per_rank, "retraced_grads", terms, tokens_per_rank=2 * 8, seq_len=8)
    torch.manual_seed(0)
    initial = {n: p.detach().clone() for n, p in TinyGPT(MODEL).named_parameters()}
    for rank, (_, extra) in enumerate(per_rank):
        assert extra["load_state_dict_kept_shards"]
        for name, value in extra["halved_original_state_dict"].items():
            torch.testing.assert_close(value, initial[name] * 0.5, msg=f"{name} on rank {rank}")
