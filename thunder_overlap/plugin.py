"""The ``"fsdp-overlap"`` Thunder plugin: ``thunder.compile(model, plugins="fsdp-overlap")``."""

from __future__ import annotations

import torch
import torch.distributed as dist
from thunder import Plugin
from thunder.distributed import FSDPBucketingStrategy, FSDPType

from thunder_overlap.api import _resolve, _setup_transforms
from thunder_overlap.config import OverlapConfig
from thunder_overlap.transforms.executor import overlap_executor

__all__ = ["FSDPOverlap", "PLUGIN_NAME", "register"]

PLUGIN_NAME = "fsdp-overlap"


class FSDPOverlap(Plugin):
    """The transforms of :func:`thunder_overlap.fsdp` as a plugin; same arguments and checks.

    By name (``plugins="fsdp-overlap"``) it runs with defaults (ZeRO2); pass an instance, e.g.
    ``plugins=[FSDPOverlap(sharding_strategy="zero3")]``, to choose options.
    """

    def __init__(
        self,
        device: torch.device | str | None = None,
        sharding_strategy: FSDPType | str = FSDPType.ZERO2,
        bucketing_strategy: FSDPBucketingStrategy | str = FSDPBucketingStrategy.NONE,
        process_group: dist.ProcessGroup | None = None,
        broadcast_from: int | None = None,
        config: OverlapConfig | None = None,
        move_state_dict_to_cpu: bool = False,
        bucket_cap_mb: float | None = None,
    ) -> None:
        self.setup = _resolve(
            device,
            process_group,
            sharding_strategy,
            bucketing_strategy,
            broadcast_from,
            config,
            move_state_dict_to_cpu,
            bucket_cap_mb,
        )

    def setup_executors(self):
        # Plugin executors come before the recipe's, whose fuser (torch.compile on CPU) could
        # otherwise swallow the collectives; the recipe's list is not known here.
        return [overlap_executor]

    def setup_transforms(self):
        return _setup_transforms(self.setup)


def register() -> None:
    from thunder.plugins import register_plugin

    register_plugin(PLUGIN_NAME, FSDPOverlap)
