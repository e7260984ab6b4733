"""Sharded checkpoints: save on two gloo ranks, load elsewhere, and carry on as if never stopped.

One spawn of two ranks trains litgpt's GPT (a small Llama: GQA, RoPE, RMSNorm, LLaMA MLP, a
vocabulary of 101 so that shards are padded) with ZeRO3 block buckets for two AdamW steps, saves,
and runs step 3; in the same processes the checkpoint is loaded into a ZeRO2 layer model and a
ZeRO3 block one, which run their own step 3. TinyGPT (tied head, frozen parameter) goes from
ZeRO2 without buckets to ZeRO3 block. Here, in one process, the checkpoint is loaded into a plain
GPT and into a one-rank ZeRO3 auto-bucketed one. Bad checkpoints and interrupted saves need no
ranks.
"""

from __future__ import annotations

import json
import re
import warnings
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from litgpt import GPT, Config

from thunder_overlap import checkpoint
from thunder_overlap._transforms import BucketingTransform
from thunder_overlap.checkpoint import StateDictOptions
from thunder_overlap.report._builtin_models import TinyGPT, TinyGPTConfig
from thunder_overlap.testing.float_error import OptimizerReplay, rounding_count
from thunder_overlap.testing.local_ranks import run_local_ranks
from thunder_overlap.testing.parity import Mismatches, assert_losses_close, one_step_reference

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
def ranks(tmp_path_factory):
    directory = tmp_path_factory.mktemp("checkpoints")
    return directory, run_local_ranks(_checkpoint_session, WORLD_SIZE, (str(directory),))


def _assert_states_equal(actual: dict, expected: dict, **tolerance) -> None:
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        if isinstance(value, dict):
            _assert_states_equal(actual[name], value, **tolerance)
        else:
            torch.testing.assert_close(actual[name], value, msg=name, **tolerance)


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
        _assert_states_equal(r["zero3_block_step3_model"], r["step3_model"], rtol=0, atol=0)


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
        _assert_states_equal(r[f"{name}_loaded_model"], r["saved_model"], rtol=0, atol=0)
        # AdamW's step counts and both moments, per parameter, as they were saved.
        assert {k for entries in r["saved_optim"].values() for k in entries} == {"step", "exp_avg", "exp_avg_sq"}
        assert all(float(entries["step"]) == 2.0 for entries in r["saved_optim"].values())
        _assert_states_equal(r[f"{name}_loaded_optim"], r["saved_optim"], rtol=0, atol=0)
        assert r[f"{name}_bucket_views"], "a parameter or gradient left its bucket buffer after loading"


def test_one_plain_process_resumes_a_two_rank_checkpoint(ranks, step3):
    directory, results = ranks
    model = _gpt(seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    assert not checkpoint.load(directory / "llama", model, optimizer)
    _assert_states_equal(dict(model.named_parameters()), results[0]["saved_model"], rtol=0, atol=0)
    # One process sees the whole batch: its loss is the mean of the two ranks'.
    loss = _train_step(model, optimizer, 2, rank=None)
    assert_losses_close([loss], [sum(step3[1]) / WORLD_SIZE])
    _assert_step3_parameters(step3, [("one plain process", 0, dict(model.named_parameters()))])


def test_tied_and_frozen_parameters_reshard_into_block_buckets(ranks):
    _, results = ranks
    for r in results:
        assert {"wte.weight", "lm_head.weight", "wpe.weight"} <= r["tiny_saved"].keys()
        _assert_states_equal(r["tiny_loaded"], r["tiny_saved"], rtol=0, atol=0)
        _assert_states_equal(r["tiny_original"], {k: r["tiny_saved"][k] for k in r["tiny_original"]}, rtol=0, atol=0)
    assert results[0]["rank0_only_keys"] == sorted(results[0]["tiny_saved"])
    assert results[1]["rank0_only_keys"] == []


def test_set_state_dict_shards_a_plain_modules_state_dict(ranks):
    _, results = ranks
    for r in results:
        _assert_states_equal(r["plain_loaded"], r["plain_state"], rtol=0, atol=0)


def test_a_full_state_dict_loads_into_a_plain_module(ranks):
    _, results = ranks
    model = TinyGPT(TinyGPTConfig(n_layer=2))
    model.load_state_dict(results[0]["tiny_saved"])
    _assert_states_equal(model.state_dict(), results[0]["tiny_saved"], rtol=0, atol=0)


# --- bad input, one process -------------------------------------------------------------------


def _tiny(**config) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(TinyGPTConfig(n_layer=1, **config))


def test_missing_and_unexpected_keys_are_named(tmp_path):
    checkpoint.save(tmp_path / "one", _tiny())
    bigger = TinyGPT(TinyGPTConfig(n_layer=2))
    with pytest.raises(KeyError, match=r"missing keys: model\.blocks\.1\.") as missing:
        checkpoint.load(tmp_path / "one", bigger)
    assert "strict=False" in str(missing.value)
    checkpoint.save(tmp_path / "two", bigger)
    with pytest.raises(KeyError, match=r"unexpected keys: model\.blocks\.1\."):
        checkpoint.load(tmp_path / "two", _tiny())


def test_strict_false_loads_what_matches_and_reports_the_rest(tmp_path):
    source = _tiny()
    checkpoint.save(tmp_path / "one", source)
    torch.manual_seed(1)
    bigger = TinyGPT(TinyGPTConfig(n_layer=2))
    result = checkpoint.load(tmp_path / "one", bigger, strict=False)
    assert result.missing_keys and all(k.startswith("model.blocks.1.") for k in result.missing_keys)
    assert result.unexpected_keys == []
    torch.testing.assert_close(bigger.blocks[0].attn.qkv.weight, source.blocks[0].attn.qkv.weight, rtol=0, atol=0)


def test_a_parameter_of_another_shape_names_the_key_and_both_shapes(tmp_path):
    checkpoint.save(tmp_path / "ckpt", _tiny())
    with pytest.raises(ValueError, match=r"model\.wte\.weight: the checkpoint has shape \(101, 64\), the model expects \(101, 32\)"):
        checkpoint.load(tmp_path / "ckpt", _tiny(n_embd=32, n_head=2))


def test_a_path_that_is_not_a_checkpoint_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no checkpoint at .*nowhere: it does not exist"):
        checkpoint.load(tmp_path / "nowhere", _tiny())
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"is not a torch.distributed.checkpoint directory \(it has no \.metadata\)"):
        checkpoint.load(tmp_path / "empty", _tiny())


