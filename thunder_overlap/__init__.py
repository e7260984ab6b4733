"""thunder_overlap: FSDP for Lightning Thunder whose communication overlaps compute.

    import thunder_overlap
    model = thunder_overlap.fsdp(model, sharding_strategy="zero3")
    # hybrid sharding: shard within a node, replicate across nodes
    model = thunder_overlap.fsdp(model, sharding_strategy="zero3", device_mesh=init_device_mesh("cuda", (nodes, 8)))

Data flows one way, and the subpackages follow it: model -> Thunder's FSDP transform and
``_transforms`` (ZeRO3, bucketing, HSDP's all-reduce) -> execution traces -> ``_analysis``
(annotated trace, cost and memory estimates) -> ``_scheduling`` (decisions) -> executed trace ->
``report``. ``checkpoint`` saves and loads the sharded state at any world size; ``testing``
holds the scaffolding of tests, benchmarks and the demo. Imports follow the same layers
([Note: stages] in docs/design.md).

The package imports nothing heavy: the public names below load on first use (PEP 562), all at
once, for every importer alike, so that ``python -m thunder_overlap --help`` and the commands'
usage errors answer without importing torch or Thunder. Thunder 0.2.6 has no plugin entry points:
``thunder.compile`` imports ``thunder.plugins`` and looks plugin names up in its registry. So the
``"fsdp-overlap"`` plugin is registered right after that module is imported (at once, where it
was imported before this package), and ``thunder.compile(model, plugins="fsdp-overlap")`` works
after ``import thunder_overlap``. Thunder's ``transformer_engine module not found!`` import
warning is dropped when Thunder is imported after this package (by it or by the program); only
that warning, only while Thunder imports (the import hook below).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from importlib.machinery import ModuleSpec

from thunder_overlap import _console

# Each public name and the module that defines it.
_EXPORTS: dict[str, str] = {
    "BucketingStrategy": "thunder_overlap.options",
    "BucketingTransform": "thunder_overlap._transforms",
    "CostModel": "thunder_overlap._analysis.cost_model",
    "FSDPOptions": "thunder_overlap.options",
    "FSDPOverlap": "thunder_overlap.plugin",
    "MemoryBudgetTooSmall": "thunder_overlap._scheduling.unsharding",
    "MixedPrecision": "thunder_overlap.options",
    "OverlapConfig": "thunder_overlap.config",
    "OverlapScheduleTransform": "thunder_overlap._transforms",
    "ReplicaReduceTransform": "thunder_overlap._transforms",
    "Report": "thunder_overlap.report._report",
    "ScheduleStats": "thunder_overlap.report._schedule_view",
    "ShardingStrategy": "thunder_overlap.options",
    "StepPrediction": "thunder_overlap._scheduling.unsharding",
    "UnshardingChoice": "thunder_overlap._scheduling.unsharding",
    "Zero3Transform": "thunder_overlap._transforms",
    "clip_grad_norm_": "thunder_overlap.clip_grad",
    "clip_grad_value_": "thunder_overlap.clip_grad",
    "fsdp": "thunder_overlap.api",
    "fsdp_transforms": "thunder_overlap.api",
    "grad_norm": "thunder_overlap.clip_grad",
    "report": "thunder_overlap.report._report",
    "schedule_picture": "thunder_overlap.report._schedule_view",
    "schedule_stats": "thunder_overlap.report._schedule_view",
}

__all__ = [
    "BucketingStrategy",
    "BucketingTransform",
    "CostModel",
    "FSDPOptions",
    "FSDPOverlap",
    "MemoryBudgetTooSmall",
    "MixedPrecision",
    "OverlapConfig",
    "OverlapScheduleTransform",
    "ReplicaReduceTransform",
    "Report",
    "ScheduleStats",
    "ShardingStrategy",
    "StepPrediction",
    "UnshardingChoice",
    "Zero3Transform",
    "clip_grad_norm_",
    "clip_grad_value_",
    "fsdp",
    "fsdp_transforms",
    "grad_norm",
    "report",
    "schedule_picture",
    "schedule_stats",
]
__version__ = "0.1.0"


def _load_exports() -> None:
    """Binds every public name, at the first use of one. Binding them all at once also settles
    ``report``: the function, not the subpackage of that name (see :class:`_Package`)."""
    for name, module in _EXPORTS.items():
        globals()[name] = getattr(importlib.import_module(module), name)


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'thunder_overlap' has no attribute {name!r}")
    _load_exports()
    return globals()[name]


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


class _Package(types.ModuleType):
    """This package's module type. Importing a subpackage binds it to the package's attribute of
    its name; for ``thunder_overlap.report`` that attribute is the public function ``report``, so
    the binding is dropped (``thunder_overlap.report`` still imports, and ``sys.modules`` has it)."""

    def __setattr__(self, name: str, value: object) -> None:
        if name in _EXPORTS and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


# The import hook. The package no longer imports Thunder itself, so what it did while importing
# Thunder happens when Thunder's own modules are imported, by whoever imports them: a finder first
# on sys.meta_path runs the loading of ``thunder`` inside _console.known_warnings_ignored() and, once
# ``thunder.plugins`` has run (thunder.compile imports it, ``import thunder`` does not), registers
# the plugin. Each module is handled once, and the finder leaves sys.meta_path when both are. A
# module imported before this package needs nothing (``thunder``: its warning was given) or is
# handled at once (``thunder.plugins``: the plugin is registered while this package imports).
THUNDER, THUNDER_PLUGINS = "thunder", "thunder.plugins"


def _register_plugin() -> None:
    from thunder_overlap.plugin import register

    register()


class _ThunderImportHook:
    """Finds nothing itself: it hands the spec another finder gives for one of :attr:`pending`
    to a loader that runs the original one (see the import hook's comment)."""

    def __init__(self, pending: set[str]) -> None:
        self.pending = pending

    def find_spec(self, fullname: str, path=None, target=None) -> ModuleSpec | None:
        if fullname not in self.pending:
            return None
        self.pending.discard(fullname)
        if not self.pending:
            sys.meta_path.remove(self)
        # The other finders: this one answers None for fullname now.
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _HookedLoader(spec.loader)
        return spec


class _HookedLoader:
    """Runs the original loader, then what the import hook does for that module."""

    def __init__(self, loader) -> None:
        self.loader = loader

    def create_module(self, spec: ModuleSpec) -> types.ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        # The module keeps its own loader; this one leaves no trace.
        module.__loader__ = module.__spec__.loader = self.loader
        if module.__name__ == THUNDER:
            with _console.known_warnings_ignored():
                self.loader.exec_module(module)
        else:
            self.loader.exec_module(module)
            _register_plugin()


def _install_import_hook() -> None:
    if THUNDER_PLUGINS in sys.modules:
        _register_plugin()
        return
    if any(isinstance(finder, _ThunderImportHook) for finder in sys.meta_path):
        return
    pending = {THUNDER_PLUGINS} | ({THUNDER} if THUNDER not in sys.modules else set())
    sys.meta_path.insert(0, _ThunderImportHook(pending))


_install_import_hook()
