"""Trace transforms, one per file: ZeRO3 re-gathering, bucketing and overlap scheduling."""

from thunder_overlap.transforms.bucketing import BucketingTransform
from thunder_overlap.transforms.schedule import OverlapScheduleTransform
from thunder_overlap.transforms.zero3 import Zero3Transform

__all__ = ["BucketingTransform", "OverlapScheduleTransform", "Zero3Transform"]
