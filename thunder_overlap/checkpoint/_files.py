"""``save`` and ``load``: :mod:`torch.distributed.checkpoint` directories of the state dicts.

The directory holds ``{"model": ..., "optim": ..., "extra": ...}`` as DCP flattens it (keys such
as ``model.blocks.0.attn.weight``, ``optim.state.blocks.0.attn.weight.exp_avg``,
``optim.param_groups``; ``extra`` is the pickled ``extra_state``, one entry) and a manifest of
every file's size and CRC32 (``_manifest``). Loading
verifies the files, then reads the checkpoint's metadata, so that a missing, unexpected or
differently shaped entry is named before anything is read, then lets DCP read every rank's rows
of the original shapes, whatever world size wrote them.

Both run as phases that every rank passes together or none does (``_agreement``): a failure on
one rank is every rank's error, at once, and never a hang.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import warnings
from collections.abc import Iterator, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from thunder_overlap.checkpoint import _manifest
from thunder_overlap.checkpoint._agreement import Operation
from thunder_overlap.checkpoint._errors import distributed_checkpoint_error
from thunder_overlap.checkpoint._full import load_full, save_full
from thunder_overlap.checkpoint._layout import process_group_of
from thunder_overlap.checkpoint._manifest import MANIFEST_FILE, METADATA_FILE
from thunder_overlap.checkpoint._state_dict import LoadResult, StateDictOptions, get_state_dict, set_state_dict

__all__ = ["save", "load", "MODEL_KEY", "OPTIM_KEY", "EXTRA_KEY"]

MODEL_KEY = "model"
OPTIM_KEY = "optim"
EXTRA_KEY = "extra"


def _check_arguments(model: object, optimizer: object, **flags: object) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (what thunder_overlap.fsdp returned, or a plain one), got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {value!r}")


@contextlib.contextmanager
def _quiet_dcp() -> Iterator[None]:
    """Drops two warnings DCP gives every call that say nothing to a user here: that one
    process without a group saves or loads alone (it is meant to), and that its file writer
    asks a tensor for its TypedStorage (DCP's own code)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
        yield


def save(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra_state: Mapping[str, Any] | None = None,
    full: bool = False,
) -> Path:
    """Writes the model's (and optimizer's) sharded state to the directory ``path``; every rank
    of the model's group calls it, and ``path`` must be on storage they all see. ``extra_state``
    (a dict of picklable values: the step, a scheduler's state dict) is saved with them, rank
    0's copy, and :func:`load` returns it in ``LoadResult.extra_state``.

    ``full=True`` writes one file instead, of the original names and shapes, gathered to and
    written by rank 0 (``<path>.saving``, then renamed): ``torch.load(path)["model"]`` is a state
    dict the plain model loads, and :func:`load` reads it at any world size.

    The checkpoint is written to ``<path>.saving``, with a manifest of every file's size and
    CRC32, and renamed into place once every rank has written it, so a crash mid-save leaves the
    previous checkpoint at ``path`` loadable. A failure on any rank (the staging directory cannot
    be made, a write fails) raises the same :class:`CheckpointError` on every rank, naming the
    rank and the cause, and leaves ``path`` as it was. A ``path`` that exists and is not a
    checkpoint (a file, a non-empty directory without one) is never replaced. Returns ``path``.
    """
    _check_arguments(model, optimizer, full=full)
    extra = _pickled_extra_state(extra_state)
    path = Path(path)
    if full:
        save_full(Operation("checkpoint.save", path, process_group_of(model), intact=f"{path} is as it was"), model, optimizer, extra)
        return path
    staging = path.with_name(path.name + ".saving")
    op = Operation("checkpoint.save", path, process_group_of(model), intact=f"{path} is as it was")

    def remove_staging() -> None:
        if op.is_coordinator and staging.is_dir():
            shutil.rmtree(staging, ignore_errors=True)

    state = op.run("collecting the state dicts", lambda: _state_to_save(model, optimizer, extra))
    op.run(f"preparing the staging directory {staging}", lambda: _prepare_staging(path, staging) if op.is_coordinator else None)
    writer = op.run(f"opening {staging} on every rank", partial(_writer, path, staging), cleanup=remove_staging)
    # Only DCP's collective save in this phase: once every rank is in, DCP fails on all or none.
    written = op.gather(f"writing the files into {staging}", partial(_write, state, writer, op.group), cleanup=remove_staging)
    names = written[0]
    shares = op.gather(
        "computing the files' CRC32 checksums",
        lambda: _manifest.checksum_files(staging, _manifest.share(names, op.rank, op.world_size)),
        cleanup=remove_staging,
    )
    entries = {name: entry for part in shares for name, entry in part.items()}
    op.run(f"publishing {staging} as {path}", partial(_publish, path, staging, entries, op.is_coordinator), cleanup=remove_staging)
    return path


def _pickled_extra_state(extra_state: Mapping[str, Any] | None) -> bytes | None:
    """``extra_state`` as one bytes entry: DCP would otherwise flatten its dicts and lists into
    entries of their own, which a load must name before it can read them."""
    if extra_state is None:
        return None
    if not isinstance(extra_state, Mapping) or not all(isinstance(key, str) for key in extra_state):
        raise TypeError(f"extra_state must be a dict with str keys or None, got {extra_state!r:.200}")
    try:
        return pickle.dumps(dict(extra_state))
    except Exception as error:
        raise TypeError(f"extra_state must be picklable: {error}") from error


def _state_to_save(model: nn.Module, optimizer: torch.optim.Optimizer | None, extra: bytes | None) -> dict[str, Any]:
    model_state, optim_state = get_state_dict(model, optimizer)
    state: dict[str, Any] = {MODEL_KEY: model_state}
    if optimizer is not None:
        state[OPTIM_KEY] = optim_state
    if extra is not None:
        state[EXTRA_KEY] = extra
    return state


def _is_checkpoint(path: Path) -> bool:
    return (path / METADATA_FILE).is_file()


def _prepare_staging(path: Path, staging: Path) -> None:
    """Coordinator: a fresh, empty ``staging``; refuses a ``path`` that holds something else."""
    if path.exists() and not _is_checkpoint(path) and (not path.is_dir() or any(path.iterdir())):
        what = "a file" if not path.is_dir() else f"a directory without a checkpoint (no {METADATA_FILE})"
        raise FileExistsError(f"{path} is {what}; save replaces only a checkpoint: remove it or choose another path")
    if staging.is_dir():  # left by a save that stopped midway
        shutil.rmtree(staging)
    elif staging.exists():
        raise FileExistsError(f"{staging} exists and is not a directory; remove it")
    staging.mkdir(parents=True)


def _writer(path: Path, staging: Path) -> dcp.FileSystemWriter:
    if not staging.is_dir():
        raise FileNotFoundError(f"{staging}, which rank 0 created, does not exist here: is {path} on storage every rank shares?")
    return dcp.FileSystemWriter(staging)


def _write(state: dict[str, Any], writer: dcp.FileSystemWriter, group: dist.ProcessGroup | None) -> list[str] | None:
    """Every rank writes its files; the coordinator, whose DCP call returns once all have, lists them."""
    try:
        with _quiet_dcp():
            dcp.save(state, storage_writer=writer, process_group=group, no_dist=group is None)
    except CheckpointException as error:
        raise distributed_checkpoint_error(f"writing {writer.path}", error) from error
    return _manifest.list_files(Path(writer.path)) if group is None or dist.get_rank(group) == 0 else None


def _publish(path: Path, staging: Path, entries: dict[str, _manifest.FileEntry], is_coordinator: bool) -> None:
    """Coordinator: writes the manifest, then two renames, so ``path`` is always either the old
    checkpoint or the new one; between them (a crash there) the old one is at ``<path>.previous``.
    A rename that fails puts the old checkpoint back."""
    if not is_coordinator:
        return
    _manifest.write_manifest(staging, entries)
    previous = path.with_name(path.name + ".previous")
    if previous.exists():
        shutil.rmtree(previous)
    moved = path.exists()
    if moved:
        path.rename(previous)
    try:
        staging.rename(path)
    except BaseException:
        if moved and not path.exists():
            previous.rename(path)
        raise
    shutil.rmtree(previous, ignore_errors=True)


# What ``_find`` sees at a path.
_FULL_FILE, _WITH_MANIFEST, _WITHOUT_MANIFEST = "full", "manifest", "no manifest"


def _same_kind(path: Path, is_file: list[bool], rank: int) -> None:
    if not is_file[rank]:
        raise FileNotFoundError(
            f"{path} is a directory here, where rank {is_file.index(True)} sees a file: is the path on storage every rank shares?"
        )


def _find(path: Path) -> str:
    """What the checkpoint at ``path`` is; raises if there is no checkpoint."""
    if path.is_file():
        return _FULL_FILE
    if not _is_checkpoint(path):
        previous = path.with_name(path.name + ".previous")
        hint = f"; an interrupted save left the previous checkpoint at {previous}" if _is_checkpoint(previous) else ""
        what = "does not exist" if not path.exists() else f"is not a torch.distributed.checkpoint directory (it has no {METADATA_FILE})"
        raise FileNotFoundError(f"no checkpoint at {path}: it {what}{hint}")
    return _WITH_MANIFEST if (path / MANIFEST_FILE).exists() else _WITHOUT_MANIFEST


def _verify(path: Path, verify: bool, rank: int, world_size: int) -> bool:
    """Checks this rank's share of the files against the manifest; False where there is none to
    check against (``verify=False``, or a checkpoint saved before manifests)."""
    if not verify:
        return False
    manifest = _manifest.read_manifest(path)
    if manifest is None:
        return False
    _manifest.verify_files(path, manifest, _manifest.share(sorted(manifest), rank, world_size))
    return True


def _flat_tensors(state: dict[str, Any], prefix: str) -> dict[str, torch.Tensor]:
    """The tensors of a nested state dict under the keys DCP flattens them to."""
    flat: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if isinstance(value, dict):
            flat.update(_flat_tensors(value, f"{prefix}{key}."))
        elif isinstance(value, torch.Tensor):
            flat[f"{prefix}{key}"] = value
    return flat


def _match(template: dict[str, Any], saved: dict[str, Any]) -> LoadResult:
    """Compares the tensors ``template`` asks for with those the checkpoint has; a shape mismatch
    raises at once, naming the key and both shapes."""
    wanted = _flat_tensors(template, "")
    result = LoadResult()
    for key, tensor in wanted.items():
        entry = saved.get(key)
        if entry is None:
            result.missing_keys.append(key)
        elif isinstance(entry, TensorStorageMetadata) and tuple(entry.size) != tuple(tensor.shape):
            raise ValueError(f"{key}: the checkpoint has shape {tuple(entry.size)}, the model expects {tuple(tensor.shape)}")
    loading = {k.split(".", 1)[0] for k in template}
    result.unexpected_keys += [
        k for k, entry in saved.items() if isinstance(entry, TensorStorageMetadata) and k.split(".", 1)[0] in loading and k not in wanted
    ]
    return result


def _drop(template: dict[str, Any], missing: set[str], prefix: str = "") -> dict[str, Any]:
    kept: dict[str, Any] = {}
    for key, value in template.items():
        if isinstance(value, dict):
            inner = _drop(value, missing, f"{prefix}{key}.")
            if inner:
                kept[key] = inner
        elif f"{prefix}{key}" not in missing:
            kept[key] = value
    return kept


def _initialize_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Gives every trainable parameter its optimizer state (as torch does): one step with zero
    gradients at learning rate 0, which creates the state tensors and changes no parameter. A
    frozen parameter never has a gradient, so torch gives it no state, and neither does this."""
    trainable = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    if all(p in optimizer.state for p in trainable):
        return
    saved = [(p, p.grad) for p in trainable]
    learning_rates = [group["lr"] for group in optimizer.param_groups]
    for parameter, _ in saved:
        parameter.grad = torch.zeros_like(parameter)
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    try:
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, learning_rates, strict=True):
            group["lr"] = lr
        for parameter, grad in saved:
            parameter.grad = grad


def load(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    strict: bool = True,
    verify: bool = True,
) -> LoadResult:
    """Loads a checkpoint written by :func:`save` into ``model`` (and ``optimizer``), whatever
    world size, sharding strategy or bucketing wrote it; ``model`` may also be a plain
    ``nn.Module`` in one process. Every rank of the model's group calls it. ``path`` may be a
    sharded checkpoint's directory or a full checkpoint's file.

    First every file is checked against the checkpoint's manifest (size and CRC32, the ranks
    sharing the reading); a damaged file raises :class:`CorruptCheckpointError` naming it, with
    both sizes or checksums, before anything is loaded. ``verify=False`` skips this; a checkpoint
    saved before manifests loads unverified, with a warning.

    Every error is a :class:`CheckpointError` that every rank raises alike, naming the failing
    rank and the cause, and is also the type of its cause: missing or unexpected keys a
    ``KeyError`` naming them (unless ``strict`` is False: then what matches is loaded and the
    rest returned); a tensor of another shape a ``ValueError`` naming the key and both shapes;
    a path that holds no checkpoint a ``FileNotFoundError``; a failure inside torch's
    checkpoint reader also its ``CheckpointException``.
    """
    _check_arguments(model, optimizer, strict=strict, verify=verify)
    path = Path(path)
    op = Operation("checkpoint.load", path, process_group_of(model), intact="the model and optimizer are as they were")
    found = op.gather("looking for the checkpoint", lambda: _find(path))
    is_file = [kind == _FULL_FILE for kind in found]
    if len(set(is_file)) > 1:  # every rank sees the same list, so all come here or none
        op.run("comparing what the ranks see", lambda: _same_kind(path, is_file, op.rank))
    if is_file[0]:
        return load_full(op, model, optimizer, strict)
    has_manifest = [kind == _WITH_MANIFEST for kind in found]
    if len(set(has_manifest)) > 1:  # every rank sees the same list, so all come here or none
        op.run("comparing the files the ranks see", lambda: _same_manifest(path, has_manifest, op.rank))
    verified = op.run("verifying the files against the manifest (CRC32)", lambda: _verify(path, verify, op.rank, op.world_size))
    if verify and not verified and op.is_coordinator:
        warnings.warn(
            f"the checkpoint at {path} has no manifest ({MANIFEST_FILE}: it was written before thunder_overlap "
            "recorded checksums, or by other code), so its files cannot be verified; save it again to add one",
            UserWarning,
            stacklevel=2,
        )
    plan = partial(_plan_load, path, model, optimizer, strict)
    reader, template, result = op.run("reading the checkpoint's index and matching it with the model", plan)
    op.intact = "the model and optimizer may be partly loaded: load again before training on"
    # DCP's collective load first in this phase: once every rank is in, DCP fails on all or none.
    result.extra_state = op.run(f"reading the tensors from {path}", partial(_read, reader, template, model, optimizer, op.group))
    return result


def _same_manifest(path: Path, has_manifest: list[bool], rank: int) -> None:
    if not has_manifest[rank]:
        raise FileNotFoundError(
            f"{path} has no {MANIFEST_FILE} here, where rank {has_manifest.index(True)} sees one: is the path on storage every rank shares?"
        )


def _plan_load(
    path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, strict: bool
) -> tuple[dcp.FileSystemReader, dict[str, Any], LoadResult]:
    """The reader, the state dict to read into (views of the live tensors) and the keys left out."""
    reader = dcp.FileSystemReader(path)
    saved = reader.read_metadata().state_dict_metadata
    if optimizer is not None:
        if not any(k.startswith(f"{OPTIM_KEY}.") for k in saved):
            raise KeyError(
                f"the checkpoint at {path} has no optimizer state (it was saved without an optimizer); load it with optimizer=None"
            )
        _initialize_optimizer_state(optimizer)
    model_state, optim_state = get_state_dict(model, optimizer)
    template: dict[str, Any] = {MODEL_KEY: model_state}
    if optimizer is not None:
        template[OPTIM_KEY] = optim_state
    if EXTRA_KEY in saved:
        template[EXTRA_KEY] = b""  # DCP replaces it with what was saved
    result = _match(template, saved)
    if strict and result:
        raise KeyError(result.error_message("strict=False"))
    return reader, _drop(template, set(result.missing_keys)), result


def _read(
    reader: dcp.FileSystemReader,
    template: dict[str, Any],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    group: dist.ProcessGroup | None,
) -> dict[str, Any]:
    """Reads ``template``'s entries into the model and optimizer; returns the saved extra state."""
    path = Path(reader.path)
    try:
        with _quiet_dcp():
            dcp.load(template, storage_reader=reader, process_group=group, no_dist=group is None)
    except CheckpointException as error:
        try:
            unreadable = _manifest.describe_unreadable_files(path, reader.read_metadata())
        except Exception:  # noqa: BLE001 - only a hint; the error below says what failed
            unreadable = ""
        raise distributed_checkpoint_error(f"reading {path}" + (f" ({unreadable})" if unreadable else ""), error) from error
    set_state_dict(
        model,
        optimizer,
        model_state_dict=template.get(MODEL_KEY, {}),
        optim_state_dict=template.get(OPTIM_KEY),
        options=StateDictOptions(strict=False),
    )
    return pickle.loads(template[EXTRA_KEY]) if EXTRA_KEY in template else {}
