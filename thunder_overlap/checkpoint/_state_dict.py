"""Model and optimizer state dicts in original shapes, named as
``torch.distributed.checkpoint.state_dict`` names them.

Sharded parameters, and the optimizer states shaped like them (AdamW's moments), become
DTensors sharded on dim 0 over the model's process group, with the parameters' original,
unpadded shapes; everything else (buffers, ``step`` counters) is a plain tensor, which
``torch.distributed.checkpoint`` treats as replicated. The optimizer's state is keyed by parameter
name (a tied parameter by its first name) instead of by position, so it survives a change of
model wrapper, world size or bucketing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from thunder.core.module import ThunderModule
from torch.distributed.tensor import DTensor

from thunder_overlap.checkpoint._layout import ModelSharding, ParameterShard, model_sharding, process_group_of

__all__ = ["LoadResult", "StateDictOptions", "get_state_dict", "set_state_dict"]

StateDict = dict[str, Any]


@dataclass(frozen=True)
class StateDictOptions:
    """What :func:`get_state_dict` returns and how :func:`set_state_dict` loads.

    Attributes:
        full_state_dict: plain, unsharded tensors (gathered on every rank) instead of DTensors.
        cpu_offload: move the tensors to the CPU (with ``full_state_dict``, the gathered ones).
        rank0_only: with ``full_state_dict``, only rank 0 keeps them; the others get empty dicts.
        strict: :func:`set_state_dict` raises on missing or unexpected keys (it always raises on
            a shape mismatch); with False it loads what matches and reports the rest.
    """

    full_state_dict: bool = False
    cpu_offload: bool = False
    rank0_only: bool = False
    strict: bool = True

    def __post_init__(self) -> None:
        for name in ("full_state_dict", "cpu_offload", "rank0_only", "strict"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"StateDictOptions.{name} must be a bool, got {getattr(self, name)!r}")
        if self.rank0_only and not self.full_state_dict:
            raise ValueError("StateDictOptions(rank0_only=True) needs full_state_dict=True: sharded state lives on every rank")


@dataclass
class LoadResult:
    """Keys that were not loaded: the model's or optimizer's keys absent from the state dict
    (``missing_keys``) and the state dict's keys the model does not have (``unexpected_keys``).
    :func:`set_state_dict` names model keys as the state dict does (``blocks.0.attn.weight``)
    and optimizer entries ``optim.state.<parameter>``; :func:`~thunder_overlap.checkpoint.load`
    names them as the checkpoint stores them (``model.blocks.0.attn.weight``,
    ``optim.state.<parameter>.<state>``). ``extra_state`` is what
    :func:`~thunder_overlap.checkpoint.save` was given as ``extra_state`` (empty if nothing)."""

    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    extra_state: dict[str, Any] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.missing_keys or self.unexpected_keys)

    def error_message(self, relax: str, limit: int = 8) -> str:
        """The keys (``limit`` of each at most) for an error; ``relax`` says how to load anyway."""

        def some(keys: list[str]) -> str:
            more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
            return ", ".join(keys[:limit]) + more

        parts = [
            f"{what}: {some(keys)}"
            for what, keys in (("missing keys", self.missing_keys), ("unexpected keys", self.unexpected_keys))
            if keys
        ]
        return f"{'; '.join(parts)} (pass {relax} to load what matches)"


def model_keys(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every persistent parameter and buffer by name, tied parameters under each of their names
    (as ``nn.Module.state_dict`` lists them)."""
    # A ThunderModule's own modules are its wrapped model's under a "_model." prefix.
    root = model._model if isinstance(model, ThunderModule) else model
    non_persistent = {
        f"{module_name}.{buffer}" if module_name else buffer
        for module_name, module in root.named_modules()
        for buffer in module._non_persistent_buffers_set
    }
    entries = dict(model.named_parameters(remove_duplicate=False))
    entries.update((n, b) for n, b in model.named_buffers(remove_duplicate=False) if n not in non_persistent)
    return entries


def parameter_names(model: nn.Module) -> dict[int, str]:
    """Parameter object id -> its first name: how optimizer state is keyed in a state dict."""
    names: dict[int, str] = {}
    for name, parameter in model.named_parameters():
        names.setdefault(id(parameter), name)
    return names


def _finish(value: torch.Tensor, options: StateDictOptions, keep: bool) -> torch.Tensor | None:
    """Applies ``full_state_dict`` (every rank takes part in the gather), then the rest."""
    if options.full_state_dict and isinstance(value, DTensor):
        value = value.full_tensor()
    if not keep:
        return None
    return value.cpu() if options.cpu_offload else value


def _state_tensor(value: Any, shard: ParameterShard | None, sharding: ModelSharding | None) -> Any:
    """A parameter-shaped optimizer state as a DTensor like its parameter; the rest unchanged."""
    if shard is None or sharding is None or not isinstance(value, torch.Tensor) or tuple(value.shape) != shard.padded_shape:
        return value
    return shard.as_dtensor(value, sharding.mesh)