def test_loading_an_optimizer_from_a_checkpoint_without_one_is_an_error(tmp_path):
    model = _tiny()
    checkpoint.save(tmp_path / "ckpt", model)
    with pytest.raises(KeyError, match=r"has no optimizer state"):
        checkpoint.load(tmp_path / "ckpt", model, torch.optim.AdamW(model.parameters()))


def test_a_crash_mid_save_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch):
    old = _tiny()
    checkpoint.save(tmp_path / "ckpt", old)

    def crash(self, *args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(dcp.FileSystemWriter, "finish", crash)
    with pytest.raises(dcp.api.CheckpointException, match="disk full"):
        checkpoint.save(tmp_path / "ckpt", _tiny(n_embd=32, n_head=2))
    monkeypatch.undo()
    restored = TinyGPT(TinyGPTConfig(n_layer=1))
    checkpoint.load(tmp_path / "ckpt", restored)
    _assert_states_equal(restored.state_dict(), old.state_dict(), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"full_state_dict": 1}, TypeError, r"StateDictOptions.full_state_dict must be a bool, got 1"),
        ({"rank0_only": True}, ValueError, r"rank0_only=True\) needs full_state_dict=True"),
    ],
)
def test_bad_state_dict_options_are_named(options, error, message):
    with pytest.raises(error, match=message):
        StateDictOptions(**options)



def test_bad_save_and_load_arguments_are_named(tmp_path):
    model = _tiny()
    checkpoint.save(tmp_path / "ckpt", model)
    with pytest.raises(TypeError, match=r"strict must be a bool, got 'no'"):
        checkpoint.load(tmp_path / "ckpt", model, strict="no")
    with pytest.raises(TypeError, match=r"verify must be a bool, got 'yes'"):
        checkpoint.load(tmp_path / "ckpt", model, verify="yes")
    with pytest.raises(TypeError, match=r"model must be a torch.nn.Module .*got OrderedDict"):
        checkpoint.save(tmp_path / "other", model.state_dict())
    with pytest.raises(TypeError, match=r"optimizer must be a torch.optim.Optimizer or None, got list"):
        checkpoint.load(tmp_path / "ckpt", model, [1])

# --- manifest: every file's size and CRC32, verified at load; torch's errors as ours ------------


def _flip_4_bytes(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    middle = len(raw) // 2
    raw[middle : middle + 4] = bytes(b ^ 0xFF for b in raw[middle : middle + 4])
    path.write_bytes(bytes(raw))


def test_a_checkpoint_records_every_files_size_and_crc32(tmp_path):
    checkpoint.save(tmp_path / "ckpt", _tiny())
    manifest = json.loads((tmp_path / "ckpt" / ".manifest.json").read_text())
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name != ".manifest.json")
    assert files == [".metadata", "__0_0.distcp"]
    assert manifest["files"] == {
        name: {"size": (tmp_path / "ckpt" / name).stat().st_size, "crc32": zlib.crc32((tmp_path / "ckpt" / name).read_bytes())}
        for name in files
    }


