"""Every bad input gets a clear error naming the bad value and what is accepted; nothing hangs."""

from __future__ import annotations

import pytest
import thunder
import torch
import torch.distributed as dist
import torch.nn as nn

import thunder_overlap
from thunder_overlap import FSDPOverlap, OverlapConfig

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))


def test_without_a_process_group(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match="init_process_group"):
        thunder_overlap.fsdp(_model())


@pytest.fixture(scope="module")
def gloo_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.distributed_c10d._get_default_group()
    dist.destroy_process_group()


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"sharding_strategy": "zero4"}, ValueError, r"sharding_strategy='zero4'.*zero2.*zero3"),
        ({"sharding_strategy": 3}, ValueError, r"sharding_strategy=3 .*accepted"),
        ({"bucketing_strategy": "buckets"}, ValueError, r"bucketing_strategy='buckets'.*block.*layer.*none"),
        ({"bucket_cap_mb": 25}, ValueError, r"bucket_cap_mb=25 needs bucketing_strategy 'layer' or 'block'"),
        ({"bucket_cap_mb": 0, "bucketing_strategy": "block"}, ValueError, r"bucket_cap_mb must be a positive .*got 0"),
        ({"bucket_cap_mb": "25", "bucketing_strategy": "layer"}, ValueError, r"bucket_cap_mb must be a positive .*got '25'"),
        ({"device": "cuda"}, ValueError, r"device='cuda' does not match .*'gloo'.*cpu"),
        ({"device": "meta"}, ValueError, r"device='meta' does not match"),
        ({"device": "potato"}, ValueError, r"device='potato' is not a valid torch device"),
        ({"broadcast_from": 3}, ValueError, r"broadcast_from=3 is not a rank .*0\.\.0"),
        ({"broadcast_from": "0"}, TypeError, r"broadcast_from must be a rank"),
        ({"process_group": "world"}, TypeError, r"process_group must be a torch.distributed.ProcessGroup"),
        ({"config": {"max_in_flight_allgathers": 2}}, TypeError, r"config must be a thunder_overlap.OverlapConfig"),
        ({"move_state_dict_to_cpu": "yes"}, TypeError, r"move_state_dict_to_cpu must be a bool"),
    ],
)
def test_bad_fsdp_arguments(gloo_group, kwargs, error, message):
    with pytest.raises(error, match=message):
        thunder_overlap.fsdp(_model(), **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"sharding_strategy": "zero1"}, ValueError, r"sharding_strategy='zero1'"),
        ({"config": "fast"}, TypeError, r"config must be a thunder_overlap.OverlapConfig"),
        ({"move_state_dict_to_cpu": 1}, TypeError, r"move_state_dict_to_cpu must be a bool, got 1"),
    ],
)
def test_bad_plugin_arguments(gloo_group, kwargs, error, message):
    with pytest.raises(error, match=message):
        FSDPOverlap(**kwargs)


def test_model_must_be_a_module(gloo_group):
    with pytest.raises(TypeError, match="model must be a torch.nn.Module .* got function"):
        thunder_overlap.fsdp(lambda x: x)


def test_jit_options_are_refused_for_an_already_jitted_module(gloo_group):
    with pytest.raises(TypeError, match=r"options \['cache'\] are thunder.jit options"):
        thunder_overlap.fsdp(thunder.jit(_model()), cache="no caching")


def test_a_model_cannot_be_sharded_twice(gloo_group):
    sharded = thunder_overlap.fsdp(thunder.jit(_model()))
    with pytest.raises(ValueError, match="already sharded"):
        thunder_overlap.fsdp(sharded)


def test_strategies_accept_enums_and_case_insensitive_strings(gloo_group):
    model = thunder_overlap.fsdp(_model(), sharding_strategy="ZeRO3", bucketing_strategy=thunder.distributed.FSDPBucketingStrategy.NONE)
    out = model(torch.ones(3, 4))
    assert out.shape == (3, 2)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"policy": "eager"}, ValueError, r"policy must be one of \('memory_aware', 'heuristic', 'greedy', 'just_in_time', 'stock'\), got 'eager'"),
        ({"max_in_flight_allgathers": 0}, ValueError, r"max_in_flight_allgathers must be positive or None .* got 0"),
        ({"max_in_flight_allgathers": 1.5}, TypeError, r"max_in_flight_allgathers must be an int or None, got 1.5"),
        ({"max_in_flight_allgather_bytes": -1}, ValueError, r"max_in_flight_allgather_bytes must be positive"),
        ({"max_in_flight_reduce_scatter_bytes": True}, TypeError, r"max_in_flight_reduce_scatter_bytes must be an int"),
        ({"prefetch_blocks": 0}, ValueError, r"prefetch_blocks must be positive, got 0"),
        ({"prefetch_blocks": "2"}, TypeError, r"prefetch_blocks must be a number, got '2'"),
        ({"check_ranks_agree": "yes"}, TypeError, r"check_ranks_agree must be a bool, got 'yes'"),
        ({"max_prefetch_compute_ops": -1}, ValueError, r"max_prefetch_compute_ops must be non-negative or None"),
        ({"prefetch_time_margin": 0}, ValueError, r"prefetch_time_margin must be positive or None"),
        ({"memory_slack_bytes": None}, TypeError, r"memory_slack_bytes must be an int, got None"),
        ({"memory_slack_ratio": -0.1}, ValueError, r"memory_slack_ratio must be non-negative, got -0.1"),
        ({"cost_model": "h100"}, TypeError, r"cost_model must be a thunder_overlap.CostModel or None, got 'h100'"),
        ({"fallback_in_flight_allgathers": None}, TypeError, r"fallback_in_flight_allgathers must be an int, got None"),
    ],
)
def test_bad_config_values(kwargs, error, message):
    with pytest.raises(error, match=message):
        OverlapConfig(**kwargs)


def test_unknown_config_option_is_named():
    with pytest.raises(TypeError, match="max_inflight"):
        OverlapConfig(max_inflight=3)


def test_no_sync_without_buckets_is_refused_instead_of_dropping_gradients(gloo_group):
    model = thunder_overlap.fsdp(_model())
    with thunder.distributed.skip_data_parallel_grad_sync():
        with pytest.raises(NotImplementedError, match=r"no_sync .*needs bucketing_strategy='layer' or 'block' \(got 'none'\)"):
            model(torch.randn(3, 4)).sum().backward()
    # Outside it the model trains as usual.
    model(torch.randn(3, 4)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
