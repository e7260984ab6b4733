"""Coalesced launches on synthetic traces (fake group of 4): latency is paid per launch, the
cost model decides when coalescing pays, and the rewritten traces hold one issue and one wait."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from thunder_overlap._analysis.classify import CollectiveKind, NodeKind, classify_trace
from thunder_overlap._analysis.cost_model import CostModel, DeviceProfile, NetworkProfile
from thunder_overlap._analysis.simulator import simulate
from thunder_overlap._scheduling.dispatch import schedule_trace
from thunder_overlap._scheduling.launches import LaunchGroup, apply_launches, candidate_runs
from thunder_overlap._scheduling.rank_agreement import IssueOrderAgreement, collective_keys
from thunder_overlap._scheduling.scheduler import just_in_time_order
from thunder_overlap.config import OverlapConfig, Tuning

from synthetic_traces import VALUE_BYTES, build_trace

pytestmark = pytest.mark.usefixtures("fake_group_4")

DEVICE = DeviceProfile("test", 1e12, 1e12, 1e12)
# Latency-dominated: 1 ms per ring step (3 on 4 ranks), bytes nearly free.
LATENCY_BOUND = NetworkProfile("latency", latency_s=1e-3, bus_bandwidth=1e12)
# Bandwidth-dominated: no latency, 1 kB/s, so each gather takes 192 ms of transfer.
BANDWIDTH_BOUND = NetworkProfile("bandwidth", latency_s=0.0, bus_bandwidth=1e3)
# Three gathers used one after the other by 1 ms matmuls, and two reductions of one value.
PROGRAM = [("gather",), ("gather",), ("gather",), ("matmul", 0, 1), ("matmul", 4, 2), ("matmul", 5, 3), ("scatter", 4), ("scatter", 4)]


def _cost_model(network: NetworkProfile) -> CostModel:
    return CostModel(DEVICE, network, user_estimate=lambda bsym: 1.0)


def _annotated():
    return classify_trace(build_trace(PROGRAM, dist.group.WORLD))


def _launch_names(trace) -> list[str]:
    annotated = classify_trace(trace)
    return [n.name for n in annotated.nodes if n.kind in (NodeKind.COLLECTIVE, NodeKind.WAIT)]


def test_members_of_a_coalesced_launch_pay_latency_once():
    cost_model = _cost_model(LATENCY_BOUND)
    annotated = _annotated()
    scheduled = schedule_trace(annotated, OverlapConfig(policy="greedy"), largest_block_bytes=None, cost_model=cost_model)
    coalesced = classify_trace(scheduled.trace)
    launch = next(c for c in coalesced.collectives if c.members > 1)
    assert (launch.kind, launch.members, launch.unsharded_bytes) == (CollectiveKind.ALL_GATHER, 3, 3 * VALUE_BYTES)
    latency, transfer = cost_model.latency_ms(4), cost_model.transfer_ms(VALUE_BYTES, 4)
    assert latency == pytest.approx(3.0)
    assert cost_model.collective_ms(launch) == pytest.approx(latency + 3 * transfer)
    # The simulator pays the launch's latency once; separately, each of the three pays its own.
    gathers = [c for c in annotated.collectives if c.kind is CollectiveKind.ALL_GATHER]
    assert sum(cost_model.collective_ms(c) for c in gathers) == pytest.approx(3 * latency + 3 * transfer)
    timing = simulate(coalesced, list(range(len(coalesced.nodes))), cost_model).collectives[coalesced.collectives.index(launch)]
    assert timing.duration_ms == pytest.approx(latency + 3 * transfer)
    separate = simulate(annotated, scheduled.order, cost_model)
    assert simulate(coalesced, list(range(len(coalesced.nodes))), cost_model).step_ms < separate.step_ms


def test_latency_bound_networks_coalesce_and_bandwidth_bound_ones_do_not():
    annotated = _annotated()
    config = OverlapConfig(policy="greedy")
    latency_bound = schedule_trace(annotated, config, largest_block_bytes=None, cost_model=_cost_model(LATENCY_BOUND))
    # The greedy order issues the three gathers back to back, then the two reductions together.
    assert candidate_runs(annotated, latency_bound.order) == [[0, 1, 2], [3, 4]]
    assert [g.members for g in latency_bound.launches] == [(0, 1, 2), (3, 4)]
    assert latency_bound.summary.coalesced_launches == 2 and latency_bound.summary.coalesced_collectives == 5
    assert _launch_names(latency_bound.trace) == ["coalesced_all_gather", "coalesced_wait", "coalesced_reduce_scatter", "coalesced_wait"]
    # Without latency to save, waiting for every gather at the first one's use only delays it. The
    # reductions are both waited on at the end: one launch for them stalls no longer.
    bandwidth_bound = schedule_trace(annotated, config, largest_block_bytes=None, cost_model=_cost_model(BANDWIDTH_BOUND))
    assert [g.members for g in bandwidth_bound.launches] == [(3, 4)]
    assert "coalesced_all_gather" not in _launch_names(bandwidth_bound.trace)


def test_turned_off_and_baseline_policies_do_not_coalesce():
    annotated = _annotated()
    cost_model = _cost_model(LATENCY_BOUND)
    no_coalescing = OverlapConfig(policy="greedy", _tuning=Tuning(coalesce=False))
    for config in (no_coalescing, OverlapConfig(policy="just_in_time"), OverlapConfig(policy="stock")):
        assert schedule_trace(annotated, config, largest_block_bytes=None, cost_model=cost_model).launches == ()
    with pytest.raises(TypeError, match="coalesce must be a bool, got 'yes'"):
        Tuning(coalesce="yes")


def test_an_agreed_launch_is_reproduced_in_a_spread_out_schedule():
    """A retrace keeps the agreed launches: here the just-in-time order issues the gathers one by
    one before each use; the launch goes out at the first one's point, the reductions' at the last."""
    annotated = _annotated()
    order = just_in_time_order(annotated)
    assert candidate_runs(annotated, order) == []
    trace = apply_launches(annotated, order, [LaunchGroup((0, 1, 2)), LaunchGroup((3, 4))], provenance="test")
    names = [b.sym.name for b in trace.bound_symbols if b.sym.name not in ("python_del", "unpack_trivial", "unpack_sequence")]
    assert names[:2] == ["coalesced_all_gather", "coalesced_wait"]
    assert names.index("coalesced_reduce_scatter") > names.index("matmul")  # after the value it reduces
    assert names.count("coalesced_wait") == 2
    with pytest.raises(ValueError, match="at least two members"):
        LaunchGroup((0,))


def test_ranks_agree_on_launches_with_the_issue_order():
    annotated = _annotated()
    keys = collective_keys(annotated)
    agreement = IssueOrderAgreement(exchange=False)
    assert agreement.agreed_launches("forward", keys) is None
    agreement.agree("forward", keys, [0, 1, 2, 3, 4], dist.group.WORLD, [[0, 1, 2]])
    assert agreement.agreed_launches("forward", keys) == [[0, 1, 2]]
    # Reproduced exactly, whatever this rank's own estimates would plan.
    scheduled = schedule_trace(
        annotated, OverlapConfig(policy="greedy"), largest_block_bytes=None, cost_model=_cost_model(LATENCY_BOUND), launches=[[0, 1, 2]]
    )
    assert [g.members for g in scheduled.launches] == [(0, 1, 2)]


def test_a_hidden_collective_is_not_merged_into_an_exposed_launch():
    # The first gather is needed at once (exposed); the second only after four matmuls, which
    # hide it. Coalesced, the second's transfer would join the first's stall: its saved latency
    # was hidden anyway, so nothing is gained.
    program = [("gather",), ("matmul", 0, 1), ("matmul", 2, 1), ("matmul", 3, 1), ("matmul", 4, 1), ("gather",), ("matmul", 5, 6)]
    annotated = classify_trace(build_trace(program, dist.group.WORLD))
    scheduled = schedule_trace(annotated, OverlapConfig(policy="greedy"), largest_block_bytes=None, cost_model=_cost_model(LATENCY_BOUND))
    assert candidate_runs(annotated, scheduled.order) == [[0, 1]]
    assert scheduled.launches == ()
