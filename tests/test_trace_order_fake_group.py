"""Schedules of real final traces, in one process on the fake process group (4 ranks).

Collectives on the fake group complete at once, so these tests look at trace order and in-flight
accounting, not numerics (tests/test_two_ranks.py checks numerics on real gloo ranks).
"""

from __future__ import annotations

import functools

import pytest
import thunder
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import thunder_overlap
from thunder_overlap import FSDPOverlap, OverlapConfig, schedule_stats
from thunder_overlap.analysis.classify import NodeKind, classify_trace
from thunder_overlap.tools.tiny_models import TinyGPT, TinyGPTConfig
from thunder_overlap.tools.training import collective_sequence

MODEL = TinyGPTConfig(n_layer=3, n_embd=32)
COLLECTIVE_WORDS = ("all_gather", "reduce_scatter", "wait")


@pytest.fixture(scope="module", autouse=True)
def fake_process_group():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    yield
    dist.destroy_process_group()


def _run(jm) -> tuple:
    torch.manual_seed(0)
    jm(torch.randint(0, MODEL.vocab_size, (2, 8))).sum().backward()
    return thunder.last_traces(jm)[-1], thunder.last_backward_traces(jm)[-1]


@functools.cache
def _traces(sharding: str = "zero3", config: OverlapConfig | None = None):
    """Final (forward, backward) traces; cached, as compiling dominates this module's time."""
    torch.manual_seed(0)
    jm = thunder_overlap.fsdp(TinyGPT(MODEL), device="cpu", sharding_strategy=sharding, config=config)
    return _run(jm)


def _compute_outputs(trace) -> list[str]:
    annotated = classify_trace(trace)
    return [n.outputs[0] for n in annotated.nodes if n.kind is NodeKind.COMPUTE and n.outputs]


@pytest.mark.parametrize("sharding", ["zero2", "zero3"])
def test_collectives_are_top_level_and_named(sharding):
    for trace in _traces(sharding):
        annotated = classify_trace(trace)
        movers = [n for n in annotated.nodes if n.kind in (NodeKind.COLLECTIVE, NodeKind.WAIT)]
        assert movers
        assert all(any(w in n.name for w in COLLECTIVE_WORDS) for n in movers)


def test_compute_order_is_unchanged_by_scheduling():
    torch.manual_seed(0)
    jm = thunder_overlap.fsdp(TinyGPT(MODEL), device="cpu", sharding_strategy="zero3")
    _run(jm)
    for history in (thunder.last_traces(jm), thunder.last_backward_traces(jm)):
        before = next(t for t in reversed(history) if "memory_aware schedule" not in str(t.get_provenance()))
        after = history[-1]
        assert "memory_aware schedule" in str(after.get_provenance())
        assert _compute_outputs(after) == _compute_outputs(before)


def test_waits_on_one_group_follow_issue_order():
    for trace in _traces("zero3"):
        annotated = classify_trace(trace)
        position = {n.index: i for i, n in enumerate(annotated.nodes)}
        by_group: dict[int, list] = {}
        for c in annotated.collectives:
            by_group.setdefault(c.group_key, []).append(c)
        for colls in by_group.values():
            issue_order = sorted(colls, key=lambda c: position[c.start])
            wait_order = sorted(colls, key=lambda c: position[c.wait])
            assert issue_order == wait_order


def test_count_limit_bounds_allgathers_in_flight():
    unlimited = [schedule_stats(t) for t in _traces(config=OverlapConfig(max_in_flight_allgather_bytes=10**12))]
    limited = [schedule_stats(t) for t in _traces(config=OverlapConfig(max_in_flight_allgathers=2))]
    assert max(s.max_allgathers_in_flight for s in unlimited) > 2, "the limit would not be exercised"
    for stats in limited:
        assert stats.max_allgathers_in_flight <= 2
        assert stats.allgather_overlap_fraction >= 0.9


def test_byte_limits_bound_bytes_in_flight():
    block_bytes = thunder_overlap.blocks.largest_block_bytes(TinyGPT(MODEL))
    limit = block_bytes // 2
    config = OverlapConfig(max_in_flight_allgather_bytes=limit, max_in_flight_reduce_scatter_bytes=limit)
    forward, backward = (schedule_stats(t) for t in _traces(config=config))
    largest_param = max(p.numel() * p.element_size() for p in TinyGPT(MODEL).parameters())
    # A single collective larger than the limit is still issued (alone); everything else fits.
    for stats in (forward, backward):
        assert stats.peak_allgather_bytes_in_flight <= max(limit, largest_param)
    assert 0 < backward.peak_reduce_scatter_bytes_in_flight <= max(limit, largest_param)


