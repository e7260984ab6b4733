"""FSDPOptions: strategies parsed once into the project's enums, devices resolved (and made current)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from thunder.distributed import FSDPBucketingStrategy, FSDPType

from thunder_overlap.options import BucketingStrategy, FSDPOptions, ShardingStrategy, parse_bucketing_strategy

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def gloo_group(one_rank_gloo_group):
    return one_rank_gloo_group


def test_strategies_are_their_names_and_convert_to_thunder_at_the_boundary():
    assert ShardingStrategy.ZERO3 == "zero3" and f"{ShardingStrategy.ZERO3}" == "zero3"
    # Strings and members find the same dict entry, so results keyed either way agree.
    assert {"zero3": 1}[ShardingStrategy.ZERO3] == 1 and {BucketingStrategy.BLOCK: 2}["block"] == 2
    assert ShardingStrategy.ZERO3.thunder_type is FSDPType.ZERO3
    assert BucketingStrategy.LAYER.thunder_type is FSDPBucketingStrategy.LAYER
    assert parse_bucketing_strategy(FSDPBucketingStrategy.BLOCK) is BucketingStrategy.BLOCK
    assert not BucketingStrategy.NONE.has_buckets and BucketingStrategy.BLOCK.has_buckets


def test_resolve_fills_defaults(gloo_group):
    options = FSDPOptions.resolve(process_group=gloo_group, bucketing_strategy="BLOCK", bucket_cap_mb=0.5)
    assert options.device == torch.device("cpu")
    assert options.sharding is ShardingStrategy.ZERO2 and options.bucketing is BucketingStrategy.BLOCK
    assert options.bucket_cap_bytes == 2**19
    assert options.config is not None


def test_the_default_group_copy_prints_no_gloo_connection_line(gloo_group, capfd):
    print("before", flush=True)
    options = FSDPOptions.resolve()
    assert options.process_group is not gloo_group  # a copy of the default group, made here
    out = capfd.readouterr().out
    assert "[Gloo]" not in out and out.splitlines() == ["before"], out


@pytest.fixture
def fake_nccl(monkeypatch, gloo_group):
    """Two visible GPUs and a process group that reports NCCL; records set_device calls."""
    current = []
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: current.append(torch.device(device)))
    return current


def test_nccl_default_device_is_local_rank_and_becomes_current(fake_nccl, monkeypatch, gloo_group):
    monkeypatch.setenv("LOCAL_RANK", "1")
    options = FSDPOptions.resolve(process_group=gloo_group)
    assert options.device == torch.device("cuda", 1)
    # Object collectives and NCCL use the current device; it must be this rank's GPU, not cuda:0.
    assert fake_nccl == [torch.device("cuda", 1)]


def test_cuda_without_index_gets_local_rank(fake_nccl, monkeypatch, gloo_group):
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert FSDPOptions.resolve(process_group=gloo_group, device="cuda").device == torch.device("cuda", 1)
    assert fake_nccl == [torch.device("cuda", 1)]


def test_local_rank_without_its_gpu_is_refused(fake_nccl, monkeypatch, gloo_group):
    monkeypatch.setenv("LOCAL_RANK", "5")
    with pytest.raises(ValueError, match=r"LOCAL_RANK=5 names no visible CUDA device \(2 visible\); pass device="):
        FSDPOptions.resolve(process_group=gloo_group)
    assert fake_nccl == []


def test_the_default_network_is_decided_once(monkeypatch):
    from thunder_overlap._analysis.cost_model import CostModel, default_network

    assert (default_network(8), default_network(9)) == ("nvlink", "infiniband")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert CostModel.for_device("cuda:0", 8).network.name == "nvlink"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # the scheduler's default follows the real node size
    assert CostModel.for_device("cuda:0", 8).network.name == "infiniband"
    assert CostModel.for_device("cpu", 64).network.name == "gloo-loopback"
    # The report decides by the same node size and the same GPU names.
    from thunder_overlap._analysis.devices import gpu_profile_of
    from thunder_overlap.report._device_choice import _network

    assert [_network("nccl", size, "h100")[0] for size in (4, 8)] == ["nvlink", "infiniband"]
    assert (gpu_profile_of("NVIDIA H200"), gpu_profile_of("NVIDIA A100-SXM4-80GB"), gpu_profile_of("Tesla V100")) == ("h200", "a100", None)
