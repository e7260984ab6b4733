"""Transformer blocks of a model: the unit of prefetching and of block and auto bucketing.

Users may name the module classes that form blocks (``block_types=``, as FSDP2 users choose what
to ``fully_shard``): every outermost module of those classes is a block. Otherwise the blocks are
the children of the ``nn.ModuleList`` / ``nn.Sequential`` holding the most parameters, which
finds a GPT's ``transformer.h``, a Llama's ``layers`` or a plain ``nn.Sequential`` stack of blocks.
A top-level ``nn.Sequential(embedding, body, head)`` would give three "blocks": where ``body`` is
itself an ``nn.Sequential``/``nn.ModuleList`` of identical blocks (same class, same parameter
shapes), its children are the blocks; where it is any other module, a warning names
``block_types=`` when that "block" holds more than a quarter of the model among unlike siblings.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import torch.nn as nn

__all__ = ["BlockTypes", "find_blocks", "largest_block_bytes", "parse_block_types", "unsharded_bytes"]

# Module classes (matched with isinstance) or class names (a class's __name__ or its
# "module.QualName"), as parsed by parse_block_types.
BlockTypes = tuple["type[nn.Module] | str", ...]

# A detected block holding more than this share of the model's parameter bytes is suspect: the
# container found is probably the model's top level (embedding, body, head), not its layers.
# Prefetching sizes itself in blocks, so such a "block" makes the prefetch window the whole model.
LARGE_BLOCK_SHARE = 0.25


def parse_block_types(value: object) -> BlockTypes | None:
    """``block_types`` as given by a user: None, one ``nn.Module`` subclass or class name, or an
    iterable of them; returns a tuple, or None for automatic detection."""
    if value is None:
        return None
    items = [value] if isinstance(value, (str, type)) else value
    if not isinstance(items, Iterable):
        raise TypeError(f"block_types must be a module class, a class name, or a list of them, got {value!r}")
    parsed = tuple(items)
    if not parsed:
        raise ValueError("block_types=() names no module class; pass None for automatic block detection")
    for item in parsed:
        if isinstance(item, type) and issubclass(item, nn.Module):
            continue
        if isinstance(item, str) and item.strip():
            continue
        raise TypeError(
            f"block_types entries must be torch.nn.Module subclasses or class names (such as 'Block' or "
            f"'LlamaDecoderLayer'), got {item!r}"
        )
    return parsed


def _class_name(module: nn.Module) -> str:
    return type(module).__name__


def _matches(module: nn.Module, block_type: type[nn.Module] | str) -> bool:
    if isinstance(block_type, type):
        return isinstance(module, block_type)
    cls = type(module)
    return block_type in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")


def _named_blocks(module: nn.Module, block_types: BlockTypes) -> list[tuple[str, nn.Module]]:
    """Outermost modules of ``block_types``; raises if one of the types matches nothing."""
    modules = list(module.named_modules())
    for block_type in block_types:
        if not any(_matches(sub, block_type) for _, sub in modules):
            shown = block_type.__name__ if isinstance(block_type, type) else repr(block_type)
            found = sorted({_class_name(sub) for _, sub in modules})
            raise ValueError(f"block_types: {shown} matches no module of {_class_name(module)}; its module classes are {found}")
    blocks: list[tuple[str, nn.Module]] = []
    for name, sub in modules:
        inside_a_block = any(name.startswith(f"{b}.") or not b for b, _ in blocks)
        if not inside_a_block and any(_matches(sub, t) for t in block_types):
            blocks.append((name, sub))
    return blocks


def _is_container(module: nn.Module) -> bool:
    return isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) >= 2


def _children(prefix: str, container: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(f"{prefix}.{child_name}" if prefix else child_name, child) for child_name, child in container.named_children()]


def _signature(module: nn.Module) -> tuple[type, tuple[tuple[str, tuple[int, ...]], ...]]:
    return type(module), tuple((name, tuple(p.shape)) for name, p in module.named_parameters())


def _identical(modules: list[nn.Module]) -> bool:
    """Whether ``modules`` are copies of one block: same class, same parameter names and shapes."""
    return len({_signature(m) for m in modules}) == 1


def _detected_blocks(module: nn.Module) -> list[tuple[str, nn.Module]]:
    best: tuple[int, str, nn.Module] | None = None
    for name, sub in module.named_modules():
        if not _is_container(sub):
            continue
        size = unsharded_bytes(sub)
        if best is None or size > best[0]:
            best = (size, name, sub)
    if best is None:
        return []
    _, prefix, container = best
    blocks = _children(prefix, container)
    largest_name, largest = max(blocks, key=lambda b: unsharded_bytes(b[1]))
    if _suspect(module, blocks) and _is_container(largest) and _identical(list(largest.children())):
        # nn.Sequential(stem, nn.Sequential(block, block, ...), head): the stack's children.
        return _children(largest_name, largest)
    _warn_if_suspect(module, prefix, blocks)
    return blocks


def _suspect(module: nn.Module, blocks: list[tuple[str, nn.Module]]) -> bool:
    """Whether the largest detected block is a large share of the model among unlike siblings.
    A ModuleList of a few identical layers (a 2-layer model) is a sound detection."""
    total = unsharded_bytes(module)
    if not blocks or total == 0:
        return False
    largest = max((b for _, b in blocks), key=unsharded_bytes)
    return unsharded_bytes(largest) / total > LARGE_BLOCK_SHARE and len({_class_name(b) for _, b in blocks}) > 1


def _warn_if_suspect(module: nn.Module, prefix: str, blocks: list[tuple[str, nn.Module]]) -> None:
    """Warns when the detected blocks are :func:`_suspect`, naming ``block_types=``."""
    if _suspect(module, blocks):
        name, largest = max(blocks, key=lambda b: unsharded_bytes(b[1]))
        share = unsharded_bytes(largest) / unsharded_bytes(module)
        classes = {_class_name(b) for _, b in blocks}
        container = prefix or f"the top-level {_class_name(module)}"
        warnings.warn(
            f"thunder_overlap: the blocks found are the children of {container} ({', '.join(sorted(classes))}), and "
            f"{name!r} ({_class_name(largest)}) holds {share:.0%} of the model's parameters: prefetching (sized in "
            "blocks) and block/auto bucketing would treat it as one unit. Pass block_types= naming your transformer "
            "block class (such as litgpt's 'Block' or transformers' 'LlamaDecoderLayer').",
            stacklevel=3,
        )


def find_blocks(module: nn.Module, block_types: BlockTypes | None = None) -> list[tuple[str, nn.Module]]:
    """The blocks of ``module`` as (qualified name, module), in registration order.

    With ``block_types`` (see :func:`parse_block_types`): every outermost module of those types;
    a type that matches no module is an error. Without: the children of the ``nn.ModuleList`` or
    ``nn.Sequential`` holding the most parameters (empty when there is none), or, where that is a
    top-level stem/body/head whose body is a plain container of identical blocks, the body's
    children."""
    if block_types is not None:
        return _named_blocks(module, block_types)
    return _detected_blocks(module)


def unsharded_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s parameters, each shared tensor counted once. Works on meta tensors."""
    return sum(p.numel() * p.element_size() for p in module.parameters())


def largest_block_bytes(module: nn.Module, block_types: BlockTypes | None = None) -> int | None:
    blocks = find_blocks(module, block_types)
    return max((unsharded_bytes(b) for _, b in blocks), default=None)