def get_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, options: StateDictOptions | None = None
) -> tuple[StateDict, StateDict]:
    """The model's and the optimizer's state dicts, sharded parameters as DTensors of their
    original shapes whose local tensors are views of the live shards (no copy).

    ``model`` is what :func:`thunder_overlap.fsdp` returned, or a plain ``nn.Module`` (whose
    tensors are returned as they are). The optimizer state dict is ``{"state": {name: {...}},
    "param_groups": [{..., "params": [name, ...]}]}``; it is empty when ``optimizer`` is None.
    """
    options = options or StateDictOptions()
    sharding = model_sharding(model)
    group = process_group_of(model)
    keep = not options.rank0_only or group is None or dist.get_rank(group) == 0

    model_state: StateDict = {}
    for name, value in model_keys(model).items():
        value = value.detach()
        if sharding is not None and name in sharding.parameters:
            value = sharding.parameters[name].as_dtensor(value, sharding.mesh)
        finished = _finish(value, options, keep)
        if keep:
            model_state[name] = finished
    if optimizer is None:
        return model_state, {}

    names = parameter_names(model)
    state: StateDict = {}
    groups = []
    for group in optimizer.param_groups:
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": [_name_of(p, names) for p in group["params"]]})
        for parameter in group["params"]:
            name = _name_of(parameter, names)
            shard = sharding.parameters.get(name) if sharding is not None else None
            entries = {}
            for key, value in optimizer.state.get(parameter, {}).items():
                finished = _finish(_state_tensor(value, shard, sharding), options, keep) if isinstance(value, torch.Tensor) else value
                entries[key] = finished
            if entries and keep:
                state[name] = entries
    return model_state, ({"state": state, "param_groups": groups} if keep else {})


def _name_of(parameter: torch.Tensor, names: dict[int, str]) -> str:
    try:
        return names[id(parameter)]
    except KeyError:
        raise ValueError(
            f"the optimizer holds a parameter of shape {tuple(parameter.shape)} that is not one of the model's parameters; "
            "pass the optimizer built on this model's parameters"
        ) from None


def set_state_dict(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    model_state_dict: Mapping[str, Any],
    optim_state_dict: Mapping[str, Any] | None = None,
    options: StateDictOptions | None = None,
) -> LoadResult:
    """Copies state dicts (as :func:`get_state_dict` returns them, sharded or full, from any world
    size) into the live model and optimizer.

    Parameters are copied into in place, so they stay views of their bucket buffers and
    ``.grad`` works as before; padding rows are left as they are (zero). The optimizer gets its
    state through ``load_state_dict``, reshaped to this rank's padded shards. A value of another
    shape is a ``ValueError`` naming the key and both shapes; missing and unexpected keys raise
    ``KeyError`` naming them unless ``options.strict`` is False, in which case they are returned.
    """
    options = options or StateDictOptions()
    sharding = model_sharding(model)
    result = LoadResult()
    live = model_keys(model)
    result.missing_keys += [k for k in live if k not in model_state_dict]
    result.unexpected_keys += [k for k in model_state_dict if k not in live]
    if optimizer is not None and optim_state_dict is not None:
        _check_optimizer_keys(model, optimizer, optim_state_dict, result)
    if options.strict and result:
        raise KeyError(result.error_message("StateDictOptions(strict=False)"))

    with torch.no_grad():
        for name, target in live.items():
            if name not in model_state_dict:
                continue
            value = model_state_dict[name]
            shard = sharding.parameters.get(name) if sharding is not None else None
            if shard is not None:
                target.narrow(0, 0, shard.real_rows).copy_(shard.rows_of(value))
            else:
                if isinstance(value, DTensor):
                    value = value.full_tensor()
                if tuple(value.shape) != tuple(target.shape):
                    raise ValueError(f"{name}: the state dict has shape {tuple(value.shape)}, the model's has {tuple(target.shape)}")
                target.copy_(value)
    if optimizer is not None and optim_state_dict is not None:
        optimizer.load_state_dict(_positional_optimizer_state(model, optimizer, optim_state_dict, sharding))
    return result


def _check_optimizer_keys(model: nn.Module, optimizer: torch.optim.Optimizer, saved: Mapping[str, Any], result: LoadResult) -> None:
    names = parameter_names(model)
    ours = [_name_of(p, names) for group in optimizer.param_groups for p in group["params"]]
    saved_groups = saved.get("param_groups", [])
    theirs = [name for group in saved_groups for name in group["params"]]
    result.missing_keys += [f"optim.state.{n}" for n in ours if n not in theirs]
    result.unexpected_keys += [f"optim.state.{n}" for n in theirs if n not in ours]


def _positional_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, saved: Mapping[str, Any], sharding: ModelSharding | None
) -> StateDict:
    """``saved`` (keyed by name, original shapes) as ``optimizer.load_state_dict`` takes it:
    keyed by position, shaped like this rank's padded shards. Parameters the saved state lacks
    keep their current state."""
    names = parameter_names(model)
    current = optimizer.state_dict()
    saved_groups = {name: group for group in saved["param_groups"] for name in group["params"]}
    groups, state = [], dict(current["state"])
    # An optimizer without per-parameter state (SGD without momentum) saves none: no "state" key.
    saved_state = saved.get("state", {})
    index = 0
    for group, current_group in zip(optimizer.param_groups, current["param_groups"], strict=True):
        merged = dict(current_group)
        for parameter in group["params"]:
            name = _name_of(parameter, names)
            if name in saved_groups:
                merged.update({k: v for k, v in saved_groups[name].items() if k != "params"})
            if name in saved_state:
                shard = sharding.parameters.get(name) if sharding is not None else None
                state[index] = {key: _local_state(name, key, value, shard, parameter) for key, value in saved_state[name].items()}
            index += 1
        groups.append(merged)
    return {"state": state, "param_groups": groups}


def _local_state(name: str, key: str, value: Any, shard: ParameterShard | None, parameter: torch.Tensor) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    if shard is not None and tuple(value.shape) == shard.full_shape and value.dim() > 0:
        return shard.padded(value, parameter)
    if isinstance(value, DTensor):
        value = value.full_tensor()
    if value.dim() > 0 and tuple(value.shape) != tuple(parameter.shape):
        raise ValueError(
            f"optim.state.{name}.{key}: the state dict has shape {tuple(value.shape)}, the parameter has {tuple(parameter.shape)}"
        )
    return value
