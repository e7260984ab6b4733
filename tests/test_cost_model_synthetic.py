"""Cost model: roofline, calibration, user estimates and the ring alpha-beta model, by hand."""

from __future__ import annotations

import pytest
import thunder.torch as ltorch
from thunder.core import devices, dtypes
from thunder.core.proxies import TensorProxy
from thunder.core.trace import TraceCtx, tracectx

from thunder_overlap import _ops as ops
from thunder_overlap._analysis.calibration import _shape_key
from thunder_overlap._analysis.classify import Collective, CollectiveKind
from thunder_overlap._analysis.cost_model import (
    Calibration,
    CostModel,
    DeviceProfile,
    NetworkProfile,
    network_profile,
    op_bytes,
    op_flops,
)
from thunder_overlap._analysis.layout import BucketLayout, GatherPath, ReducePath
from thunder_overlap._backends import GLOO, NCCL

# Round numbers, so every answer below is computed by hand: 1 TFLOP/s (both widths), 1 GB/s,
# full efficiency and no launch overhead.
DEVICE = DeviceProfile("test", 1e12, 1e12, 1e9, flops_efficiency=1.0, bandwidth_efficiency=1.0, launch_overhead_s=0.0)
NETWORK = NetworkProfile("test", latency_s=1e-6, bus_bandwidth=1e9)


def _bsym(op, *shapes, dtype=dtypes.bfloat16):
    """The bound symbol ``op`` records on fresh proxies of ``shapes``."""
    trace = TraceCtx()
    with tracectx(trace):
        proxies = [TensorProxy(shape=s, dtype=dtype, device=devices.cpu) for s in shapes]
        op(*proxies)
    return trace.bound_symbols[-1]


class _Group:
    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


def test_matmul_flops_bytes_and_roofline():
    bsym = _bsym(ltorch.matmul, (128, 256), (256, 512))
    assert op_flops(bsym) == 2 * 128 * 512 * 256
    assert op_bytes(bsym) == (128 * 256 + 256 * 512 + 128 * 512) * 2
    # 33.5 MFLOP at 1 TFLOP/s = 33.6 us; 360 KB at 1 GB/s = 360 us: memory bound.
    assert CostModel(DEVICE, NETWORK).compute_ms(bsym) == pytest.approx(op_bytes(bsym) / 1e9 * 1e3)


def test_matmuls_kept_out_of_fusions_count_as_the_ops_they_run():
    unfused = {op.name: op for op in ops.unfused_matmuls.opmap.values()}
    for name, op, shapes in (("matmul", ltorch.matmul, [(128, 256), (256, 512)]), ("linear", ltorch.linear, [(128, 256), (512, 256)])):
        plain, kept_out = _bsym(op, *shapes), _bsym(unfused[f"unfused_{name}"], *shapes)
        assert ops.compute_name(kept_out) == name and op_flops(kept_out) == op_flops(plain) == 2 * 128 * 512 * 256


def test_compute_bound_matmul_uses_the_fp32_rate_for_fp32_inputs():
    device = DeviceProfile("fp32", 2e12, 1e12, 1e15, flops_efficiency=1.0, bandwidth_efficiency=1.0, launch_overhead_s=0.0)
    flops = 2 * 1024 * 1024 * 1024
    half = _bsym(ltorch.matmul, (1024, 1024), (1024, 1024))
    single = _bsym(ltorch.matmul, (1024, 1024), (1024, 1024), dtype=dtypes.float32)
    assert CostModel(device, NETWORK).compute_ms(half) == pytest.approx(flops / 2e12 * 1e3, rel=1e-3)
    assert CostModel(device, NETWORK).compute_ms(single) == pytest.approx(flops / 1e12 * 1e3, rel=1e-3)


def test_elementwise_and_views():
    add = _bsym(ltorch.add, (1000,), (1000,))
    assert op_flops(add) == 1000
    assert op_bytes(add) == 3 * 1000 * 2
    assert CostModel(DEVICE, NETWORK).compute_ms(add) == pytest.approx(6000 / 1e9 * 1e3)
    view = _bsym(lambda a: ltorch.reshape(a, (10, 100)), (1000,))
    assert op_bytes(view) == 0
    assert CostModel(DEVICE, NETWORK).compute_ms(view) == 0.0


