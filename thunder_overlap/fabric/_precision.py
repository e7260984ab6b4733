"""Fabric's ``precision=`` as thunder_overlap runs it ([Note: Fabric strategy] in docs/design.md).

``"32-true"`` and ``"bf16-true"`` keep Fabric's plugins: the model is built (and its inputs cast)
in that dtype, and thunder_overlap shards what it is given. ``"bf16-mixed"`` is not autocast here:
it becomes ``MixedPrecision(torch.bfloat16, torch.float32)``, which gathers and computes in bf16
over float32 masters and reduce-scatters in float32, and Fabric's plugin is swapped for one that
leaves the forward alone (autocast around a Thunder program would cast nothing it gathers).
"""

from __future__ import annotations

import torch
from lightning.fabric.plugins.precision import Precision

from thunder_overlap.options import MixedPrecision

ACCEPTED = ("32-true", "bf16-true", "bf16-mixed")
BF16_MIXED = MixedPrecision(torch.bfloat16, torch.float32)


class _Bf16MixedPrecision(Precision):
    """Fabric's view of ``"bf16-mixed"``: nothing around the forward; the casts are the model's."""

    precision = "bf16-mixed"


def resolve_precision(plugin: Precision, mixed_precision: MixedPrecision | None) -> tuple[Precision, MixedPrecision | None]:
    """The plugin Fabric should use and the ``MixedPrecision`` to shard with, for Fabric's
    ``plugin`` and the strategy's own ``mixed_precision``; a clear error for what cannot be honoured."""
    name = getattr(plugin, "precision", None)
    if name == "16-mixed":
        raise ValueError(
            "Fabric(precision='16-mixed') needs a gradient scaler that unscales sharded gradients, which thunder_overlap "
            f"does not have; use one of {', '.join(repr(p) for p in ACCEPTED)} ('bf16-mixed' needs no scaler)"
        )
    if name not in ACCEPTED:
        raise ValueError(
            f"FSDPOverlapStrategy supports Fabric(precision=...) {', '.join(repr(p) for p in ACCEPTED)}, "
            f"got {name!r} (plugin {type(plugin).__name__})"
        )
    if name != "bf16-mixed":
        return plugin, mixed_precision
    if mixed_precision is not None and mixed_precision != BF16_MIXED:
        raise ValueError(
            f"Fabric(precision='bf16-mixed') means mixed_precision={BF16_MIXED!r}, but the strategy was given "
            f"mixed_precision={mixed_precision!r}: pass one of them (with precision='32-true', the strategy's is used)"
        )
    return _Bf16MixedPrecision(), BF16_MIXED
