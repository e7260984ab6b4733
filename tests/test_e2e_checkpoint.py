"""Sharded checkpoints: save on two gloo ranks, load elsewhere, and carry on as if never stopped.

One spawn of two ranks trains litgpt's GPT (a small Llama: GQA, RoPE, RMSNorm, LLaMA MLP, a
vocabulary of 101 so that shards are padded) with ZeRO3 block buckets for two AdamW steps, saves,
and runs step 3; in the same processes the checkpoint is loaded into a ZeRO2 layer model and a
ZeRO3 block one, which run their own step 3. TinyGPT (tied head, frozen parameter) goes from
ZeRO2 without buckets to ZeRO3 block. Here, in one process, the checkpoint is loaded into a plain
GPT and into a one-rank ZeRO3 auto-bucketed one. Bad checkpoints and interrupted saves, which
need no ranks: tests/test_checkpoint_one_rank.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from litgpt import GPT, Config

from thunder_overlap import checkpoint
from thunder_overlap._transforms import BucketingTransform
from thunder_overlap.checkpoint import StateDictOptions
from thunder_overlap.report._builtin_models import TinyGPT, TinyGPTConfig
from thunder_overlap.testing.float_error import OptimizerReplay, rounding_count
from thunder_overlap.testing.parity import Mismatches, assert_losses_close, assert_states_equal, one_step_reference

pytestmark = pytest.mark.ranks

WORLD_SIZE = 2
LLAMA = Config(
    block_size=32,
    vocab_size=101,
    padded_vocab_size=101,
    n_layer=2,
    n_head=4,
    n_query_groups=2,
    n_embd=32,
    rotary_percentage=1.0,
    parallel_residual=False,
    bias=False,
    norm_class_name="RMSNorm",
    mlp_class_name="LLaMAMLP",
    intermediate_size=64,
)
SEQUENCES_PER_RANK, SEQ_LEN, LR = 2, 16, 0.01


def _batch(step: int, rank: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch, or rank ``rank``'s half of it."""
    tokens = torch.randint(
        0, LLAMA.vocab_size, (SEQUENCES_PER_RANK * WORLD_SIZE, SEQ_LEN + 1), generator=torch.Generator().manual_seed(step)
    )
    if rank is not None:
        tokens = tokens[rank * SEQUENCES_PER_RANK : (rank + 1) * SEQUENCES_PER_RANK]
    return tokens[:, :-1], tokens[:, 1:]


def _loss(model: nn.Module, step: int, rank: int | None) -> torch.Tensor:
    inputs, targets = _batch(step, rank)
    logits = model(inputs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int, rank: int | None) -> float:
    optimizer.zero_grad(set_to_none=True)
    loss = _loss(model, step, rank)
    loss.backward()
    optimizer.step()
    return loss.item()


