"""Deciding where each collective is issued and waited on around Thunder's fixed compute order,
within the prefetch, in-flight and memory limits (and, when given, a fixed issue order).

:func:`schedule_trace` is the entry point; :class:`OverlapScheduler` the scheduler itself."""

from thunder_overlap._scheduling.dispatch import ScheduledTrace, schedule_trace
from thunder_overlap._scheduling.issue_order import IssueOrder, issue_sequence
from thunder_overlap._scheduling.orders import apply_order, stock_order
from thunder_overlap._scheduling.scheduler import OverlapScheduler, just_in_time_order
from thunder_overlap._scheduling.summary import HeldBack, ScheduleSummary

__all__ = [
    "HeldBack",
    "IssueOrder",
    "OverlapScheduler",
    "ScheduleSummary",
    "ScheduledTrace",
    "apply_order",
    "issue_sequence",
    "just_in_time_order",
    "schedule_trace",
    "stock_order",
]
