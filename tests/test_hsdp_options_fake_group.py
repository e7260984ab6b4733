"""device_mesh on the fake group of 4 ranks: which groups a 1-D and a 2-D mesh become, the errors
for meshes that cannot be used, and how the memory estimator counts HSDP's all-reduces."""

from __future__ import annotations

import pytest
import thunder
import torch
import torch.distributed as dist
from thunder.core import dtypes
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import thunder_overlap
from thunder_overlap import fsdp_transforms
from thunder_overlap._analysis.classify import classify_trace
from thunder_overlap._analysis.memory_estimate import estimate_memory
from thunder_overlap._transforms import BucketingTransform, OverlapScheduleTransform, ReplicaReduceTransform
from thunder_overlap._transforms.zero3 import Zero3Transform
from thunder_overlap.options import FSDPOptions
from thunder_overlap.report._builtin_models import TinyGPT, TinyGPTConfig
from thunder_overlap.report._schedule_view import schedule_stats


def test_a_2d_mesh_shards_over_its_second_dim_and_replicates_over_its_first(fake_group_4):
    mesh = init_device_mesh("cpu", (2, 2))
    options = FSDPOptions.resolve(device_mesh=mesh)
    assert dist.get_process_group_ranks(options.process_group) == [0, 1]
    assert dist.get_process_group_ranks(options.replicate_group) == [0, 2]
    assert options.world_group is dist.group.WORLD
    transforms = fsdp_transforms(options)
    replicate = [t for t in transforms if isinstance(t, ReplicaReduceTransform)]
    assert len(replicate) == 1 and replicate[0].device_mesh is mesh
    assert dist.get_process_group_ranks(replicate[0].replicate_group) == [0, 2]
    # Ranks agree on their schedules across the whole world, not within one shard group.
    schedule = next(t for t in transforms if isinstance(t, OverlapScheduleTransform))
    assert schedule.state.agreement_group is dist.group.WORLD


def test_a_1d_mesh_is_plain_fsdp_over_it(fake_group_4):
    mesh = init_device_mesh("cpu", (4,))
    options = FSDPOptions.resolve(device_mesh=mesh)
    assert options.replicate_group is None and options.hybrid_mesh is None
    assert dist.get_process_group_ranks(options.process_group) == [0, 1, 2, 3]
    assert not any(isinstance(t, ReplicaReduceTransform) for t in fsdp_transforms(options))


