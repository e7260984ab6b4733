"""Where a CUDA step peaks, and what is alive there, by the trace line that allocated it.

``torch.cuda.max_memory_allocated`` says how high a step went, not why. This records the caching
allocator's history over one step, replays its allocations and frees, finds the moment the most
bytes were allocated, and groups what the step had allocated and not yet freed then by where it
was allocated: the line of Thunder's generated trace (its programs are in ``linecache``), else
the first frame of thunder_overlap, else the innermost Python frame. What was alive before the
step (parameters, optimizer state, the bucket pool) is one figure, ``start_bytes``.
"""

from __future__ import annotations

import linecache
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

__all__ = ["LiveGroup", "StepPeak", "record_step_peak", "step_peak"]

# Enough entries for a step of a few-layer Llama in the torch executor (thousands of allocations).
_MAX_HISTORY_ENTRIES = 1_000_000
# Groups listed at the peak; the rest are summed into one line.
_GROUPS_LISTED = 40


@dataclass(frozen=True)
class LiveGroup:
    where: str
    bytes: int
    allocations: int


@dataclass(frozen=True)
class StepPeak:
    # Bytes allocated when the step began.
    start_bytes: int
    # The most bytes allocated during the step, beyond ``start_bytes``.
    peak_over_start_bytes: int
    # The allocation that reached the peak, and its place among the step's allocator events.
    peak_allocation: str
    peak_event: int
    events: int
    # What the step allocated and had not freed at the peak, largest first.
    live_at_peak: list[LiveGroup] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


def _where(frames: list[dict]) -> str:
    for frame in frames:
        filename = frame.get("filename", "")
        if filename.startswith("thunder.") and "/" not in filename:
            code = linecache.getline(filename, frame.get("line", 0)).strip()
            return f"{filename}:{frame.get('line')} {code}"
    for frame in frames:
        if "thunder_overlap/" in frame.get("filename", ""):
            return f"{frame['filename'].rsplit('thunder_overlap/', 1)[1]}:{frame.get('line')} {frame.get('name')}"
    if frames:
        return f"{frames[0].get('filename')}:{frames[0].get('line')} {frames[0].get('name')}"
    return "(no Python frame)"


def step_peak(events: list[dict], start_bytes: int) -> StepPeak:
    """The peak of one step's allocator ``events`` (a device trace of
    ``torch.cuda.memory._snapshot()``). An allocation counts from its ``alloc`` to its
    ``free_requested``, as ``memory_allocated`` does (a block kept for another stream's use is
    no longer counted as allocated)."""
    live: dict[int, dict] = {}
    current = peak = 0
    peak_event = -1
    for i, event in enumerate(events):
        if event["action"] == "alloc":
            live[event["addr"]] = event
            current += event["size"]
            if current > peak:
                peak, peak_event = current, i
        elif event["action"] == "free_requested" and event["addr"] in live:
            current -= live.pop(event["addr"])["size"]
    # Replay again up to the peak for what was alive there (cheaper than copying at every rise).
    live.clear()
    for event in events[: peak_event + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
        elif event["action"] == "free_requested":
            live.pop(event["addr"], None)
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for event in live.values():
        group = groups[_where(event.get("frames", []))]
        group[0] += event["size"]
        group[1] += 1
    ranked = sorted((LiveGroup(w, b, n) for w, (b, n) in groups.items()), key=lambda g: -g.bytes)
    listed, rest = ranked[:_GROUPS_LISTED], ranked[_GROUPS_LISTED:]
    if rest:
        listed.append(LiveGroup(f"({len(rest)} more places)", sum(g.bytes for g in rest), sum(g.allocations for g in rest)))
    return StepPeak(
        start_bytes=start_bytes,
        peak_over_start_bytes=peak,
        peak_allocation=_where(events[peak_event].get("frames", [])) if peak_event >= 0 else "",
        peak_event=peak_event,
        events=len(events),
        live_at_peak=listed,
    )


def record_step_peak(step: Callable[[], object], device: torch.device) -> StepPeak:
    """Runs ``step`` once with the allocator's history recorded and returns its peak."""
    torch.cuda.synchronize(device)
    start_bytes = torch.cuda.memory_allocated(device)
    torch.cuda.memory._record_memory_history(context="alloc", stacks="python", max_entries=_MAX_HISTORY_ENTRIES)
    try:
        step()
        torch.cuda.synchronize(device)
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return step_peak(snapshot["device_traces"][device.index or 0], start_bytes)
