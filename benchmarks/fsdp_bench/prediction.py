"""The Measuring stick's simulator, calibrated to the testbed, predicting a run's step time.

Calibration uses the testbed's measured numbers and nothing else:
- compute: the CPU cost model's per-op estimates are scaled so that the trace's compute sums to
  the measured compute-only step C (op *proportions* come from the roofline, the total from C;
  timing every op on this CPU instead moved the 8-layer prediction by under 0.5%);
- link: a ring with a per-collective latency and a bus bandwidth (the cost model's
  ``latency * (n - 1) + bytes / bandwidth`` form), on which gloo runs two launches at once
  (``NetworkProfile.concurrent_launches``). Each communication-only run M replays one bucketing
  strategy's collectives with the schedule's in-flight pattern and no compute, which the
  simulator replays the same way; with two or more strategies measured (same bytes, different
  numbers of collectives) the latency and the bandwidth are fitted to all of them by least
  squares on relative error. With one, the latency is zero and the bandwidth alone makes that
  strategy's collectives take M.
- overlap: when the testbed measured C and M at once (no dependencies between them), compute is
  slowed by the factor that makes that run's simulation take what it measured: with the
  communication busy from 0 to M, T = M + C - M / (1 + slowdown) (see fit_overlap_slowdown).
The simulator then places the implementation's own schedule on the two streams; everything the
prediction says about overlap comes from that schedule.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import thunder
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from thunder_overlap import CostModel
from thunder_overlap._analysis.classify import AnnotatedTrace, classify_trace
from thunder_overlap._analysis.cost_model import (
    DeviceProfile,
    NetworkProfile,
    device_profile,
    network_profile,
)
from thunder_overlap._analysis.simulator import Simulation, simulate
from thunder_overlap._backends import GLOO
from thunder_overlap.options import parse_sharding_strategy
from thunder_overlap.report._models import trace_model
from thunder_overlap.report._report import module_layouts

from fsdp_bench.bench_config import OVERLAP_OPTIONS, variant_config
from fsdp_bench.bench_models import build_model, math_sdpa

__all__ = ["LinkFit", "TestbedSetting", "fit_link", "fit_overlap_slowdown", "predict_testbed_step_ms", "simulate_testbed"]

# The replay is positively homogeneous in (latency, 1 / bandwidth): scaling both scales every
# time. So the fit searches one ratio, latency x bandwidth (bytes), in this range, and solves the
# scale in closed form for each.
_LATENCY_BYTES_RANGE = (1.0, 1e10)
_LATENCY_BYTES_GRID = 61
_REFINE_STEPS = 60
# A concurrent run at the serial bound would mean compute stops beside communication (an
# infinite slowdown); 10x slower is already indistinguishable from that on the testbed.
MAX_OVERLAP_SLOWDOWN = 10.0


@dataclass(frozen=True)
class TestbedSetting:
    """What the prediction needs: the run it predicts and the testbed's measurements to calibrate to."""

    impl: str
    shard_mode: str
    model_name: str
    n_layers: int
    block_size: int
    micro_batch_size: int
    world_size: int
    # htb rate of the link in each direction.
    rate_mbit: float
    # Calibration: per-rank compute with no communication (C) and communication alone with this
    # implementation's bucketing (M).
    compute_ms: float
    comm_ms: float
    # The implementation's result JSON (one round), with its traces' schedule figures.
    result_json: str
    bucketing: str = "none"
    # The network thunder_overlap was told it runs on (None: its default for the CPU).
    network: str | None = None
    # M of every communication-only run, by bucketing strategy ("none" is thunder_overlap's
    # per-parameter collectives): with two or more the simulator fits a per-collective latency.
    comm_ms_by_bucketing: dict[str, float] = field(default_factory=dict)
    # C and M run at once with no dependencies (this implementation's bucketing), when measured:
    # what overlapping costs on this machine.
    concurrent_ms: float | None = None


