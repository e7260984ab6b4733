"""``fabric.save`` and ``fabric.load`` through :mod:`thunder_overlap.checkpoint`.

Fabric's state is a dict of one model, at most one optimizer and anything else (a step count, a
scheduler). The model and optimizer are saved as :func:`thunder_overlap.checkpoint.save` saves
them (sharded, or ``full``); the rest goes in its ``extra_state``, stateful objects (a scheduler)
by their ``state_dict()``, with the keys the model and optimizer had.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.nn as nn
from lightning.fabric.utilities.types import _Stateful
from torch.optim import Optimizer

from thunder_overlap import checkpoint
from thunder_overlap.checkpoint._layout import model_sharding

__all__ = ["save", "load"]

# The extra state's entry that says under which keys of Fabric's state the model and optimizer were.
_KEYS_ENTRY = "thunder_overlap.fabric"


@dataclass(frozen=True)
class _State:
    """Fabric's state dict taken apart."""

    model_key: str | None
    model: nn.Module
    optimizer_key: str | None
    optimizer: Optimizer | None
    others: dict[str, Any]


def save(path: Path, state: dict[str, Any], *, full: bool) -> None:
    parts = _split(state, "save")
    extra = {key: value.state_dict() if isinstance(value, _Stateful) else value for key, value in parts.others.items()}
    extra[_KEYS_ENTRY] = {"model": parts.model_key, "optimizer": parts.optimizer_key}
    checkpoint.save(path, parts.model, parts.optimizer, extra_state=extra, full=full)


def load(path: Path, state: nn.Module | Optimizer | dict[str, Any] | None, *, strict: bool, weights_only: bool | None) -> dict[str, Any]:
    """Loads into ``state`` in place (non-stateful values replaced); returns what it did not ask for."""
    if weights_only:
        raise ValueError(
            "fabric.load(..., weights_only=True) cannot be honoured by FSDPOverlapStrategy: the state besides the model and "
            "optimizer (the step, a scheduler's state) is saved pickled and read back as such; load only checkpoints you "
            "trust, and leave weights_only unset"
        )
    if isinstance(state, Optimizer):
        raise ValueError(
            "fabric.load with FSDPOverlapStrategy loads an optimizer with its model: "
            "fabric.load(path, {'model': model, 'optimizer': optimizer})"
        )
    if isinstance(state, nn.Module):
        state = {None: state}
    if not isinstance(state, dict) or not state:
        raise ValueError(
            f"fabric.load with FSDPOverlapStrategy needs the objects to load into, got state={state!r}: "
            "fabric.load(path, {'model': model, 'optimizer': optimizer, ...})"
        )
    parts = _split(state, "load")
    result = checkpoint.load(path, parts.model, parts.optimizer, strict=strict)
    saved = dict(result.extra_state)
    keys = saved.pop(_KEYS_ENTRY, {})
    missing = [key for key in parts.others if key not in saved]
    if strict and missing:
        has = sorted([key for key in (keys.get("model"), keys.get("optimizer")) if key is not None] + list(saved))
        raise KeyError(f"the checkpoint at {path} has no {missing[0]!r} (it has {has}); pass strict=False to load what it has")
    for key, target in parts.others.items():
        if key not in saved:
            continue
        if isinstance(target, _Stateful):
            target.load_state_dict(saved.pop(key))
        else:
            state[key] = saved.pop(key)
    return saved


def _split(state: dict[Any, Any], doing: str) -> _State:
    models = [(key, value) for key, value in state.items() if isinstance(value, nn.Module)]
    optimizers = [(key, value) for key, value in state.items() if isinstance(value, Optimizer)]
    if len(models) != 1:
        raise ValueError(
            f"fabric.{doing} with FSDPOverlapStrategy takes one model in the state, got {len(models)} "
            f"({', '.join(repr(key) for key, _ in models) or 'none'})"
        )
    if len(optimizers) > 1:
        raise ValueError(
            f"fabric.{doing} with FSDPOverlapStrategy takes at most one optimizer in the state, got {len(optimizers)} "
            f"({', '.join(repr(key) for key, _ in optimizers)})"
        )
    (model_key, model), = models
    if model_sharding(model) is None:
        raise TypeError(
            f"fabric.{doing}: the model under {model_key!r} is not sharded by thunder_overlap "
            f"({type(model).__name__}); pass the model fabric.setup or fabric.setup_module returned"
        )
    optimizer_key, optimizer = optimizers[0] if optimizers else (None, None)
    others = {key: value for key, value in state.items() if key not in (model_key, optimizer_key)}
    return _State(model_key, model, optimizer_key, optimizer, others)