@pytest.mark.parametrize(
    "make, error, message",
    [
        (lambda: dict(device_mesh=init_device_mesh("cpu", (1, 2, 2))), ValueError, "1 dim (shard) or 2 dims (replicate, shard), got 3"),
        (lambda: dict(device_mesh=DeviceMesh("cpu", [0, 1])), ValueError, "holds 2 ranks, but the world has 4"),
        (
            lambda: dict(device_mesh=init_device_mesh("cpu", (2, 2)), process_group=dist.group.WORLD),
            ValueError,
            "either device_mesh or process_group, not both",
        ),
        (lambda: dict(device_mesh=[[0, 1], [2, 3]]), TypeError, "device_mesh must be a torch.distributed.device_mesh.DeviceMesh"),
        (lambda: dict(device_mesh=init_device_mesh("cpu", (2, 2)), broadcast_from=0), ValueError, "broadcast_from=0 is not supported"),
    ],
    ids=["3-dims", "not-the-world", "with-process-group", "not-a-mesh", "broadcast-from"],
)
def test_meshes_that_cannot_be_used_are_refused_by_name(fake_group_4, make, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        FSDPOptions.resolve(**make())


@pytest.mark.slow
@pytest.mark.parametrize("bucketing", ["none", "block"])
def test_the_all_reduces_work_in_place_and_the_estimator_allocates_nothing_for_them(fake_group_4, bucketing):
    torch.manual_seed(0)
    model = TinyGPT(TinyGPTConfig(n_layer=2))
    jm = thunder_overlap.fsdp(
        model, device="cpu", sharding_strategy="zero3", bucketing_strategy=bucketing, device_mesh=init_device_mesh("cpu", (2, 2))
    )
    jm(torch.randint(0, 101, (2, 8))).sum().backward()
    forward, backward = thunder.last_traces(jm)[-1], thunder.last_backward_traces(jm)[-1]
    layouts = thunder_overlap.BucketingTransform.of(jm).layouts if bucketing != "none" else {}
    estimate = estimate_memory(backward, layouts=layouts, after=estimate_memory(forward, layouts=layouts))
    all_reduces = [i for i, b in enumerate(backward.bound_symbols) if "all_reduce" in b.sym.name]
    assert len(all_reduces) >= 4  # issues and waits
    # The reduced shard is divided and summed where it lies: neither the issue nor the wait
    # allocates (an estimator that gave the future a storage of its own would count a shard).
    assert [estimate.allocated[i] for i in all_reduces] == [0] * len(all_reduces)


@pytest.mark.slow
@pytest.mark.parametrize("bucketing", ["none", "block"])
def test_mixed_precision_gathers_bf16_and_reduces_and_all_reduces_float32(fake_group_4, bucketing):
    torch.manual_seed(0)
    policy = thunder_overlap.MixedPrecision(torch.bfloat16, torch.float32)
    mesh = init_device_mesh("cpu", (2, 2))
    model = TinyGPT(TinyGPTConfig(n_layer=2))
    jm = thunder_overlap.fsdp(
        model, device="cpu", sharding_strategy="zero3", bucketing_strategy=bucketing, device_mesh=mesh, mixed_precision=policy
    )
    jm(torch.randint(0, 101, (2, 8))).float().sum().backward()
    layouts = thunder_overlap.BucketingTransform.of(jm).layouts if bucketing != "none" else {}
    traces = (thunder.last_traces(jm)[-1], thunder.last_backward_traces(jm)[-1])
    moved = {(c.kind.value, c.dtype) for t in traces for c in classify_trace(t, layouts=layouts).collectives}
    assert moved == {("all_gather", dtypes.bfloat16), ("reduce_scatter", dtypes.float32), ("all_reduce", dtypes.float32)}
    assert {p.grad.dtype for p in jm.parameters() if p.requires_grad} == {torch.float32}


@pytest.mark.slow
def test_sharding_auto_under_hsdp_keeps_blocks_within_the_budget_and_all_reduces_every_bucket(fake_group_4):
    mesh = init_device_mesh("cpu", (2, 2))
    model = TinyGPTConfig(n_layer=3, n_embd=64)  # three blocks: the halfway budget keeps some, not all

    def step(budget: int):
        torch.manual_seed(0)
        config = thunder_overlap.OverlapConfig(memory_budget_bytes=budget)
        jm = thunder_overlap.fsdp(
            TinyGPT(model), device="cpu", device_mesh=mesh, sharding_strategy="auto", bucketing_strategy="block", config=config
        )
        jm(torch.randint(0, model.vocab_size, (2, 32))).sum().backward()
        return jm

    fits = Zero3Transform.of(step(1 << 40)).choice
    budget = (fits.zero3_peak_bytes + fits.zero2_peak_bytes) // 2
    jm = step(budget)
    choice = Zero3Transform.of(jm).choice
    assert 0 < len(choice.kept) < len(choice.candidates) and choice.peak_bytes <= budget
    schedule = OverlapScheduleTransform.of(jm).summaries
    assert max(schedule.forward.peak_bytes, schedule.backward.peak_bytes) <= budget
    stats = schedule_stats(thunder.last_backward_traces(jm)[-1], layouts=BucketingTransform.of(jm).layouts)
    assert 0 < stats.allgathers < len(choice.candidates)  # the blocks not kept are re-gathered
    assert stats.all_reduces == stats.reduce_scatters  # each bucket's shard across the replicas