@dataclass(frozen=True)
class LinkFit:
    """The testbed link as the simulator sees it."""

    latency_s: float
    bus_bandwidth: float  # bytes/s
    # The bucketing strategies whose communication-only runs it was fitted to.
    fitted_to: tuple[str, ...]
    concurrent_launches: int = GLOO.concurrent_launches

    def network(self) -> NetworkProfile:
        return NetworkProfile("testbed", self.latency_s, self.bus_bandwidth, concurrent_launches=self.concurrent_launches)


def _thunder_traces(model, world_size: int, shard_mode: str, idx_shape: tuple[int, int]):
    """Thunder's own FSDP traced on meta over a fake group, like thunder_overlap.report._models.trace_model."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        sharding = parse_sharding_strategy(shard_mode).thunder_type
        jm = thunder.distributed.fsdp(thunder.jit(model), device=torch.device("meta"), sharding_strategy=sharding)
        idx = torch.zeros(idx_shape, dtype=torch.long, device="meta")
        with math_sdpa():
            thunder.compile_data(jm).get_computation_and_inputs(idx)
        return jm
    finally:
        dist.destroy_process_group()


@functools.cache
def _annotated(
    impl: str,
    bucketing: str,
    network: str | None,
    model_name: str,
    n_layers: int,
    block_size: int,
    micro_batch_size: int,
    world_size: int,
    shard_mode: str,
) -> tuple[AnnotatedTrace, ...]:
    """Forward and backward of one implementation, traced on meta with the options it ran with
    (cached: the fit and every prediction of one testbed run share them)."""
    model, _ = build_model(model_name, n_layers or None, block_size or None)
    idx_shape = (micro_batch_size, block_size)
    if impl == "thunder":
        jm = _thunder_traces(model, world_size, shard_mode, idx_shape)
    else:
        cost_model = CostModel(device_profile("cpu"), network_profile(network or "gloo-loopback"))
        config = variant_config(impl, cost_model)
        jm = trace_model(model, world_size=world_size, sharding=shard_mode, bucketing=bucketing, idx_shape=idx_shape, config=config)
    layouts = module_layouts(jm)
    return tuple(classify_trace(t, layouts) for t in (thunder.last_traces(jm)[-1], thunder.last_backward_traces(jm)[-1]))


# Communication only: no op, local copy or launch overhead takes time.
_NO_COMPUTE = DeviceProfile("communication only", math.inf, math.inf, math.inf, launch_overhead_s=0.0)


def _communication_ms(annotated: tuple[AnnotatedTrace, ...], network: NetworkProfile) -> float:
    """What the communication-only replay of ``annotated`` takes on ``network``: every trace's
    collectives issued and waited on in its order, with no compute in between."""
    cost = CostModel(_NO_COMPUTE, network, user_estimate=lambda bsym: 0.0)
    return sum(simulate(a, list(range(len(a.nodes))), cost).step_ms for a in annotated)


def fit_link(
    comm_ms_by_trace: dict[str, tuple[float, tuple[AnnotatedTrace, ...]]],
    concurrent_launches: int = GLOO.concurrent_launches,
) -> LinkFit:
    """Latency and bandwidth that make each strategy's collectives take its measured M.

    ``comm_ms_by_trace`` maps a bucketing strategy to (its measured M, its traces). Minimises
    the squared relative errors, so a long per-parameter M does not drown a short bucketed one.
    """
    names = sorted(comm_ms_by_trace)

    def at(latency_bytes: float) -> tuple[float, float]:
        """(squared relative error, seconds per byte) of the best link with this latency x bandwidth."""
        unit = NetworkProfile("unit", latency_bytes, 1.0, concurrent_launches=concurrent_launches)
        ratios = [_communication_ms(comm_ms_by_trace[n][1], unit) / comm_ms_by_trace[n][0] for n in names]  # unit ms per measured ms
        scale = sum(ratios) / sum(r * r for r in ratios)  # measured ms per unit ms: min sum (scale * r - 1)^2
        return sum((scale * r - 1) ** 2 for r in ratios), scale

    if len(names) < 2:
        best = 0.0
    else:
        low, high = (math.log(b) for b in _LATENCY_BYTES_RANGE)
        grid = [math.exp(low + (high - low) * i / (_LATENCY_BYTES_GRID - 1)) for i in range(_LATENCY_BYTES_GRID)]
        errors = [at(b)[0] for b in grid]
        i = min(range(len(grid)), key=errors.__getitem__)
        best = _golden_minimum(lambda x: at(math.exp(x))[0], math.log(grid[max(i - 1, 0)]), math.log(grid[min(i + 1, len(grid) - 1)]))
        best = math.exp(best)
        if at(0.0)[0] <= at(best)[0]:
            best = 0.0
    # The unit link moves a byte a second, so the scale that fits it is the real seconds per byte.
    seconds_per_byte = at(best)[1]
    return LinkFit(best * seconds_per_byte, 1 / seconds_per_byte, tuple(names), concurrent_launches)


def _golden_minimum(f, low: float, high: float) -> float:
    """Where ``f`` is smallest on [low, high], by golden-section search."""
    ratio = (math.sqrt(5) - 1) / 2
    a, b = high - ratio * (high - low), low + ratio * (high - low)
    fa, fb = f(a), f(b)
    for _ in range(_REFINE_STEPS):
        if fa <= fb:
            high, b, fb = b, a, fa
            a = high - ratio * (high - low)
            fa = f(a)
        else:
            low, a, fa = a, b, fb
            b = low + ratio * (high - low)
            fb = f(b)
    return (low + high) / 2


def fit_overlap_slowdown(compute_ms: float, comm_ms: float, concurrent_ms: float | None) -> float:
    """How much slower compute runs beside communication, from C, M and the two run at once (T).

    The communication is busy from 0 to M and the compute, slowed by 1 + s while it is, has
    done M / (1 + s) of its C by then, so T = M + C - M / (1 + s). A T at or under max(C, M)
    shows no slowdown (0); one at the serial bound C + M means none of the compute progressed
    beside the communication, and is capped at MAX_OVERLAP_SLOWDOWN.
    """
    if concurrent_ms is None or concurrent_ms <= max(compute_ms, comm_ms):
        return 0.0
    progressed_ms = comm_ms + compute_ms - concurrent_ms  # compute done while communicating
    if progressed_ms <= comm_ms / (1 + MAX_OVERLAP_SLOWDOWN):
        return MAX_OVERLAP_SLOWDOWN
    return comm_ms / progressed_ms - 1


def simulate_testbed(setting: TestbedSetting) -> list[Simulation] | None:
    """The calibrated simulation of ``setting.impl``'s forward and backward traces (each
    collective's timing and exposure in them); None for implementations whose schedule is not a
    Thunder trace (FSDP2, the hand-written loop)."""
    if setting.impl not in (*OVERLAP_OPTIONS, "thunder"):
        return None
    _, spec = build_model(setting.model_name, setting.n_layers or None, setting.block_size or None)
    block_size = setting.block_size or spec.block_size
    shape = (setting.model_name, setting.n_layers, block_size, setting.micro_batch_size, setting.world_size, setting.shard_mode)
    annotated = _annotated(setting.impl, setting.bucketing, setting.network, *shape)

    comm_ms = dict(setting.comm_ms_by_bucketing) or {setting.bucketing: setting.comm_ms}
    link = fit_link({b: (ms, _annotated("thunder_overlap", b, setting.network, *shape)) for b, ms in comm_ms.items()})

    reference = CostModel(device_profile("cpu"), link.network())
    compute_scale = setting.compute_ms / sum(simulate(a, list(range(len(a.nodes))), reference).compute_ms for a in annotated)
    calibrated = CostModel(
        device_profile("cpu"),
        link.network(),
        user_estimate=lambda bsym: compute_scale * reference.compute_ms(bsym),
        overlap_compute_slowdown=fit_overlap_slowdown(setting.compute_ms, setting.comm_ms, setting.concurrent_ms),
    )
    return [simulate(a, list(range(len(a.nodes))), calibrated) for a in annotated]


def predict_testbed_step_ms(setting: TestbedSetting) -> float | None:
    """Predicted forward+backward step of ``setting.impl`` (see :func:`simulate_testbed`)."""
    simulations = simulate_testbed(setting)
    return None if simulations is None else sum(s.step_ms for s in simulations)