def test_launch_overhead_is_added():
    device = DeviceProfile("slow launch", 1e12, 1e12, 1e9, flops_efficiency=1.0, bandwidth_efficiency=1.0, launch_overhead_s=1e-3)
    add = _bsym(ltorch.add, (1000,), (1000,))
    assert CostModel(device, NETWORK).compute_ms(add) == pytest.approx(6e-3 + 1.0)


def test_user_estimate_then_calibration_then_roofline():
    add = _bsym(ltorch.add, (1000,), (1000,))
    calibration = Calibration("cpu")
    calibration.times_ms[_shape_key(add)] = 7.0
    model = CostModel(DEVICE, NETWORK, calibration=calibration, user_estimate=lambda b: 3.0 if b.sym.name == "add" else None)
    assert model.compute_ms(add) == 3.0
    model.user_estimate = lambda b: None  # declines: calibration answers
    assert model.compute_ms(add) == 7.0
    model.calibration = None
    assert model.compute_ms(add) == pytest.approx(6e-3)


def test_calibration_times_each_shape_once_and_round_trips(tmp_path):
    path = tmp_path / "calibration.json"
    calibration = Calibration("cpu", path=path, repeats=2)
    mm = _bsym(ltorch.matmul, (64, 64), (64, 64), dtype=dtypes.float32)
    first = calibration.measure(mm)
    assert first > 0
    assert calibration.measure(mm) == first  # cached, not re-timed
    assert calibration.measure(_bsym(ltorch.matmul, (64, 64), (64, 64), dtype=dtypes.float32)) == first  # same shape
    calibration.save()
    assert Calibration("cpu", path=path).lookup(mm) == first


def test_calibration_times_ops_whose_names_are_not_identifiers():
    import thunder
    import torch

    # The embedding's backward is "torch.ops.aten.embedding_backward" in the backward trace.
    model = thunder.jit(torch.nn.Embedding(100, 8))
    model(torch.zeros(4, dtype=torch.long)).sum().backward()
    (backward,) = [t for t in thunder.last_backward_traces(model)[-1:]]
    names = [b.sym.name for b in backward.bound_symbols]
    assert any("." in name for name in names), names
    calibration = Calibration("cpu", repeats=2)
    assert calibration.calibrate(backward) >= 1
    assert any("." in key.split("(")[0] for key in calibration.times_ms)


def test_ring_collective_time():
    gather = Collective(CollectiveKind.ALL_GATHER, start=0, wait=1, process_group=_Group(8), unsharded_bytes=8_000_000)
    # 7 steps of 1 us, plus 7/8 of 8 MB at 1 GB/s = 7 ms.
    assert CostModel(DEVICE, NETWORK).collective_ms(gather) == pytest.approx(7.007)
    all_reduce = Collective(CollectiveKind.ALL_REDUCE, start=0, wait=1, process_group=_Group(8), unsharded_bytes=8_000_000)
    assert CostModel(DEVICE, NETWORK).collective_ms(all_reduce) == pytest.approx(2 * 7.007)
    assert CostModel(DEVICE, NETWORK).collective_ms(gather, world_size=1) == 0.0
    assert CostModel(DEVICE, NETWORK).collective_ms(gather, world_size=2) == pytest.approx(1e-3 + 4.0)


def test_latency_steps_of_ring_and_tree():
    ring = NetworkProfile("ring", latency_s=1e-6, bus_bandwidth=1e9)
    tree = NetworkProfile("tree", latency_s=1e-6, bus_bandwidth=1e9, algorithm="tree")
    assert [ring.latency_steps(n) for n in (1, 2, 8, 1024)] == [0, 1, 7, 1023]
    assert [tree.latency_steps(n) for n in (1, 2, 8, 1000, 1024)] == [0, 1, 3, 10, 10]
    # At 1024 ranks a ring pays 1023 latencies per launch, a tree 10; the transfer is the same.
    model_ring, model_tree = CostModel(DEVICE, ring), CostModel(DEVICE, tree)
    assert model_ring.latency_ms(1024) == pytest.approx(1.023) and model_tree.latency_ms(1024) == pytest.approx(0.010)
    assert model_ring.transfer_ms(1 << 20, 1024) == model_tree.transfer_ms(1 << 20, 1024)
    with pytest.raises(ValueError, match="algorithm.*'ring', 'tree'.*'butterfly'"):
        NetworkProfile("bad", 1e-6, 1e9, algorithm="butterfly")