def test_stock_policy_keeps_thunder_order():
    forward, backward = (schedule_stats(t) for t in _traces(config=OverlapConfig(policy="stock")))
    assert forward.max_allgathers_in_flight == forward.allgathers  # all issued before any wait
    assert backward.reduce_scatters_overlapped == 0


def test_identical_models_get_identical_schedules():
    first = [collective_sequence(t) for t in _traces("zero3")]
    second = [collective_sequence(t) for t in _traces.__wrapped__("zero3")]
    assert first == second


def test_plugin_by_name_uses_the_defaults():
    from thunder.recipes import BaseRecipe

    torch.manual_seed(0)
    forward, backward = _run(thunder.compile(TinyGPT(MODEL), recipe=BaseRecipe(fuser="torch.compile"), plugins="fsdp-overlap"))
    assert schedule_stats(forward).allgathers > 0
    assert schedule_stats(backward).allgathers == 0  # the default is ZeRO2
    assert schedule_stats(backward).reduce_scatters > 0


def test_plugin_by_instance():
    from thunder.recipes import BaseRecipe

    torch.manual_seed(0)
    # On CPU the only fuser is torch.compile, which would otherwise swallow the collectives.
    jm = thunder.compile(
        TinyGPT(MODEL),
        recipe=BaseRecipe(fuser="torch.compile"),
        plugins=[FSDPOverlap(sharding_strategy="zero3", device="cpu")],
    )
    forward, backward = _run(jm)
    assert schedule_stats(backward).allgathers > 0  # ZeRO3 re-gathers in backward
    assert schedule_stats(forward).allgathers > 0


def test_transforms_compose_with_thunder_jit():
    transforms = thunder_overlap.fsdp_transforms(
        device=torch.device("cpu"),
        process_group=dist.distributed_c10d._get_default_group(),
        sharding_strategy=thunder.distributed.FSDPType.ZERO3,
    )
    torch.manual_seed(0)
    forward, backward = _run(thunder.jit(TinyGPT(MODEL), transforms=transforms))
    assert schedule_stats(backward).allgathers > 0
    assert schedule_stats(forward).max_allgathers_in_flight < schedule_stats(forward).allgathers


def test_already_jitted_module_is_accepted():
    torch.manual_seed(0)
    jm = thunder_overlap.fsdp(thunder.jit(TinyGPT(MODEL)), device="cpu", sharding_strategy="zero3")
    forward, backward = _run(jm)
    assert schedule_stats(backward).allgathers > 0


def test_fusing_executor_cannot_swallow_collectives():
    from thunder.executors.torch_compile import torch_compile_ex

    torch.manual_seed(0)
    jm = thunder_overlap.fsdp(TinyGPT(MODEL), device="cpu", executors=[torch_compile_ex])
    forward, _ = _run(jm)
    assert schedule_stats(forward).allgathers > 0


def test_collectives_fused_by_a_prejitted_module_raise_a_clear_error():
    from thunder.executors.torch_compile import torch_compile_ex

    torch.manual_seed(0)
    jm = thunder_overlap.fsdp(thunder.jit(TinyGPT(MODEL), executors=[torch_compile_ex]), device="cpu")
    with pytest.raises(RuntimeError, match="collectives were fused into .*torchcompile"):
        _run(jm)


class _NoBlocks(torch.nn.Module):
    """Parameters in plain attributes: no container of blocks to size prefetching by."""

    depth = 8

    def __init__(self) -> None:
        super().__init__()
        for i in range(self.depth):
            self.add_module(f"layer{i}", torch.nn.Linear(16, 16))

    def forward(self, x):
        for i in range(self.depth):
            x = torch.tanh(getattr(self, f"layer{i}")(x))
        return x


def test_a_model_without_blocks_falls_back_to_a_count_limit():
    config = OverlapConfig(fallback_in_flight_allgathers=3)
    with pytest.warns(UserWarning, match="has no nn.ModuleList/nn.Sequential of blocks .* to 3"):
        jm = thunder_overlap.fsdp(_NoBlocks(), device="cpu", sharding_strategy="zero3", config=config)
    jm(torch.ones(2, 16)).sum().backward()
    forward = schedule_stats(thunder.last_traces(jm)[-1])
    assert forward.allgathers == 16
    assert forward.max_allgathers_in_flight <= 3
