"""The ``"fsdp-overlap"`` Thunder plugin: ``thunder.compile(model, plugins="fsdp-overlap")``."""

from __future__ import annotations

from typing import Any

from thunder import Plugin

from thunder_overlap._ops import overlap_executor
from thunder_overlap.api import fsdp_transforms
from thunder_overlap.options import FSDPOptions, options_from

__all__ = ["FSDPOverlap", "PLUGIN_NAME", "register"]

PLUGIN_NAME = "fsdp-overlap"


class FSDPOverlap(Plugin):
    """The transforms of :func:`thunder_overlap.fsdp` as a plugin; same options and checks.

    Pass resolved ``options`` or the keywords of :meth:`FSDPOptions.resolve`, e.g.
    ``plugins=[FSDPOverlap(sharding_strategy="zero3")]``. By name (``plugins="fsdp-overlap"``)
    it runs with defaults (ZeRO2).
    """

    def __init__(self, options: FSDPOptions | None = None, /, **option_kwargs: Any) -> None:
        self.options = options_from(options, option_kwargs, "FSDPOverlap")

    def setup_executors(self):
        # Plugin executors come before the recipe's, whose fuser (torch.compile on CPU) could
        # otherwise swallow the collectives; the recipe's list is not known here.
        return [overlap_executor]

    def setup_transforms(self):
        return fsdp_transforms(self.options)


def register() -> None:
    from thunder.plugins import register_plugin

    register_plugin(PLUGIN_NAME, FSDPOverlap)