def test_collective_without_group_needs_a_world_size():
    orphan = Collective(CollectiveKind.REDUCE_SCATTER, start=0, wait=1, process_group=None, unsharded_bytes=100)
    with pytest.raises(ValueError, match="world_size"):
        CostModel(DEVICE, NETWORK).collective_ms(orphan)


def test_profiles_by_name_and_clear_errors():
    custom = network_profile("custom:5:100")
    assert (custom.latency_s, custom.bus_bandwidth) == (pytest.approx(5e-6), pytest.approx(100e9))
    assert CostModel.named("h100", "infiniband").network.name == "infiniband"
    with pytest.raises(ValueError, match="accepted.*nvlink"):
        network_profile("ethernet")
    with pytest.raises(ValueError, match="custom"):
        network_profile("custom:5:0")
    assert network_profile("custom:5:100:tree").algorithm == "tree"
    assert network_profile("infiniband-pat").algorithm == "tree" and network_profile("infiniband").algorithm == "ring"
    gloo = network_profile("custom:1000:0.05:ring:2")
    assert (gloo.algorithm, gloo.concurrent_launches) == ("ring", 2) and custom.concurrent_launches == 1
    assert network_profile("gloo-loopback").concurrent_launches == 2 and network_profile("nvlink").concurrent_launches == 1
    for bad in ("custom:5:100:butterfly", "custom:5", "custom:5:100:ring:extra", "custom:5:100:ring:0", "custom:5:100:ring:2:1"):
        with pytest.raises(ValueError, match="ring\\|tree.*concurrent launches >= 1"):
            network_profile(bad)
    with pytest.raises(ValueError, match="concurrent_launches must be an integer >= 1, got 0"):
        NetworkProfile("bad", 1e-6, 1e9, concurrent_launches=0)
    with pytest.raises(ValueError, match="unknown device profile 'tpu'.*h100"):
        CostModel.named("tpu")


# ---------------------------------------------------------------------------------------------
# Local copies of the bucketed collectives (thunder_overlap._analysis.local_copies)


def _layout(label: str, numel: int, *, tensors: int, world_size: int, backend=GLOO, padded: bool = False, itemsize: int = 4, **paths):
    """A bucket's default layout on ``backend``, with ``paths`` (gather=, reduce=) changed."""
    dtype = {2: "torch.bfloat16", 4: "torch.float32"}[itemsize]
    layout = BucketLayout.default(
        label, unsharded_numel=numel, dtype=dtype, itemsize=itemsize, tensors=tensors, world_size=world_size, backend=backend, padded=padded
    )
    return layout.with_paths(**paths)


# The synthetic traces' buckets, by the key their operators name: two bf16 weights on 4 ranks,
# laid out over gloo (the first padded); one weight alone.
TWO = _layout("two", 96, tensors=2, world_size=4, padded=True, itemsize=2)
ONE = _layout("one", 96, tensors=1, world_size=4, itemsize=2)
LAYOUTS = {"two": TWO, "one": ONE}