def _gpt(seed: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(LLAMA)


def _sharded(model: nn.Module, sharding: str, bucketing: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    import thunder_overlap

    jm = thunder_overlap.fsdp(model, device="cpu", sharding_strategy=sharding, bucketing_strategy=bucketing)
    return jm, torch.optim.AdamW([p for p in jm.parameters() if p.requires_grad], lr=LR)


def _full(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> tuple[dict, dict]:
    options = StateDictOptions(full_state_dict=True)
    model_state, optim_state = checkpoint.get_state_dict(model, optimizer, options=options)
    return {k: v.clone() for k, v in model_state.items()}, {
        name: {k: v.clone() for k, v in entries.items()} for name, entries in optim_state.get("state", {}).items()
    }


def _parameters_are_bucket_views(model: nn.Module) -> bool:
    """Every parameter of a bucket still shares its bucket's flat shard, and so does its .grad."""
    bucketing = BucketingTransform.of(model)
    flat_storages = {b.flat_shard.untyped_storage().data_ptr() for b in bucketing.buckets}
    grad_storages = bucketing.gradient_storages()
    return all(p.untyped_storage().data_ptr() in flat_storages for p in model.parameters()) and all(
        p.grad is None or p.grad.untyped_storage().data_ptr() in grad_storages for p in model.parameters()
    )


def _checkpoint_session(rank: int, world_size: int, directory: str) -> dict:
    path = Path(directory) / "llama"
    result: dict = {}
    model, optimizer = _sharded(_gpt(seed=0), "zero3", "block")
    result["losses"] = [_train_step(model, optimizer, step, rank) for step in (0, 1)]
    checkpoint.save(path, model, optimizer)
    result["saved_model"], result["saved_optim"] = _full(model, optimizer)
    result["step3_loss"] = _train_step(model, optimizer, 2, rank)
    result["step3_model"], _ = _full(model, optimizer)

    # Another initialisation, so that nothing matches unless the load worked.
    for name, sharding, bucketing in (("zero2_layer", "zero2", "layer"), ("zero3_block", "zero3", "block")):
        model, optimizer = _sharded(_gpt(seed=1), sharding, bucketing)
        checkpoint.load(path, model, optimizer)
        result[f"{name}_loaded_model"], result[f"{name}_loaded_optim"] = _full(model, optimizer)
        result[f"{name}_step3_loss"] = _train_step(model, optimizer, 2, rank)
        result[f"{name}_step3_model"], _ = _full(model, optimizer)
        result[f"{name}_bucket_views"] = _parameters_are_bucket_views(model)

    # TinyGPT: a tied head, a frozen parameter, padding; no buckets -> block buckets.
    import thunder_overlap

    torch.manual_seed(0)
    tiny = thunder_overlap.fsdp(TinyGPT(TinyGPTConfig(n_layer=2)), device="cpu", sharding_strategy="zero2")
    tiny_path = Path(directory) / "tiny"
    checkpoint.save(tiny_path, tiny)
    result["tiny_saved"], _ = _full(tiny)
    torch.manual_seed(1)
    tiny_block = thunder_overlap.fsdp(
        TinyGPT(TinyGPTConfig(n_layer=2)), device="cpu", sharding_strategy="zero3", bucketing_strategy="block"
    )
    checkpoint.load(tiny_path, tiny_block)
    result["tiny_loaded"], _ = _full(tiny_block)
    # Thunder's own view of the same parameters (it lists a tied one once).
    result["tiny_original"] = {k: v.clone() for k, v in tiny_block.original_state_dict().items()}
    # set_state_dict takes full tensors too (here a plain module's state dict), every rank its rows.
    torch.manual_seed(2)
    plain = TinyGPT(TinyGPTConfig(n_layer=2)).state_dict()
    checkpoint.set_state_dict(tiny, model_state_dict=plain)
    result["plain_state"], (result["plain_loaded"], _) = plain, _full(tiny)
    rank0_only = StateDictOptions(full_state_dict=True, rank0_only=True, cpu_offload=True)
    result["rank0_only_keys"] = sorted(checkpoint.get_state_dict(tiny_block, options=rank0_only)[0])
    return result


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, local_ranks):
    directory = tmp_path_factory.mktemp("checkpoints")
    return directory, local_ranks(_checkpoint_session, WORLD_SIZE, (str(directory),))


@pytest.fixture(scope="module")
def step3(ranks):
    """Step 3 resumed from the checkpoint in float64: name -> (the parameter after it, how far a
    float32 run may land from it: the gradient's rounding through AdamW plus the step's own;
    parity.one_step_reference), and each rank's float64 loss."""
    _, results = ranks
    model = _gpt(seed=1).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(results[0]["saved_model"][name])
    terms = [_loss(model, 2, rank) for rank in range(WORLD_SIZE)]
    roundings = rounding_count(model.parameters(), tokens=SEQUENCES_PER_RANK * SEQ_LEN, seq_len=SEQ_LEN, world_size=WORLD_SIZE)
    reference = one_step_reference(model, terms, results[0]["saved_optim"], OptimizerReplay("adamw", LR), roundings)
    return reference, [t.item() for t in terms]


def _assert_step3_parameters(step3, states: list[tuple[str, int, dict]]) -> None:
    """Each (run, rank, full state after step 3) against the float64 step, every element."""
    reference, _ = step3
    mismatches = Mismatches()
    for run, rank, state in states:
        assert state.keys() == reference.keys(), run
        for name, (expected, allowed) in reference.items():
            mismatches.compare(f"{run}: step 3 parameter {name}", rank, state[name], expected, allowed)
    mismatches.assert_none()


def test_same_configuration_resumes_bit_identically(ranks):
    _, results = ranks
    for r in results:
        assert r["zero3_block_step3_loss"] == r["step3_loss"]
        assert_states_equal(r["zero3_block_step3_model"], r["step3_model"], rtol=0, atol=0)


def test_zero2_layer_resumes_a_zero3_block_checkpoint(ranks, step3):
    _, results = ranks
    _, losses = step3
    for rank, r in enumerate(results):
        assert_losses_close([r["step3_loss"], r["zero2_layer_step3_loss"]], [losses[rank]] * 2)
    # Both runs' step 3, the uninterrupted one and the resumed one, are float32 roundings of it.
    keys = {"zero3 block": "step3_model", "zero2 layer": "zero2_layer_step3_model"}
    runs = [(run, rank, r[key]) for rank, r in enumerate(results) for run, key in keys.items()]
    _assert_step3_parameters(step3, runs)


@pytest.mark.parametrize("name", ["zero2_layer", "zero3_block"])
def test_loading_restores_parameters_and_optimizer_state(ranks, name):
    _, results = ranks
    for r in results:
        assert_states_equal(r[f"{name}_loaded_model"], r["saved_model"], rtol=0, atol=0)
        # AdamW's step counts and both moments, per parameter, as they were saved.
        assert {k for entries in r["saved_optim"].values() for k in entries} == {"step", "exp_avg", "exp_avg_sq"}
        assert all(float(entries["step"]) == 2.0 for entries in r["saved_optim"].values())
        assert_states_equal(r[f"{name}_loaded_optim"], r["saved_optim"], rtol=0, atol=0)
        assert r[f"{name}_bucket_views"], "a parameter or gradient left its bucket buffer after loading"


def test_one_plain_process_resumes_a_two_rank_checkpoint(ranks, step3):
    directory, results = ranks
    model = _gpt(seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    assert not checkpoint.load(directory / "llama", model, optimizer)
    assert_states_equal(dict(model.named_parameters()), results[0]["saved_model"], rtol=0, atol=0)
    # One process sees the whole batch: its loss is the mean of the two ranks'.
    loss = _train_step(model, optimizer, 2, rank=None)
    assert_losses_close([loss], [sum(step3[1]) / WORLD_SIZE])
    _assert_step3_parameters(step3, [("one plain process", 0, dict(model.named_parameters()))])


def test_tied_and_frozen_parameters_reshard_into_block_buckets(ranks):
    _, results = ranks
    for r in results:
        assert {"wte.weight", "lm_head.weight", "wpe.weight"} <= r["tiny_saved"].keys()
        assert_states_equal(r["tiny_loaded"], r["tiny_saved"], rtol=0, atol=0)
        assert_states_equal(r["tiny_original"], {k: r["tiny_saved"][k] for k in r["tiny_original"]}, rtol=0, atol=0)
    assert results[0]["rank0_only_keys"] == sorted(results[0]["tiny_saved"])
    assert results[1]["rank0_only_keys"] == []


def test_set_state_dict_shards_a_plain_modules_state_dict(ranks):
    _, results = ranks
    for r in results:
        assert_states_equal(r["plain_loaded"], r["plain_state"], rtol=0, atol=0)


def test_a_full_state_dict_loads_into_a_plain_module(ranks):
    _, results = ranks
    model = TinyGPT(TinyGPTConfig(n_layer=2))
    model.load_state_dict(results[0]["tiny_saved"])
    assert_states_equal(model.state_dict(), results[0]["tiny_saved"], rtol=0, atol=0)


# --- last: the module's one-rank group stays alive from here to the module's end ---------------


def test_a_one_rank_auto_bucketed_model_resumes_a_two_rank_checkpoint(ranks, step3, one_rank_gloo_group):
    directory, results = ranks
    model, optimizer = _sharded(_gpt(seed=1), "zero3", "auto")
    checkpoint.load(directory / "llama", model, optimizer)
    loaded_model, loaded_optim = _full(model, optimizer)
    assert_states_equal(loaded_model, results[0]["saved_model"], rtol=0, atol=0)
    assert_states_equal(loaded_optim, results[0]["saved_optim"], rtol=0, atol=0)
    loss = _train_step(model, optimizer, 2, rank=None)
    assert_losses_close([loss], [sum(step3[1]) / WORLD_SIZE])
    _assert_step3_parameters(step3, [("one rank, auto buckets", 0, _full(model)[0])])
