"""Lightning Fabric's strategy for thunder_overlap's FSDP.

    from lightning.fabric import Fabric
    from thunder_overlap.fabric import FSDPOverlapStrategy

    fabric = Fabric(accelerator="cuda", devices=8, precision="bf16-mixed",
                    strategy=FSDPOverlapStrategy(sharding_strategy="zero3", bucketing_strategy="block"))

Importing this module registers the strategy with Fabric by name: ``Fabric(strategy="thunder_overlap")``
is ``FSDPOverlapStrategy()``. Needs Lightning (``pip install 'thunder_overlap[fabric]'``).
"""

from __future__ import annotations

try:
    from lightning.fabric.strategies import STRATEGY_REGISTRY
except ImportError as error:  # pragma: no cover - the extra is missing
    raise ImportError(
        "thunder_overlap.fabric needs Lightning Fabric: pip install 'thunder_overlap[fabric]' (lightning 2.6)"
    ) from error

from thunder_overlap.fabric._strategy import FSDPOverlapStrategy

__all__ = ["FSDPOverlapStrategy"]

if "thunder_overlap" not in STRATEGY_REGISTRY:
    FSDPOverlapStrategy.register_strategies(STRATEGY_REGISTRY)
