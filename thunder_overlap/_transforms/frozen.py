"""Freezing or unfreezing a parameter after ``fsdp()``: refused, naming the parameter.

Which parameters get gradients is fixed when the model is sharded: Thunder's FSDP traces a
reduce-scatter for each trainable shard, buckets lay out their gradients, and the prologue of
every compiled trace asserts each parameter's ``requires_grad``. A flag changed afterwards fails
there with an ``AssertionError`` that names no parameter (Thunder's own FSDP fails the same way).
This transform checks the flags before each call instead and says what to do.
"""

from __future__ import annotations

from thunder.core.transform_common import Transform

__all__ = ["RefuseRequiresGradChangeTransform"]


class RefuseRequiresGradChangeTransform(Transform):
    """Records each parameter's ``requires_grad`` when the module is built; before every call,
    raises RuntimeError naming the parameters whose flag changed since."""

    def transform_module(self, model) -> None:
        planned = {name: p.requires_grad for name, p in model.named_parameters()}

        def check(module, args) -> None:
            # A name not planned (a tied parameter untied by load_state_dict(assign=True)) is the buckets' to refuse.
            changed = [name for name, p in module.named_parameters() if name in planned and p.requires_grad != planned[name]]
            if changed:
                shown = ", ".join(f"{name!r} ({planned[name]} -> {not planned[name]})" for name in changed)
                raise RuntimeError(
                    f"thunder_overlap: requires_grad changed after fsdp() for {shown}. Which parameters get gradients "
                    "(their reduce-scatters and buckets) is fixed when the model is sharded: set requires_grad before "
                    "thunder_overlap.fsdp(), and shard a new model to change it"
                )

        model.register_forward_pre_hook(check)