def _bucket_ops(group, *, divisor: float | None = 4.0):
    """Bucket ``"two"``: two bf16 weights, (7, 8) and (4, 8), on the 4 ranks of ``group``: shards
    of 2 and 1 rows (the first padded from 7 to 8 rows), 24 elements per rank, 96 unsharded (192
    bytes); and ``"one"``, a (12, 8) weight. Returns the bound symbols of their collectives'
    starts and waits by role."""
    from thunder.core.proxies import FutureTensorProxy

    from thunder_overlap._ops import (
        bucket_all_gather,
        bucket_all_gather_wait,
        bucket_reduce_scatter,
        bucket_reduce_scatter_wait,
    )

    def proxy(*shape):
        return TensorProxy(shape=shape, dtype=dtypes.bfloat16, device=devices.cpu)

    with tracectx(TraceCtx()):
        shards = [proxy(2, 8), proxy(1, 8)]
        gathered = FutureTensorProxy(shape=(96,), dtype=dtypes.bfloat16, device=devices.cpu)
        grads = [proxy(7, 8), proxy(4, 8)]
        reduced = FutureTensorProxy(shape=(24,), dtype=dtypes.bfloat16, device=devices.cpu)
        return {
            "start_gather": bucket_all_gather.bind("two", group, shards, (0, 1), output=gathered),
            "wait_gather": bucket_all_gather_wait.bind(gathered, "two", (0, 1), output=(proxy(8, 8), proxy(4, 8))),
            "wait_whole": bucket_all_gather_wait.bind(gathered, "one", (0,), output=(proxy(12, 8),)),
            "start_scatter": bucket_reduce_scatter.bind("two", group, grads, divisor, output=reduced),
            "wait_scatter": bucket_reduce_scatter_wait.bind(reduced, "two", (0, 1), output=(proxy(2, 8), proxy(1, 8))),
        }


def test_bucket_copies_cost_their_bytes_at_memory_bandwidth(fake_group_4):
    from thunder_overlap._analysis.local_copies import LOCAL_COPY_BYTES, local_copy_bytes

    ops = _bucket_ops(fake_group_4)
    # The flat shard is the parameters' storage (no copy-in); the reduce-scatter writes the
    # gradient shard in place (no copy-out).
    assert local_copy_bytes(ops["start_gather"], LAYOUTS) == local_copy_bytes(ops["wait_scatter"], LAYOUTS) == 0
    # split_with_sizes_copy reads and writes the 192 gathered bytes; one tensor needs views only.
    assert local_copy_bytes(ops["wait_gather"], LAYOUTS) == 2 * 192
    assert local_copy_bytes(ops["wait_whole"], LAYOUTS) == 0
    # Gathered in place (NCCL, or per parameter over gloo) there is no copy-out.
    in_place = {"two": TWO.with_paths(gather=GatherPath.IN_PLACE)}
    assert local_copy_bytes(ops["wait_gather"], in_place) == 0
    # _chunk_cat reads the gradients (112 + 64 bytes) and writes the padded 192; the
    # pre-average reads and writes those 192 again; from gloo's copy, that copy once more.
    assert local_copy_bytes(ops["start_scatter"], LAYOUTS) == 176 + 192 + 2 * 192
    assert local_copy_bytes(_bucket_ops(fake_group_4, divisor=None)["start_scatter"], LAYOUTS) == 176 + 192
    from_copy = {"two": TWO.with_paths(reduce=ReducePath.FROM_COPY)}
    assert local_copy_bytes(ops["start_scatter"], from_copy) == 176 + 192 + 2 * 192 + 2 * 192
    # 1 GB/s at full efficiency: 1 ns per byte; at 80% efficiency 1.25 ns.
    assert CostModel(DEVICE, NETWORK).local_copy_ms(ops["start_scatter"], LAYOUTS) == pytest.approx(752e-6)
    slower = DeviceProfile("test", 1e12, 1e12, 1e9, bandwidth_efficiency=0.8)
    assert CostModel(slower, NETWORK).local_copy_ms(ops["wait_gather"], LAYOUTS) == pytest.approx(384 * 1.25e-6)
    # Per-parameter collectives and compute ops copy nothing of the kind.
    assert CostModel(DEVICE, NETWORK).local_copy_ms(_bsym(ltorch.add, (4, 4), (4, 4)), LAYOUTS) == 0.0
    # A bucket operator whose layout was not given is an error, not a guess.
    with pytest.raises(ValueError, match="whose layout was not given"):
        local_copy_bytes(ops["wait_gather"], {})
    assert set(LOCAL_COPY_BYTES) >= {"bucket_all_gather", "bucket_all_gather_wait", "bucket_reduce_scatter"}


