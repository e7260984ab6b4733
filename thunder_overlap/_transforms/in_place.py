"""The original module holds the shards: after ``fsdp()`` its parameters are the same objects as
the sharded module's ([Note: shards in place] in docs/design.md).

This transform changes the module, not the traces: once every other transform has placed the
shards (Thunder's sharding, materialisation, the buckets' flat buffers), each original parameter
is pointed at its shard in place (``param.data = shard``) and becomes the parameter both modules
hold; one built on the meta device, which has no storage to point, is replaced by the shard's
parameter. Buffers are placed the same way. Thunder reads the shapes it traces from the original
module, so while it traces (a call that misses its cache, or
``compile_data(model).get_computation_and_inputs``) the original module holds full-shaped
placeholders on the meta device instead, as Thunder's own FSDP leaves them for good.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import thunder
import torch
import torch.nn as nn
from thunder.core.module import ThunderModule
from thunder.core.transform_common import Transform

from thunder_overlap._transforms._lookup import transform_of

__all__ = ["ShardsInPlaceTransform", "full_shapes"]


@dataclass(frozen=True)
class _Slot:
    """One name of a parameter in the original module: what it holds at rest and while traced."""

    owner: nn.Module
    attribute: str
    shard: nn.Parameter
    placeholder: nn.Parameter


class ShardsInPlaceTransform(Transform):
    """Makes the original module's parameters and buffers the shards, and gives Thunder full shapes
    whenever it traces (see the module's docstring). Last of the transforms that place
    parameters."""

    def __init__(self) -> None:
        self._slots: list[_Slot] = []

    @staticmethod
    def of(module) -> ShardsInPlaceTransform | None:
        return transform_of(module, ShardsInPlaceTransform)

    def transform_module(self, model) -> None:
        shared = model._get_shared_names()
        placed: set[str] = set()
        for name, shard in list(model._overrides_parameters.items()):
            if name in placed:
                continue
            kept, placeholder = _in_place(model._model.get_parameter(name), shard)
            for alias in shared[name]:
                owner_name, _, attribute = alias.rpartition(".")
                slot = _Slot(model._model.get_submodule(owner_name), attribute, kept, placeholder)
                slot.owner._parameters[attribute] = kept
                model._overrides_parameters[alias] = kept
                self._slots.append(slot)
                placed.add(alias)
        for name, buffer in model._overrides_buffers.items():
            owner_name, _, attribute = name.rpartition(".")
            model._model.get_submodule(owner_name)._buffers[attribute] = buffer  # keeps its persistence
        model.forward = self._tracing_with_full_shapes(model.forward)
        data = thunder.compile_data(model)
        data.get_computation_and_inputs = self._tracing_with_full_shapes(data.get_computation_and_inputs)

    @contextmanager
    def full_shapes(self) -> Iterator[None]:
        """The original module's parameters as the full-shaped placeholders Thunder traces from."""
        at_rest = [slot.owner._parameters[slot.attribute] for slot in self._slots]
        for slot in self._slots:
            slot.owner._parameters[slot.attribute] = slot.placeholder
        try:
            yield
        finally:
            for slot, parameter in zip(self._slots, at_rest, strict=True):
                slot.owner._parameters[slot.attribute] = parameter

    def _tracing_with_full_shapes(self, call):
        @functools.wraps(call)
        def with_full_shapes(*args, **kwargs):
            with self.full_shapes():
                return call(*args, **kwargs)

        return with_full_shapes


def _in_place(original: nn.Parameter, shard: nn.Parameter) -> tuple[nn.Parameter, nn.Parameter]:
    """(the parameter both modules hold at rest, the full-shaped placeholder on the meta device)."""
    assert original is not shard, "Thunder's FSDP makes a new parameter for every shard"
    if original.is_meta:  # PyTorch refuses set_data from the meta device
        return shard, original
    placeholder = nn.Parameter(original.detach().to("meta"), requires_grad=original.requires_grad)
    placeholder._thunder_device = shard.device  # the device Thunder's proxies are on (as its FSDP marks them)
    with torch.no_grad():
        original.grad = None  # of the whole parameter, from before sharding
        original.data = shard.data
    return original, placeholder


@contextmanager
def full_shapes(module) -> Iterator[None]:
    """``module``'s original parameters at their full shapes (meta placeholders) for the duration,
    where ``fsdp`` placed its shards there; nothing otherwise."""
    transform = ShardsInPlaceTransform.of(module) if isinstance(module, ThunderModule) else None
    if transform is None:
        yield
        return
    with transform.full_shapes():
        yield
