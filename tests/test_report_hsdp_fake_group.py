"""Hybrid sharding (HSDP) in the cost model, the simulator and the report, on fake process groups.

The cost model gives each process group its own network (NodeTopology: NVLink inside a node,
InfiniBand across nodes), the simulator runs the groups on their own links, and the report
command predicts HSDP with ``--shard-group-size``.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from thunder_overlap._analysis.classify import AnnotatedTrace, Collective, CollectiveKind, NodeKind, TraceNode
from thunder_overlap._analysis.cost_model import CostModel, NetworkProfile, NodeTopology
from thunder_overlap._analysis.simulator import simulate
from thunder_overlap.report._cli import main

MB = 1_000_000
# 1 ms per launch step, distinct bandwidths: any mix-up of the two networks changes every time.
INTRA = NetworkProfile("intra", latency_s=1e-3, bus_bandwidth=4e9)
INTER = NetworkProfile("inter", latency_s=1e-3, bus_bandwidth=1e9)


@pytest.fixture
def mesh_2x4() -> Iterator:
    """8 fake ranks as a (replicate 2, shard 4) mesh: shard groups {0..3}, {4..7}; replicate
    group of rank 0: {0, 4}. With 4 GPUs per node each shard group is one node."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        yield init_device_mesh("cpu", (2, 4))
    finally:
        dist.destroy_process_group()


def _ring_ms(network: NetworkProfile, ranks: int, nbytes: int, phases: int = 1) -> float:
    return phases * ((ranks - 1) * network.latency_s + (ranks - 1) / ranks * nbytes / network.bus_bandwidth) * 1e3


def test_the_shard_group_gets_the_intra_node_network_and_the_replicate_group_the_inter_node_one(mesh_2x4):
    shard, replicate = mesh_2x4.get_group(1), mesh_2x4.get_group(0)
    assert dist.get_process_group_ranks(shard) == [0, 1, 2, 3] and dist.get_process_group_ranks(replicate) == [0, 4]
    model = CostModel.named("h100", INTRA, topology=NodeTopology(INTRA, INTER, gpus_per_node=4))
    scatter = Collective(CollectiveKind.REDUCE_SCATTER, 0, 1, shard, 8 * MB)
    all_reduce = Collective(CollectiveKind.ALL_REDUCE, 2, 3, replicate, 2 * MB)
    assert (model.network_for(scatter), model.network_for(all_reduce)) == (INTRA, INTER)
    assert model.collective_ms(scatter) == pytest.approx(_ring_ms(INTRA, 4, 8 * MB))  # 3 + 1.5 ms
    assert model.collective_ms(all_reduce) == pytest.approx(_ring_ms(INTER, 2, 2 * MB, phases=2))  # 2 x (1 + 1) ms
    assert model.collective_latency_ms(all_reduce) == pytest.approx(2.0)
    # The whole world spans both nodes; with 8 GPUs per node the replicate group fits one node.
    assert model.topology.network_of(dist.group.WORLD) == INTER
    assert NodeTopology(INTRA, INTER, gpus_per_node=8).network_of(replicate) == INTRA
    assert model.topology.placement(replicate) == "across 2 nodes" and model.topology.placement(shard) == "in 1 node"
    # Without a topology every group is costed on the one network (plain FSDP's model).
    single = CostModel.named("h100", INTRA)
    assert single.network_for(all_reduce) == INTRA
    assert single.collective_ms(all_reduce) == pytest.approx(_ring_ms(INTRA, 2, 2 * MB, phases=2))


def test_a_group_keeps_its_network_after_it_is_destroyed_and_an_unseen_dead_group_is_refused(mesh_2x4):
    topology = NodeTopology(INTRA, INTER, gpus_per_node=4)
    seen, unseen = dist.new_group([0, 4]), dist.new_group([0, 1])
    assert topology.network_of(seen) == INTER
    dist.destroy_process_group(seen)
    dist.destroy_process_group(unseen)
    assert topology.network_of(seen) == INTER  # remembered while alive
    with pytest.raises(ValueError, match="its ranks are unknown"):
        topology.network_of(unseen)