def test_a_coalesced_bucket_reduce_scatter_costs_each_members_lay_out():
    from types import SimpleNamespace

    from thunder.core import dtypes

    from thunder_overlap._analysis.local_copies import local_copy_bytes

    def grad(*shape):
        return SimpleNamespace(shape=shape, dtype=dtypes.float32)

    # Two buckets: one of two gradients, pre-averaged (lay-out G + G, divide 2G); one of a single
    # gradient, not averaged (sent as it is: nothing copied).
    layouts = {0: _layout("two", 36, tensors=2, world_size=1), 1: _layout("one", 128, tensors=1, world_size=1)}
    members = ((0, 2.0, (0, 1)), (1, None, (0,)))
    grads = [[grad(4, 8), grad(4)], [grad(16, 8)]]
    bsym = SimpleNamespace(sym=ops.coalesced_bucket_reduce_scatter, args=(None, members, grads))
    two_grads_bytes = (32 + 4) * 4
    assert local_copy_bytes(bsym, layouts) == 4 * two_grads_bytes
    averaged = SimpleNamespace(sym=bsym.sym, args=(None, ((1, 2.0, (0,)),), [[grad(16, 8)]]))
    # One gradient is sent as it is and the received shard averaged (the whole of it on one rank).
    assert local_copy_bytes(averaged, layouts) == 2 * 128 * 4


def test_a_coalesced_bucket_all_gather_wait_costs_each_members_copy_out():
    from types import SimpleNamespace

    from thunder.core import dtypes

    from thunder_overlap._analysis.local_copies import local_copy_bytes

    def shard(*shape):
        return SimpleNamespace(shape=shape, dtype=dtypes.float32)

    group = SimpleNamespace(size=lambda: 4)
    # Two buckets on 4 ranks: one of two tensors (flat shard 36 floats: 4 x 144 bytes gathered,
    # read and written by the copy-out); one of a single tensor (views of the gathered buffer).
    layouts = {0: _layout("two", 144, tensors=2, world_size=4), 1: _layout("one", 512, tensors=1, world_size=4)}
    members = ((0, (0, 1), (0, 1)), (1, (0,), (0,)))
    shards = [[shard(4, 8), shard(4)], [shard(16, 8)]]
    issue = SimpleNamespace(sym=ops.coalesced_bucket_all_gather, args=(group, members, shards))
    wait = SimpleNamespace(sym=ops.coalesced_wait, args=(None, ()))
    assert local_copy_bytes(wait, layouts, issued_by=issue) == 2 * 4 * (32 + 4) * 4
    # A per-parameter coalesced launch copies nothing at its wait, and the wait alone names no bucket.
    per_parameter = SimpleNamespace(sym=ops.coalesced_all_gather, args=(group, (0,), [shard(4, 8)]))
    assert local_copy_bytes(wait, layouts, issued_by=per_parameter) == local_copy_bytes(wait, layouts) == 0


def test_a_bucket_gathered_per_parameter_pays_a_latency_per_parameter_on_the_link():
    from dataclasses import replace

    # Three parameters on a backend that runs a coalesced launch one collective at a time (gloo).
    gloo = _layout("b", 1000, tensors=3, world_size=2)
    assert (gloo.gather_launches(), gloo.gather) == (1, GatherPath.COPY_OUT)
    per_parameter = gloo.with_paths(gather=GatherPath.IN_PLACE)
    assert per_parameter.gather_launches() == 3
    # Where a coalesced launch runs as one (NCCL), in place is the default and one launch.
    nccl = gloo.as_on(NCCL)
    assert (nccl.gather, nccl.gather_launches()) == (GatherPath.IN_PLACE, 1)
    # The ring's latency (7 steps of 1 us on 8 ranks) once per launch; only the first is latency
    # that can pass while another launch transfers, the others hold the link.
    one = Collective(CollectiveKind.ALL_GATHER, start=0, wait=1, process_group=_Group(8), unsharded_bytes=8_000_000)
    three = replace(one, launches=3)
    model = CostModel(DEVICE, NETWORK)
    assert model.collective_ms(three) - model.collective_ms(one) == pytest.approx(2 * 7e-3)
    assert model.collective_latency_ms(three) == model.collective_latency_ms(one) == pytest.approx(7e-3)
