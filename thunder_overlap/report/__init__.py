"""What a schedule is worth: the report of the final traces, its pictures and plots, the policy
comparison and the ``python -m thunder_overlap report`` command line."""

from thunder_overlap.report._report import Report, report
from thunder_overlap.report._schedule_view import ScheduleStats, schedule_picture, schedule_stats

__all__ = ["Report", "ScheduleStats", "report", "schedule_picture", "schedule_stats"]
