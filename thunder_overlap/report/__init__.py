"""What a schedule is worth: the report of the final traces, its pictures and plots, the policy
comparison and the ``python -m thunder_overlap report`` command line.

The names below load on first use (PEP 562): the command line imports this package before it
parses its arguments, and its ``--help`` and usage errors import neither torch nor Thunder."""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Report": "thunder_overlap.report._report",
    "ScheduleStats": "thunder_overlap.report._schedule_view",
    "report": "thunder_overlap.report._report",
    "schedule_picture": "thunder_overlap.report._schedule_view",
    "schedule_stats": "thunder_overlap.report._schedule_view",
}

__all__ = ["Report", "ScheduleStats", "report", "schedule_picture", "schedule_stats"]


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'thunder_overlap.report' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
