"""The one typed home for every scheduling knob of thunder_overlap."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["OverlapConfig", "ScheduleLimits", "SCHEDULING_POLICIES"]

# "heuristic": prefetch all-gathers in order of first use within the in-flight limits, issue
# reduce-scatters as soon as their gradient is complete, wait just in time (the Foundation policy).
# "stock": leave Thunder's order alone, for comparisons. With ZeRO3 the backward's re-gathers then
# all stay at its start, where the rewrite puts them, as Thunder <= 0.2.3 had them before it
# limited all-gathers in flight: a baseline for overlap, not a memory-sensible configuration.
SCHEDULING_POLICIES = ("heuristic", "stock")


def _check_optional_limit(name: str, value: object, kind: type) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, kind):
        raise TypeError(f"OverlapConfig.{name} must be a {kind.__name__} or None, got {value!r}")
    if value <= 0:
        raise ValueError(f"OverlapConfig.{name} must be positive or None (no limit), got {value!r}")


@dataclass(frozen=True)
class OverlapConfig:
    """Options of the overlap scheduler.

    The all-gather limits bound what is *in flight*: issued but not yet waited on. A limit of
    ``None`` means no limit of that kind. With every all-gather limit ``None`` the byte limit is
    derived from the model as ``prefetch_blocks`` times the unsharded bytes of its largest
    transformer block (see :func:`thunder_overlap.blocks.find_blocks`).
    """

    # Scheduling policy, one of SCHEDULING_POLICIES.
    policy: str = "heuristic"
    # Most all-gathers in flight at once (count).
    max_in_flight_allgathers: int | None = None
    # Most all-gather output bytes in flight at once.
    max_in_flight_allgather_bytes: int | None = None
    # Default byte limit in units of the largest block: 2 keeps the next two blocks' parameters
    # arriving while the current one computes (FSDP2 keeps about one, Thunder <= 0.2.3 kept 3 ops).
    prefetch_blocks: float = 2.0
    # Most reduce-scatter input bytes in flight; None: prefetch_blocks x the largest block.
    # Waiting on a reduce-scatter frees its unsharded gradient, so this bounds gradient memory.
    max_in_flight_reduce_scatter_bytes: int | None = None
    # All-gathers in flight when no limit is set and the model has no repeated blocks to size
    # one from: a few parameters ahead, rather than the whole model gathered at once.
    fallback_in_flight_allgathers: int = 4

    def __post_init__(self) -> None:
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"OverlapConfig.policy must be one of {SCHEDULING_POLICIES}, got {self.policy!r}")
        _check_optional_limit("max_in_flight_allgathers", self.max_in_flight_allgathers, int)
        _check_optional_limit("max_in_flight_allgather_bytes", self.max_in_flight_allgather_bytes, int)
        _check_optional_limit("max_in_flight_reduce_scatter_bytes", self.max_in_flight_reduce_scatter_bytes, int)
        if self.fallback_in_flight_allgathers is None:
            raise TypeError("OverlapConfig.fallback_in_flight_allgathers must be an int, got None")
        _check_optional_limit("fallback_in_flight_allgathers", self.fallback_in_flight_allgathers, int)
        if isinstance(self.prefetch_blocks, bool) or not isinstance(self.prefetch_blocks, (int, float)):
            raise TypeError(f"OverlapConfig.prefetch_blocks must be a number, got {self.prefetch_blocks!r}")
        if self.prefetch_blocks <= 0:
            raise ValueError(f"OverlapConfig.prefetch_blocks must be positive, got {self.prefetch_blocks!r}")

    def limits(self, largest_block_bytes: int | None) -> ScheduleLimits:
        """Resolves the limits the scheduler applies, given the model's largest block size
        (None when the model has no repeated blocks)."""
        block_limit = int(self.prefetch_blocks * largest_block_bytes) if largest_block_bytes else None
        allgather_bytes = self.max_in_flight_allgather_bytes
        allgathers = self.max_in_flight_allgathers
        if allgather_bytes is None and allgathers is None:
            allgather_bytes = block_limit
            if block_limit is None:
                allgathers = self.fallback_in_flight_allgathers
        reduce_scatter_bytes = self.max_in_flight_reduce_scatter_bytes
        if reduce_scatter_bytes is None:
            reduce_scatter_bytes = block_limit
        return ScheduleLimits(
            max_allgathers=allgathers,
            max_allgather_bytes=allgather_bytes,
            max_reduce_scatter_bytes=reduce_scatter_bytes,
        )


@dataclass(frozen=True)
class ScheduleLimits:
    """Concrete in-flight limits the scheduler enforces (None: unlimited)."""

    max_allgathers: int | None = None
    max_allgather_bytes: int | None = None
    max_reduce_scatter_bytes: int | None = None
