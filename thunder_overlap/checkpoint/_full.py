"""Full checkpoints: one ``torch.load``-able file of the original parameter names and shapes.

The file is ``{"model": state_dict, "optim": ..., "extra": bytes}``: the model's entry loads into
the plain, unsharded model (``model.load_state_dict(torch.load(path)["model"])``); the optimizer's
is keyed by parameter name, as :func:`~thunder_overlap.checkpoint.get_state_dict` returns it; the
extra state is pickled, as in a sharded checkpoint. Every rank takes part in the gather, rank 0
writes the file (``<path>.saving``, then renamed into place), and every rank reads it to load.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from thunder_overlap.checkpoint._agreement import Operation
from thunder_overlap.checkpoint._state_dict import LoadResult, StateDictOptions, get_state_dict, set_state_dict

__all__ = ["save_full", "load_full"]

MODEL_KEY, OPTIM_KEY, EXTRA_KEY = "model", "optim", "extra"


def save_full(op: Operation, model: nn.Module, optimizer: torch.optim.Optimizer | None, extra: bytes | None) -> None:
    """Gathers the whole state onto rank 0 (every rank takes part), which writes it to ``op.path``."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, rank0_only=True)
    # The gather's collectives run inside this phase: once every rank is in, they fail on all or none.
    model_state, optim_state = op.run("gathering the whole state dicts", lambda: get_state_dict(model, optimizer, options=options))
    contents: dict[str, Any] = {MODEL_KEY: model_state}
    if optimizer is not None:
        contents[OPTIM_KEY] = optim_state
    if extra is not None:
        contents[EXTRA_KEY] = extra
    op.run(f"writing {op.path}", lambda: _write(op.path, contents) if op.is_coordinator else None)


def _write(path: Path, contents: dict[str, Any]) -> None:
    if path.is_dir():
        raise FileExistsError(f"{path} is a directory; a full checkpoint is one file: remove it or choose another path")
    staging = path.with_name(path.name + ".saving")
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(contents, staging)
    os.replace(staging, path)  # the old file, or the new one, never half of either


def load_full(op: Operation, model: nn.Module, optimizer: torch.optim.Optimizer | None, strict: bool) -> LoadResult:
    """Every rank reads the file at ``op.path`` and copies its rows of each tensor into place."""
    contents = op.run(f"reading {op.path}", lambda: _read(op.path, optimizer is not None))
    op.intact = "the model and optimizer may be partly loaded: load again before training on"
    result = op.run(
        "copying the state into the model and optimizer",
        lambda: set_state_dict(
            model,
            optimizer,
            model_state_dict=contents[MODEL_KEY],
            optim_state_dict=contents.get(OPTIM_KEY),
            options=StateDictOptions(full_state_dict=True, strict=strict),
        ),
    )
    result.extra_state = pickle.loads(contents[EXTRA_KEY]) if EXTRA_KEY in contents else {}
    return result


def _read(path: Path, with_optimizer: bool) -> dict[str, Any]:
    # Tensors and plain containers only; the extra state stays bytes until it is unpickled.
    contents = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    if not isinstance(contents, dict) or MODEL_KEY not in contents:
        raise ValueError(f"{path} is not a full checkpoint (checkpoint.save(..., full=True)): it has no {MODEL_KEY!r} entry")
    if with_optimizer and OPTIM_KEY not in contents:
        raise KeyError(f"the checkpoint at {path} has no optimizer state (it was saved without an optimizer); load it with optimizer=None")
    return contents
