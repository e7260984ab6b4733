"""Checkpoints in one process, no ranks: bad input named, interrupted saves harmless, and the
manifest of every file's size and CRC32 checked at load. Two ranks: tests/test_e2e_checkpoint.py."""

from __future__ import annotations

import json
import re
import warnings
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from thunder_overlap import checkpoint
from thunder_overlap.checkpoint import StateDictOptions
from thunder_overlap.report._builtin_models import TinyGPT, TinyGPTConfig
from thunder_overlap.testing.parity import assert_states_equal

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
    assert_states_equal(restored.state_dict(), old.state_dict(), rtol=0, atol=0)


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
    assert_states_equal(model.state_dict(), before, rtol=0, atol=0)


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
    assert_states_equal(restored.state_dict(), old.state_dict(), rtol=0, atol=0)
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


def test_an_optimizer_without_per_parameter_state_saves_and_loads(tmp_path):
    # SGD without momentum keeps no state per parameter, so the checkpoint has none to read.
    model = _tiny()
    checkpoint.save(tmp_path / "ckpt", model, torch.optim.SGD(model.parameters(), lr=0.1))
    loaded = _tiny()
    optimizer = torch.optim.SGD(loaded.parameters(), lr=0.5)
    checkpoint.load(tmp_path / "ckpt", loaded, optimizer)
    assert optimizer.param_groups[0]["lr"] == 0.1 and optimizer.state_dict()["state"] == {}


def test_extra_state_is_saved_with_the_model_and_returned_by_load(tmp_path):
    extra = {"step": 3, "scheduler": {"last_epoch": 2, "lrs": [0.1, 0.05]}, "note": "warmup done"}
    checkpoint.save(tmp_path / "with", _tiny(), extra_state=extra)
    assert checkpoint.load(tmp_path / "with", _tiny()).extra_state == extra
    checkpoint.save(tmp_path / "without", _tiny())
    assert checkpoint.load(tmp_path / "without", _tiny()).extra_state == {}


@pytest.mark.parametrize(
    ("extra", "message"),
    [([("step", 3)], r"extra_state must be a dict with str keys or None, got \[\('step', 3\)\]"),
     ({1: "one"}, r"extra_state must be a dict with str keys"),
     ({"handle": lambda: 0}, r"extra_state must be picklable")],
)  # fmt: skip
def test_bad_extra_state_is_named_before_anything_is_written(tmp_path, extra, message):
    with pytest.raises(TypeError, match=message):
        checkpoint.save(tmp_path / "ckpt", _tiny(), extra_state=extra)
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "ckpt.saving").exists()


def test_a_full_checkpoint_is_one_file_the_plain_model_loads(tmp_path):
    source = _tiny()
    optimizer = torch.optim.AdamW(source.parameters())
    source(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    optimizer.step()
    path = checkpoint.save(tmp_path / "full.pt", source, optimizer, extra_state={"step": 1}, full=True)
    assert path.is_file() and not (tmp_path / "full.pt.saving").exists()
    plain = TinyGPT(TinyGPTConfig(n_layer=1))
    plain.load_state_dict(torch.load(path, weights_only=True)["model"])
    assert_states_equal(plain.state_dict(), source.state_dict())

    torch.manual_seed(1)
    target = TinyGPT(TinyGPTConfig(n_layer=1))
    target_optimizer = torch.optim.AdamW(target.parameters())
    result = checkpoint.load(path, target, target_optimizer)
    assert result.extra_state == {"step": 1} and not result
    assert_states_equal(target.state_dict(), source.state_dict())
    assert len(target_optimizer.state) == len(optimizer.state) > 0
    for p, q in zip(source.parameters(), target.parameters(), strict=True):
        assert optimizer.state[p].keys() == target_optimizer.state[q].keys()
        for key, value in optimizer.state[p].items():
            torch.testing.assert_close(target_optimizer.state[q][key], value, rtol=0, atol=0)


def test_a_full_checkpoint_never_replaces_a_directory(tmp_path):
    checkpoint.save(tmp_path / "ckpt", _tiny())
    with pytest.raises(checkpoint.CheckpointError, match=r"ckpt is a directory; a full checkpoint is one file"):
        checkpoint.save(tmp_path / "ckpt", _tiny(), full=True)
    assert checkpoint.load(tmp_path / "ckpt", _tiny()).missing_keys == []
    torch.save({"weights": 1}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match=r"other.pt is not a full checkpoint \(.*full=True\)\): it has no 'model' entry"):
        checkpoint.load(tmp_path / "other.pt", _tiny())
