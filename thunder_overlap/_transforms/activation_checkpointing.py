"""Activation checkpointing of every block: each keeps only its inputs for the backward, which
recomputes its activations ([Note: activation checkpointing] in docs/design.md).

- :class:`ActivationCheckpointingTransform` (``fsdp(..., activation_checkpointing=True)``) makes
  each block's forward call ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``, which
  Thunder traces: the block's outputs are tagged to be recomputed in the backward. The blocks are
  the ones prefetching and block buckets use (``block_types``, or those detected).
- :func:`refuse_reentrant_checkpoints` refuses, before tracing, a transformers model whose
  gradient checkpointing is reentrant (transformers' default), and :func:`explain_reentrant_checkpoints`
  makes a ``checkpoint(..., use_reentrant=True)`` met while tracing say what to pass instead (Thunder
  0.2.6 fails there with "exceptions must derive from BaseException").

Nothing here touches collectives: under ZeRO3 the recomputation needs the block's parameters, so
the re-gather Zero3Transform places in the backward serves both it and the gradients.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch.nn as nn
import torch.utils.checkpoint
from thunder.core.transform_common import Transform

from thunder_overlap._transforms._model_state import ModelState

__all__ = ["ActivationCheckpointingTransform", "checkpoint_blocks", "explain_reentrant_checkpoints", "refuse_reentrant_checkpoints"]

# Set on a block whose forward this module wrapped, so that a second wrap is not nested.
_WRAPPED_MARK = "_thunder_overlap_checkpointed"
_REENTRANT_FIX = "pass use_reentrant=False (Thunder traces only the non-reentrant checkpoint, which computes the same)"


def _checkpointed_forward(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    # Thunder's checkpoint takes positional arguments only: keywords are bound here.
    function = functools.partial(forward, **kwargs) if kwargs else forward
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)


def checkpoint_blocks(model: nn.Module, blocks: list[tuple[str, nn.Module]]) -> list[str]:
    """Makes every block of ``model`` (``blocks``, as :func:`find_blocks` finds them) checkpoint
    its forward; their names. A model without blocks is refused: there would be nothing to
    checkpoint, and the option would do nothing."""
    if not blocks:
        raise ValueError(
            f"activation_checkpointing=True: found no blocks in {type(model).__name__} to checkpoint (no nn.ModuleList or "
            "nn.Sequential of blocks); name the block classes with block_types=..."
        )
    for _, block in blocks:
        if not getattr(block, _WRAPPED_MARK, False):
            # A partial of the bound method, not a closure: a deep copy of the model (or a
            # pickle) then calls the copy's own forward.
            block.forward = functools.partial(_checkpointed_forward, block.forward)
            setattr(block, _WRAPPED_MARK, True)
    return [name for name, _ in blocks]


def refuse_reentrant_checkpoints(model: nn.Module) -> None:
    """Refuses a model whose transformers gradient checkpointing is reentrant: Thunder cannot trace
    it. transformers keeps the checkpoint function (a ``functools.partial`` of torch's, with its
    ``gradient_checkpointing_kwargs``) on each module that checkpoints its layers."""
    for name, module in model.named_modules():
        function = getattr(module, "_gradient_checkpointing_func", None)
        if not getattr(module, "gradient_checkpointing", False) or not isinstance(function, functools.partial):
            continue
        if function.func is torch.utils.checkpoint.checkpoint and function.keywords.get("use_reentrant", True):
            where = "model" if not name else f"model's submodule {name!r}"
            raise ValueError(
                f"{where} ({type(module).__name__}) checkpoints its layers with use_reentrant=True, transformers' default, "
                "which Thunder cannot trace: call model.gradient_checkpointing_enable("
                'gradient_checkpointing_kwargs={"use_reentrant": False}) instead'
            )


def _describe(function: Any) -> str:
    """A checkpointed function as a user wrote it: a module (or its bound method) by its class."""
    owner = getattr(function, "__self__", function)
    if isinstance(owner, nn.Module):
        return type(owner).__name__
    return getattr(function, "__qualname__", type(function).__name__)


def explain_reentrant_checkpoints() -> None:
    """Makes Thunder's tracing of ``torch.utils.checkpoint.checkpoint(..., use_reentrant=True)``
    raise a ValueError that says what to pass, in place of Thunder 0.2.6's "exceptions must derive
    from BaseException". Every other call goes to Thunder's own handling unchanged. Idempotent;
    it applies to every ``thunder.jit`` of this process, whose error it only makes readable."""
    from thunder.core.interpreter import do_raise
    from thunder.core.jit_ext import _general_jit_lookaside_map

    thunders = _general_jit_lookaside_map.get(torch.utils.checkpoint.checkpoint)
    if thunders is None or getattr(thunders, "_explains_reentrant", False):
        return

    @functools.wraps(thunders)
    def lookaside(function, *args, use_reentrant=False, **kwargs):
        from thunder.core.interpreter import unwrap

        if unwrap(use_reentrant):
            what = _describe(unwrap(function))
            return do_raise(ValueError(f"torch.utils.checkpoint.checkpoint({what}, ..., use_reentrant=True): {_REENTRANT_FIX}"))
        return thunders(function, *args, use_reentrant=use_reentrant, **kwargs)

    lookaside._explains_reentrant = True
    _general_jit_lookaside_map[torch.utils.checkpoint.checkpoint] = lookaside


class ActivationCheckpointingTransform(Transform):
    """Checkpoints every block of the module (the model ``state``'s) when Thunder builds it,
    before anything is traced. ``checkpointed`` names the blocks."""

    def __init__(self, state: ModelState) -> None:
        self.state = state
        self.checkpointed: list[str] = []

    def transform_module(self, model) -> None:
        self.checkpointed = checkpoint_blocks(model._model, self.state.find_blocks(model._model))
