"""Models FSDP must refuse before Thunder sees them, each with an error saying what is wrong.

- A module an earlier FSDP consumed: its parameters are this rank's shards (``fsdp``), or on the
  meta device (Thunder's own FSDP), and sharding the module again would shard shards or
  materialise freshly initialised weights, silently dropping the trained ones. The first ``fsdp``
  marks the module (``SHARDED_MARK``; Thunder's own FSDP sets ``use_fsdp``), and a module holding
  a marked one anywhere is refused.
- No parameters (Thunder: "cannot deal with modules other than the compiled module"), none
  trainable (Thunder finds no executor for the all-gather), or a 0-dim parameter (Thunder shards
  along dim 0: "Dimension specified as 0 but tensor has no dimensions").

The checks read only the module's attributes and parameters, at ``fsdp()`` and when Thunder
builds the module (first in :func:`thunder_overlap.fsdp_transforms`, so ``thunder.jit`` and the
plugin get them too); the training step does not run them.
"""

from __future__ import annotations

import torch.nn as nn
from thunder.core.transform_common import Transform

__all__ = ["SHARDED_MARK", "RefuseUnshardableTransform", "check_shardable"]

# Set on the original module by the first fsdp(), before Thunder's FSDP releases its parameters.
SHARDED_MARK = "_thunder_overlap_sharded"


def _sharded_by(module: nn.Module) -> str | None:
    """What an earlier FSDP did to ``module``'s parameters, or None."""
    if getattr(module, SHARDED_MARK, False):
        return "an earlier thunder_overlap.fsdp consumed it: its parameters are one rank's shards, so sharding it again would shard shards"
    if getattr(module, "use_fsdp", False):
        return (
            "an earlier Thunder's FSDP consumed it and moved its parameters to the meta device, so sharding it again "
            "would train freshly initialised weights"
        )
    return None


def check_not_sharded(model: nn.Module) -> None:
    """Refuses ``model`` if an earlier FSDP consumed it or any module inside it."""
    for name, module in model.named_modules():
        by = _sharded_by(module)
        if by is None:
            continue
        what = "model" if not name else f"model's submodule {name!r}"
        raise ValueError(f"{what} is already sharded with FSDP: {by}; pass the module that fsdp() returned, or a new unsharded model")


def check_parameters(model: nn.Module) -> None:
    """Refuses models FSDP cannot shard: no parameters, none trainable, or a 0-dim parameter."""
    parameters = list(model.named_parameters())
    if not parameters:
        raise ValueError(f"model ({type(model).__name__}) has no parameters: FSDP shards parameters, so there is nothing to shard")
    if not any(p.requires_grad for _, p in parameters):
        raise ValueError(
            f"model ({type(model).__name__}) has no trainable parameter: all {len(parameters)} have requires_grad=False. "
            "FSDP shards parameters to train them, and Thunder cannot run its all-gathers without one; "
            "unfreeze at least one parameter, or run the frozen model without FSDP"
        )
    scalars = [name for name, p in parameters if p.dim() == 0]
    if scalars:
        raise ValueError(
            f"model has 0-dim parameters {scalars}: FSDP shards every parameter along dim 0, which they lack; "
            "make each a 1-element tensor (nn.Parameter(torch.tensor([value])), which broadcasts the same), "
            "or register it as a buffer if it is not trained"
        )


def check_shardable(model: nn.Module) -> None:
    """Every check above, on the original (un-jitted) module."""
    check_not_sharded(model)
    check_parameters(model)


class RefuseUnshardableTransform(Transform):
    """Runs :func:`check_shardable` when Thunder builds the module, before FSDP shards it, then
    marks the module so that a second FSDP of it is refused."""

    def transform_module(self, model) -> None:
        original = model._model
        check_shardable(original)
        setattr(original, SHARDED_MARK, True)
