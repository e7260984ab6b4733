"""Trace transforms, one per file: activation checkpointing of every block, mixed precision's
casts, ZeRO3 re-gathering, bucketing, hybrid sharding's all-reduce across replicas, overlap
scheduling, the refusal of no_sync where there are no buckets to accumulate in, of models FSDP
cannot shard (or already sharded), of ranks whose initial weights differ, and of parameters frozen
or unfrozen after sharding; and the shards placed in the original module. One model's transforms
share its state (``_model_state``) and never each other ([Note: model state])."""

from thunder_overlap._transforms.activation_checkpointing import ActivationCheckpointingTransform
from thunder_overlap._transforms.bucketing import BucketingTransform
from thunder_overlap._transforms.frozen import RefuseRequiresGradChangeTransform
from thunder_overlap._transforms.in_place import ShardsInPlaceTransform
from thunder_overlap._transforms.mixed_precision import MixedPrecisionTransform
from thunder_overlap._transforms.no_sync import RefuseNoSyncTransform
from thunder_overlap._transforms.replicate import ReplicaReduceTransform
from thunder_overlap._transforms.same_init import RefuseDifferentInitTransform
from thunder_overlap._transforms.schedule import OverlapScheduleTransform
from thunder_overlap._transforms.shardable import RefuseUnshardableTransform
from thunder_overlap._transforms.zero3 import Zero3Transform

__all__ = [
    "ActivationCheckpointingTransform",
    "BucketingTransform",
    "MixedPrecisionTransform",
    "OverlapScheduleTransform",
    "RefuseDifferentInitTransform",
    "RefuseNoSyncTransform",
    "RefuseRequiresGradChangeTransform",
    "RefuseUnshardableTransform",
    "ReplicaReduceTransform",
    "ShardsInPlaceTransform",
    "Zero3Transform",
]
