"""thunder_overlap: FSDP for Lightning Thunder whose communication overlaps compute.

    import thunder_overlap
    model = thunder_overlap.fsdp(model, sharding_strategy="zero3")
    # hybrid sharding: shard within a node, replicate across nodes
    model = thunder_overlap.fsdp(model, sharding_strategy="zero3", device_mesh=init_device_mesh("cuda", (nodes, 8)))

Data flows one way, and the subpackages follow it: model -> Thunder's FSDP transform and
``transforms`` (ZeRO3, ``bucketing``, HSDP's all-reduce) -> execution traces -> ``analysis`` (annotated trace, cost
and memory estimates) -> ``scheduling`` (decisions) -> executed trace -> ``report``. ``checkpoint``
saves and loads the sharded state at any world size; ``tools`` holds the scaffolding of tests,
benchmarks and the demo.
"""

from thunder_overlap import _console

# `python -m thunder_overlap ...` imports this package (and so thunder) before any command runs;
# only there are Thunder's known import-time warnings dropped. Programs using the library see them.
if _console.invoked_as_command():
    _console.silence_known_warnings()

from thunder_overlap._analysis.cost_model import CostModel
from thunder_overlap._transforms import BucketingTransform, OverlapScheduleTransform, ReplicaReduceTransform, Zero3Transform
from thunder_overlap.api import fsdp, fsdp_transforms
from thunder_overlap.config import OverlapConfig
from thunder_overlap.options import BucketingStrategy, FSDPOptions, ShardingStrategy
from thunder_overlap.plugin import FSDPOverlap
from thunder_overlap.plugin import register as _register_plugin
from thunder_overlap.report._report import Report, report
from thunder_overlap.report._schedule_view import ScheduleStats, schedule_picture, schedule_stats

__all__ = [
    "BucketingStrategy",
    "BucketingTransform",
    "CostModel",
    "FSDPOptions",
    "FSDPOverlap",
    "OverlapConfig",
    "OverlapScheduleTransform",
    "ReplicaReduceTransform",
    "Report",
    "ScheduleStats",
    "ShardingStrategy",
    "Zero3Transform",
    "fsdp",
    "fsdp_transforms",
    "report",
    "schedule_picture",
    "schedule_stats",
]
__version__ = "0.1.0"

_register_plugin()
