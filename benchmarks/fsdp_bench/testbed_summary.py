"""The slow-link testbed's arithmetic: calibration bounds, per-implementation figures, targets.

A step that overlaps nothing takes the serial bound C + M; a perfect overlap takes max(C, M).
``gap_closed`` places a measured step time T between the two: 0 at the serial bound, 1 at the ideal.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

__all__ = ["SlowLinkCalibration", "ImplSummary", "calibrate", "summarize", "format_table", "target_checks"]

# The issue's targets, which apply at a setting where C and M are within BALANCE_LIMIT of each other.
BALANCE_LIMIT = 1.5
# thunder_overlap ZeRO3 at least 30% faster than Thunder's FSDP ZeRO3: T_thunder / T >= 1.3.
MIN_SPEEDUP_VS_THUNDER = 1.3
# ...and within 15% of the ideal max(C, M).
MAX_OVER_IDEAL = 1.15
# The simulator's prediction within 15% of the measured step time.
MAX_SIMULATOR_ERROR = 0.15
TARGET_IMPL = "thunder_overlap"
BASELINE_IMPL = "thunder"


def _round_median(run: dict) -> float:
    return statistics.median(run["iter_times_ms"])


@dataclass(frozen=True)
class SlowLinkCalibration:
    compute_ms: float  # C
    comm_ms: float  # M
    # C and M run at once with no dependencies between them: the fastest any schedule can be on
    # this machine, above max(C, M) by what communicating takes from computing (None: not measured).
    concurrent_ms: float | None = None

    @property
    def serial_ms(self) -> float:
        return self.compute_ms + self.comm_ms

    @property
    def ideal_ms(self) -> float:
        return max(self.compute_ms, self.comm_ms)

    @property
    def balance(self) -> float:
        """max(C, M) / min(C, M): 1 when compute and communication take equally long."""
        return self.ideal_ms / min(self.compute_ms, self.comm_ms)

    def gap_closed(self, step_ms: float) -> float:
        return (self.serial_ms - step_ms) / (self.serial_ms - self.ideal_ms)


def calibrate(compute_runs: list[dict], comm_runs: list[dict], concurrent_runs: list[dict] | None = None) -> SlowLinkCalibration:
    """C and M (and C with M concurrently), each the median over rounds. A compute-only rank
    steps the optimizer over the whole model where an FSDP rank steps 1/world_size of it, so C
    takes out the difference: C = step - (1 - 1/world_size) * optimizer time (and so does the
    concurrent run)."""

    def compute_ms(run: dict) -> float:
        surplus = 1 - 1 / run["world_size"]
        return _round_median(run) - surplus * statistics.median(run["optimizer_times_ms"])

    return SlowLinkCalibration(
        compute_ms=statistics.median(compute_ms(r) for r in compute_runs),
        comm_ms=statistics.median(_round_median(r) for r in comm_runs),
        concurrent_ms=statistics.median(compute_ms(r) for r in concurrent_runs) if concurrent_runs else None,
    )


@dataclass(frozen=True)
class ImplSummary:
    impl: str
    # Median over rounds of each round's median step time, and the spread of those.
    median_ms: float
    min_round_ms: float
    max_round_ms: float
    peak_memory_bytes: int
    # T / T_thunder (None when Thunder's FSDP was not measured).
    vs_thunder: float | None
    gap_closed: float
    over_ideal: float  # T / max(C, M)
    simulated_ms: float | None
    # T / (C with M concurrently), when measured.
    over_concurrent: float | None = None

    @property
    def simulator_error(self) -> float | None:
        if self.simulated_ms is None:
            return None
        return abs(self.simulated_ms - self.median_ms) / self.median_ms


def summarize(
    runs: dict[str, list[dict]], calibrations: dict[str, SlowLinkCalibration], simulated: dict[str, float | None]
) -> list[ImplSummary]:
    """``runs[impl]`` holds one result JSON per round; ``calibrations[impl]`` the C and M that
    bound it (M measured with the implementation's own bucketing)."""
    medians = {impl: [_round_median(r) for r in rs] for impl, rs in runs.items()}
    step = {impl: statistics.median(m) for impl, m in medians.items()}
    baseline = step.get(BASELINE_IMPL)
    return [
        ImplSummary(
            impl=impl,
            median_ms=step[impl],
            min_round_ms=min(medians[impl]),
            max_round_ms=max(medians[impl]),
            peak_memory_bytes=max(r["peak_memory_bytes"] for r in rs),
            vs_thunder=None if baseline is None else step[impl] / baseline,
            gap_closed=calibrations[impl].gap_closed(step[impl]),
            over_ideal=step[impl] / calibrations[impl].ideal_ms,
            simulated_ms=simulated.get(impl),
            over_concurrent=None if calibrations[impl].concurrent_ms is None else step[impl] / calibrations[impl].concurrent_ms,
        )
        for impl, rs in runs.items()
    ]


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(summaries: list[ImplSummary], calibrations: dict[str, SlowLinkCalibration]) -> str:
    """``calibrations`` by bucketing strategy; each implementation is placed between the bounds
    of its own strategy."""
    lines = []
    for bucketing, calibration in calibrations.items():
        lines.append(
            f"bucketing {bucketing}: C (compute only) = {calibration.compute_ms:.1f} ms, "
            f"M (communication only) = {calibration.comm_ms:.1f} ms, max/min = {calibration.balance:.2f}, "
            f"serial bound C+M = {calibration.serial_ms:.1f} ms, ideal max(C,M) = {calibration.ideal_ms:.1f} ms"
        )
        if calibration.concurrent_ms is not None:
            lines.append(
                f"  C and M at once, no dependencies = {calibration.concurrent_ms:.1f} ms "
                f"({calibration.concurrent_ms / calibration.ideal_ms:.3f} x max(C,M))"
            )
    lines += [
        "",
        f"{'impl':<22} {'median ms':>10} {'rounds ms':>15} {'vs thunder':>10} {'gap closed':>10} "
        f"{'/max(C,M)':>9} {'/at once':>8} {'peak MiB':>9} {'sim ms':>8} {'sim err':>8}",
    ]
    for s in summaries:
        lines.append(
            f"{s.impl:<22} {s.median_ms:>10.1f} {f'{s.min_round_ms:.0f}-{s.max_round_ms:.0f}':>15} "
            f"{_fmt(s.vs_thunder, '.3f'):>10} {s.gap_closed:>10.0%} {s.over_ideal:>9.3f} {_fmt(s.over_concurrent, '.3f'):>8} "
            f"{s.peak_memory_bytes / 2**20:>9.1f} {_fmt(s.simulated_ms, '.1f'):>8} {_fmt(s.simulator_error, '.0%'):>8}"
        )
    return "\n".join(lines)


def target_checks(summaries: list[ImplSummary], calibration: SlowLinkCalibration) -> list[str]:
    """One PASS/FAIL line per target of the issue, for thunder_overlap."""
    if calibration.balance > BALANCE_LIMIT:
        return [
            f"targets not evaluated: C and M differ by {calibration.balance:.2f}x (> {BALANCE_LIMIT}x); "
            "tune --rate-mbit (or the model/batch) until they are within 1.5x"
        ]
    by_impl = {s.impl: s for s in summaries}
    target = by_impl.get(TARGET_IMPL)
    if target is None:
        return [f"targets not evaluated: {TARGET_IMPL} was not measured"]

    def verdict(ok: bool) -> str:
        return "PASS" if ok else "FAIL"

    checks = []
    if target.vs_thunder is not None:
        speedup = 1 / target.vs_thunder
        checks.append(f"{verdict(speedup >= MIN_SPEEDUP_VS_THUNDER)} speedup vs thunder {speedup:.2f}x (>= {MIN_SPEEDUP_VS_THUNDER}x)")
    checks.append(f"{verdict(target.over_ideal <= MAX_OVER_IDEAL)} step / max(C,M) = {target.over_ideal:.3f} (<= {MAX_OVER_IDEAL})")
    if target.simulator_error is None:
        checks.append(f"simulator: no prediction for {TARGET_IMPL}")
    else:
        checks.append(
            f"{verdict(target.simulator_error <= MAX_SIMULATOR_ERROR)} simulator error {target.simulator_error:.1%} "
            f"(<= {MAX_SIMULATOR_ERROR:.0%})"
        )
    return checks