def test_the_default_cost_model_places_groups_on_nodes(mesh_2x4, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    model = CostModel.for_device("cuda:0", 4)
    assert model.network.name == "nvlink"
    assert model.topology.network_of(mesh_2x4.get_group(1)).name == "nvlink"
    assert model.topology.network_of(mesh_2x4.get_group(0)).name == "infiniband"
    assert CostModel.for_device("cpu", 8).topology is None  # gloo on one machine: one network


def _node(index: int, kind: NodeKind, name: str, inputs=(), outputs=(), collective=None) -> TraceNode:
    return TraceNode(index, SimpleNamespace(sym=SimpleNamespace(name=name, id=name)), kind, tuple(inputs), tuple(outputs), collective)


def test_the_replicate_all_reduce_runs_on_its_own_link_beside_the_shard_reduce_scatters(mesh_2x4):
    """Two reduce-scatters on the shard group, then the first one's all-reduce on the replicate
    group: the all-reduce starts when it is issued, not when the second reduce-scatter leaves
    the shard group's link."""
    shard, replicate = mesh_2x4.get_group(1), mesh_2x4.get_group(0)
    nodes = [
        _node(0, NodeKind.HEADER, "unpack_trivial", outputs=["g1", "g2"]),
        _node(1, NodeKind.COLLECTIVE, "reduce_scatter", inputs=["g1"], outputs=["f1"], collective=0),
        _node(2, NodeKind.COLLECTIVE, "reduce_scatter", inputs=["g2"], outputs=["f2"], collective=1),
        _node(3, NodeKind.WAIT, "wait", inputs=["f1"], outputs=["s1"], collective=0),
        _node(4, NodeKind.COLLECTIVE, "replica_all_reduce", inputs=["s1"], outputs=["r1"], collective=2),
        _node(5, NodeKind.WAIT, "wait", inputs=["f2"], outputs=["s2"], collective=1),
        _node(6, NodeKind.WAIT, "replica_all_reduce_wait", inputs=["r1"], outputs=["a1"], collective=2),
        _node(7, NodeKind.RETURN, "python_return", inputs=["a1", "s2"]),
    ]
    collectives = [
        Collective(CollectiveKind.REDUCE_SCATTER, 1, 3, shard, 8 * MB),  # 3 + 1.5 ms on intra
        Collective(CollectiveKind.REDUCE_SCATTER, 2, 5, shard, 8 * MB),
        Collective(CollectiveKind.ALL_REDUCE, 4, 6, replicate, 2 * MB),  # 2 x (1 + 1) ms on inter
    ]
    producer = {name: n.index for n in nodes for name in n.outputs}
    consumers: dict[str, list[int]] = {}
    for n in nodes:
        for name in n.inputs:
            consumers.setdefault(name, []).append(n.index)
    annotated = AnnotatedTrace(None, nodes, collectives, producer, consumers)
    model = CostModel.named("h100", INTRA, user_estimate=lambda bsym: 0.0, topology=NodeTopology(INTRA, INTER, gpus_per_node=4))
    sim = simulate(annotated, list(range(len(nodes))), model)
    first, second, all_reduce = sim.collectives
    assert (first.start_ms, first.end_ms) == pytest.approx((0.0, 4.5))
    assert (second.start_ms, second.end_ms) == pytest.approx((4.5, 9.0))  # queued on the shard link
    assert all_reduce.stream != first.stream
    # Issued once the first reduce-scatter is waited on (4.5 ms), and not queued behind the second.
    assert (all_reduce.start_ms, all_reduce.end_ms) == pytest.approx((4.5, 8.5))
    assert sim.step_ms == pytest.approx(9.0)
    assert sim.communication_ms == pytest.approx(9.0)  # the busier link: the shard group's


def test_a_shard_group_size_that_does_not_divide_the_world_is_refused_by_name(capsys):
    assert main(["--model", "tiny-gpt", "--world-size", "16", "--shard-group-size", "6"]) == 2
    err = capsys.readouterr().err
    assert "--shard-group-size 6 does not divide --world-size 16; accepted: a divisor of 16 (1, 2, 4, 8, 16)" in err
    assert main(["--model", "tiny-gpt", "--world-size", "16", "--shard-group-size", "0"]) == 2
    assert "--shard-group-size 0 does not divide --world-size 16" in capsys.readouterr().err
    assert not dist.is_initialized()


@pytest.mark.slow
def test_an_hsdp_report_lists_the_all_reduces_on_the_replicate_group(tmp_path, capsys):
    argv = ["--model", "tiny-gpt", "--n-layer", "1", "--world-size", "16", "--shard-group-size", "4", "--gpus-per-node", "4"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "world size 16, device h100, network nvlink" in out
    assert "4 ranks in 1 node (all_gather, reduce_scatter): nvlink; 4 ranks across 4 nodes (all_reduce): infiniband" in out
    # Thunder's own FSDP has no hybrid sharding: its baseline shards over all 16 ranks.
    assert "16 ranks across 4 nodes (all_gather, reduce_scatter): infiniband [thunder 0.2.6]" in out
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["world_size"] == 16
    backward = data["passes"]["backward"]
    for order in ("unscheduled", "thunder_overlap"):
        kinds = Counter(c["kind"] for c in backward[order]["collective_timings"])
        assert kinds["all_reduce"] == kinds["reduce_scatter"] > 0  # one all-reduce per reduced shard
    assert "all_reduce" not in {c["kind"] for c in backward["thunder 0.2.6"]["collective_timings"]}
    # Each all-reduce is costed on InfiniBand over the 4 replicas: 2 x (3 steps of 10 us + 3/4 x bytes / 45 GB/s).
    for c in backward["thunder_overlap"]["collective_timings"]:
        if c["kind"] == "all_reduce":
            assert c["end_ms"] - c["start_ms"] == pytest.approx(2 * (3 * 10e-3 + 0.75 * c["bytes"] / 45e9 * 1e3))
    groups = {(g["ranks"], g["placement"], g["network"]): g["kinds"] for g in data["groups"]}
    assert groups[(4, "across 4 nodes", "infiniband")] == ["all_reduce"]
    assert not dist.is_initialized()
