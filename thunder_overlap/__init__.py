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

Under ``python -m thunder_overlap ...`` the public names below load on first use (PEP 562), so
that ``--help`` and the commands' usage errors answer without importing torch or Thunder. A
program that imports the package gets them at once, with Thunder imported (its
``transformer_engine module not found!`` import warning dropped) and the ``"fsdp-overlap"``
plugin registered: ``thunder.compile(model, plugins="fsdp-overlap")`` works after
``import thunder_overlap``.
"""

from __future__ import annotations

import importlib

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
    """Imports Thunder (without its known import warning), registers the ``"fsdp-overlap"``
    plugin and binds every public name. Binding them all at once also settles ``report``: the
    subpackage ``thunder_overlap.report``, once imported, is an attribute of this package of the
    same name as the function, which must win."""
    _console.import_thunder_quietly()
    from thunder_overlap.plugin import register

    register()
    for name, module in _EXPORTS.items():
        globals()[name] = getattr(importlib.import_module(module), name)


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'thunder_overlap' has no attribute {name!r}")
    _load_exports()  # under a command, its first use of the library
    return globals()[name]


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


# `python -m thunder_overlap ...` imports this package before any command runs: there nothing
# heavy is imported until a command needs it, and Thunder's known import-time warnings are
# dropped for the whole command. A program that uses the library gets everything at import.
if _console.invoked_as_command():
    _console.silence_known_warnings()
else:
    _load_exports()
