"""What one scheduling pass decided and why, for reports, tests and the log."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["HeldBack", "ScheduleSummary"]


@dataclass
class HeldBack:
    """Collectives (indices into ``AnnotatedTrace.collectives``) that each limit kept from being
    issued earlier, in any of the budget's attempts (so a pass that fell back to the just-in-time
    order still says what held it). One collective can be held by several limits in turn."""

    # Too many expensive compute ops before its first use (PrefetchDistance).
    distance: set[int] = field(default_factory=set)
    # All-gather count or bytes in flight (AllGatherLimit).
    in_flight: set[int] = field(default_factory=set)
    # Predicted memory over budget (MemoryBudget).
    memory: set[int] = field(default_factory=set)
    # A predecessor in the given IssueOrder was not issued yet.
    issue_order: set[int] = field(default_factory=set)


@dataclass
class ScheduleSummary:
    """What the scheduler decided and why, for reports and tests."""

    # Waits the chosen order places before their first use to get under a limit (bytes/count, or
    # the budget); none in the just-in-time order.
    forced_waits: int = 0
    forced_waits_for_memory: int = 0
    # Predicted peaks (estimate_memory) of the just-in-time order the budget is relative to (for a
    # backward, the just-in-time step's: after its forward's just-in-time order) and of the chosen order.
    baseline_peak_bytes: int | None = None
    budget_bytes: int | None = None
    peak_bytes: int | None = None
    # A forward's budget where its backward's just-in-time peak is higher than its own budget
    # (that peak; else None): [Note: the step's budget].
    step_peak_bytes: int | None = None
    attempts: int = 0
    fell_back_to_just_in_time: bool = False
    # Coalesced launches in the final trace and the collectives they carry (scheduling/launches.py).
    coalesced_launches: int = 0
    coalesced_collectives: int = 0
    held: HeldBack = field(default_factory=HeldBack)

    @property
    def held_by_distance(self) -> int:
        return len(self.held.distance)

    @property
    def held_by_memory(self) -> int:
        return len(self.held.memory)

    @property
    def budget_bound(self) -> bool:
        """Whether the budget changed the order at all: a collective held back or a wait forced by
        memory, a retry after an order over the budget, or the fall-back to just in time."""
        return bool(self.held_by_memory or self.forced_waits_for_memory or self.attempts > 1 or self.fell_back_to_just_in_time)

    def describe(self) -> str:
        """One line for the log."""
        held = self.held
        line = (
            f"held back by distance {len(held.distance)}, in flight {len(held.in_flight)}, memory {len(held.memory)}, "
            f"issue order {len(held.issue_order)}; forced waits {self.forced_waits} ({self.forced_waits_for_memory} for memory)"
        )
        if self.budget_bytes is not None:
            line += (
                f"; peak {self.peak_bytes} B of budget {self.budget_bytes} B (just-in-time {self.baseline_peak_bytes} B)"
                f" after {self.attempts} attempt(s)"
            )
            if self.step_peak_bytes is not None:
                line += ", the backward's just-in-time peak"
        if self.coalesced_launches:
            line += f"; {self.coalesced_collectives} collectives coalesced into {self.coalesced_launches} launches"
        if self.fell_back_to_just_in_time:
            line += "; fell back to the just-in-time order"
        return line
