"""Transformer blocks of a model: the unit of prefetching and of block bucketing."""

from __future__ import annotations

import torch.nn as nn

__all__ = ["find_blocks", "unsharded_bytes", "largest_block_bytes"]


def find_blocks(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The repeated blocks of ``module``: the children of its ``nn.ModuleList`` or
    ``nn.Sequential`` holding the most parameters (a GPT's ``transformer.h``, a Llama's
    ``layers``). Empty when the model has no such container."""
    best: tuple[int, str, nn.Module] | None = None
    for name, sub in module.named_modules():
        if not isinstance(sub, (nn.ModuleList, nn.Sequential)) or len(sub) < 2:
            continue
        size = unsharded_bytes(sub)
        if best is None or size > best[0]:
            best = (size, name, sub)
    if best is None:
        return []
    _, prefix, container = best
    return [(f"{prefix}.{child_name}" if prefix else child_name, child) for child_name, child in container.named_children()]


def unsharded_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s parameters, each shared tensor counted once. Works on meta tensors."""
    return sum(p.numel() * p.element_size() for p in module.parameters())


def largest_block_bytes(module: nn.Module) -> int | None:
    blocks = find_blocks(module)
    return max((unsharded_bytes(b) for _, b in blocks), default=None)