def test_flipped_bytes_are_refused_naming_the_file_and_both_checksums(tmp_path):
    checkpoint.save(tmp_path / "ckpt", _tiny())
    _flip_4_bytes(tmp_path / "ckpt" / "__0_0.distcp")
    torch.manual_seed(1)
    model = TinyGPT(TinyGPTConfig(n_layer=1))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(checkpoint.CorruptCheckpointError) as error:
        checkpoint.load(tmp_path / "ckpt", model)
    assert re.search(r"damaged: __0_0\.distcp has CRC32 0x[0-9a-f]{8}, the manifest records 0x[0-9a-f]{8} \(\d+ bytes\)", str(error.value))
    assert isinstance(error.value, Exception) and str(error.value).endswith("the model and optimizer are as they were")
    _assert_states_equal(model.state_dict(), before, rtol=0, atol=0)


def test_a_file_of_another_size_is_named_with_both_sizes(tmp_path):
    checkpoint.save(tmp_path / "ckpt", _tiny())
    with open(tmp_path / "ckpt" / ".metadata", "ab") as metadata:
        metadata.write(b"\0")
    size = (tmp_path / "ckpt" / ".metadata").stat().st_size
    with pytest.raises(checkpoint.CorruptCheckpointError, match=rf"\.metadata is {size} bytes, the manifest records {size - 1}"):
        checkpoint.load(tmp_path / "ckpt", _tiny())


def test_a_checkpoint_without_a_manifest_loads_with_a_warning(tmp_path):
    old = _tiny()
    checkpoint.save(tmp_path / "ckpt", old)
    (tmp_path / "ckpt" / ".manifest.json").unlink()  # as checkpoints were written before manifests
    restored = TinyGPT(TinyGPTConfig(n_layer=1))
    with pytest.warns(UserWarning, match=r"has no manifest \(\.manifest\.json: .*cannot be verified; save it again to add one"):
        checkpoint.load(tmp_path / "ckpt", restored)
    _assert_states_equal(restored.state_dict(), old.state_dict(), rtol=0, atol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        checkpoint.load(tmp_path / "ckpt", restored, verify=False)


def test_torch_read_errors_are_exceptions_naming_the_file(tmp_path):
    checkpoint.save(tmp_path / "ckpt", _tiny())
    data = tmp_path / "ckpt" / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:1000])
    # torch's CheckpointException is a BaseException: `except Exception` in a training loop missed it.
    truncated = r"torch.distributed.checkpoint failed reading .*__0_0\.distcp is 1000 bytes.*\(truncated\)"
    with pytest.raises(Exception, match=truncated) as error:
        checkpoint.load(tmp_path / "ckpt", _tiny(), verify=False)
    assert isinstance(error.value, checkpoint.DistributedCheckpointError) and isinstance(error.value, dcp.api.CheckpointException)
    assert "may be partly loaded: load again before training on" in str(error.value)
    with pytest.raises(checkpoint.CorruptCheckpointError, match=r"__0_0\.distcp is 1000 bytes, the manifest records \d+"):
        checkpoint.load(tmp_path / "ckpt", _tiny())


def test_save_never_replaces_what_is_not_a_checkpoint(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    refused = r"notes is a directory without a checkpoint \(no \.metadata\); save replaces only a checkpoint"
    with pytest.raises(checkpoint.CheckpointError, match=refused):
        checkpoint.save(tmp_path / "notes", _tiny())
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"
    (tmp_path / "file").write_text("keep me too")
    with pytest.raises(checkpoint.CheckpointError, match=r"FileExistsError: .*file is a file; save replaces only a checkpoint"):
        checkpoint.save(tmp_path / "file", _tiny())
    assert (tmp_path / "file").read_text() == "keep me too" and not (tmp_path / "file.saving").exists()
    (tmp_path / "empty").mkdir()
    checkpoint.save(tmp_path / "empty", _tiny())  # an empty directory is fine


# --- last: the module's one-rank group stays alive from here to the module's end ---------------


def test_a_one_rank_auto_bucketed_model_resumes_a_two_rank_checkpoint(ranks, step3, one_rank_gloo_group):
    directory, results = ranks
    model, optimizer = _sharded(_gpt(seed=1), "zero3", "auto")
    checkpoint.load(directory / "llama", model, optimizer)
    loaded_model, loaded_optim = _full(model, optimizer)
    _assert_states_equal(loaded_model, results[0]["saved_model"], rtol=0, atol=0)
    _assert_states_equal(loaded_optim, results[0]["saved_optim"], rtol=0, atol=0)
    loss = _train_step(model, optimizer, 2, rank=None)
    assert_losses_close([loss], [sum(step3[1]) / WORLD_SIZE])
    _assert_step3_parameters(step3, [("one rank, auto buckets", 0, _full(model)[0])])
