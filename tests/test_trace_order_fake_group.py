"""Schedules of real final traces, in one process on the fake process group (4 ranks).

Collectives on the fake group complete at once, so these tests look at trace order and in-flight
accounting, not numerics (tests/test_e2e_two_ranks.py checks numerics on real gloo ranks).
"""

from __future__ import annotations

import functools

import pytest
import thunder
import torch
import torch.distributed as dist
from thunder.core import prims
from thunder.core.trace import TraceTag, from_trace
from thunder.executors.passes import del_last_used
from thunder.executors.pythonex import clear_mutable_collection

import thunder_overlap
from thunder_overlap import FSDPOverlap, OverlapConfig, schedule_stats
from thunder_overlap._analysis.blocks import largest_block_bytes
from thunder_overlap._analysis.classify import AnnotatedTrace, Collective, CollectiveKind, NodeKind, classify_trace, is_expensive
from thunder_overlap._scheduling.orders import with_deletions
from thunder_overlap._transforms.zero3 import Zero3Transform
from thunder_overlap.config import Tuning
from thunder_overlap.report._builtin_models import TinyGPT, TinyGPTConfig
from thunder_overlap.testing.training import collective_sequence

# Two blocks: one block's all-gathers can go out among the other's compute (where a fusion could
# also swallow them), and the limits below bind within and across blocks.
MODEL = TinyGPTConfig(n_layer=2, n_embd=32)
COLLECTIVE_WORDS = ("all_gather", "reduce_scatter", "wait")
# Half a block each way: more than any one parameter, less than what the default prefetches.
BYTE_LIMIT = largest_block_bytes(TinyGPT(MODEL)) // 2
# Configurations whose schedules every order test below checks: the default, each limit alone
# pushed until it binds, and the policies at both ends.
CONFIGS = {
    "default": None,
    "count limit": OverlapConfig(_tuning=Tuning(max_in_flight_allgathers=2)),
    # Below the largest parameters: they go out with a limit they exceed (test_byte_limits_bound_bytes_in_flight
    # checks the bound with it and with BYTE_LIMIT).
    "byte limit": OverlapConfig(max_in_flight_allgather_bytes=10_000, _tuning=Tuning(max_in_flight_reduce_scatter_bytes=10_000)),
    "greedy": OverlapConfig(policy="greedy"),
    "just_in_time": OverlapConfig(policy="just_in_time"),
}

# Every test here traces models with Thunder (seconds each), several through module-wide caches.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fake_group_4")]


def _final_traces(jm) -> tuple:
    return thunder.last_traces(jm)[-1], thunder.last_backward_traces(jm)[-1]


def _run(jm) -> tuple:
    torch.manual_seed(0)
    jm(torch.randint(0, MODEL.vocab_size, (2, 8))).sum().backward()
    return _final_traces(jm)


def _traced(jm) -> tuple:
    """The final traces of a first step, built as a call builds them but not run (the report
    traces so): the same traces as _run's, without Inductor compiling every torch.compile fusion,
    which is most of such a test's time. test_fusing_executor_cannot_swallow_collectives_or_the_schedule
    runs them (ZeRO3, forward and backward), as tests/test_cli_without_torch.py runs the README's
    plugin line."""
    torch.manual_seed(0)
    thunder.compile_data(jm).get_computation_and_inputs(torch.randint(0, MODEL.vocab_size, (2, 8)))
    return _final_traces(jm)


@functools.cache
def _stepped(sharding: str, config: OverlapConfig | None):
    """A model sharded as asked, after one step; cached, as compiling dominates this module's
    time. The tests only read its traces."""
    torch.manual_seed(0)
    jm = thunder_overlap.fsdp(TinyGPT(MODEL), device="cpu", sharding_strategy=sharding, config=config)
    _run(jm)
    return jm


def _traces(sharding: str = "zero3", config: OverlapConfig | None = None):
    """Final (forward, backward) traces. Positional arguments for the cache: it would key
    ``_traces("zero3")`` and ``_traces(config=None)`` apart and compile the same model twice."""
    return _final_traces(_stepped(sharding, config))


@pytest.fixture(scope="module", autouse=True)
def _forget_traces_with_the_group():
    yield
    _stepped.cache_clear()  # they refer to this module's process group


def _compute_outputs(trace) -> list[str]:
    annotated = classify_trace(trace)
    return [n.outputs[0] for n in annotated.nodes if n.kind is NodeKind.COMPUTE and n.outputs]


def _shard_name(parameter_name: str) -> str:
    """The trace input holding a parameter's local shard."""
    return "t_" + parameter_name.replace(".", "_")


def _gathered(annotated: AnnotatedTrace) -> list[str]:
    """The shards all-gathered, one per member of each (possibly coalesced) all-gather launch."""
    return [name for c in annotated.collectives if c.kind is CollectiveKind.ALL_GATHER for name in annotated.nodes[c.start].inputs]


def _reduce_scatters(annotated: AnnotatedTrace) -> list[Collective]:
    return [c for c in annotated.collectives if c.kind is CollectiveKind.REDUCE_SCATTER]


def _expected_collectives(model: torch.nn.Module, kept: frozenset[str]) -> tuple[list[str], int, list[str]]:
    """What one step of ``model`` must move: the forward gathers every parameter once (tied ones
    once), the backward reduce-scatters every trainable one, and ZeRO3 re-gathers the parameters
    the backward reads: weights of matmuls (input gradients), of norms and the tied head, but no
    bias (its gradient does not read it) and not the position embedding (a lookup's gradient
    does not read the table), nor the ``kept`` ones, saved gathered from the forward
    ([Note: ZeRO3 keeps what is free])."""
    named = dict(model.named_parameters())
    forward = sorted(_shard_name(n) for n in named)
    trainable = sum(p.requires_grad for p in named.values())
    regathered = sorted(_shard_name(n) for n in named if n.endswith(".weight") and n != "wpe.weight" and n not in kept)
    return forward, trainable, regathered


def _kept(jm) -> frozenset[str]:
    """The parameters ZeRO3 kept gathered to the backward (none under ZeRO2)."""
    zero3 = Zero3Transform.of(jm)
    return frozenset() if zero3 is None else zero3.kept_parameters()


# What plain ZeRO3 keeps of MODEL without buckets: the units its backward needs first, up to its
# last block, which is not free at this batch (tests/test_selective_unsharding_one_rank.py keeps
# a block too).
KEPT = frozenset({"wte.weight", "norm_f.weight"})


def _assert_moves_each_parameter_once(
    forward, backward, sharding: str, *, kept: frozenset[str] = frozenset(), exact_regathers: bool = True
) -> None:
    expected_forward, trainable, regathered = _expected_collectives(TinyGPT(MODEL), kept)
    forward_annotated, backward_annotated = classify_trace(forward), classify_trace(backward)
    assert sorted(_gathered(forward_annotated)) == expected_forward
    assert not _reduce_scatters(forward_annotated)
    assert sum(c.members for c in _reduce_scatters(backward_annotated)) == trainable
    backward_gathers = _gathered(backward_annotated)
    assert len(set(backward_gathers)) == len(backward_gathers), "a parameter is re-gathered twice"
    if sharding == "zero2":
        assert backward_gathers == []
    elif exact_regathers:
        assert sorted(backward_gathers) == regathered
    else:
        assert set(regathered) <= set(backward_gathers) <= set(expected_forward) - {_shard_name(n) for n in kept}


def _has_compute_between_issue_and_wait(annotated: AnnotatedTrace, collective: Collective) -> bool:
    return any(annotated.nodes[i].kind is NodeKind.COMPUTE for i in range(collective.start + 1, collective.wait))


@pytest.mark.parametrize("sharding", ["zero2", "zero3"])
def test_one_collective_per_parameter_and_pass(sharding):
    kept = _kept(_stepped(sharding, None))
    assert kept == (KEPT if sharding == "zero3" else frozenset())
    _assert_moves_each_parameter_once(*_traces(sharding), sharding, kept=kept)


@pytest.mark.parametrize("sharding", ["zero2", "zero3"])
def test_collectives_are_top_level_and_named(sharding):
    for trace in _traces(sharding):
        annotated = classify_trace(trace)
        movers = [n for n in annotated.nodes if n.kind in (NodeKind.COLLECTIVE, NodeKind.WAIT)]
        assert movers
        assert all(any(w in n.name for w in COLLECTIVE_WORDS) for n in movers)


def test_compute_order_is_unchanged_by_scheduling():
    jm = _stepped("zero3", None)
    for history in (thunder.last_traces(jm), thunder.last_backward_traces(jm)):
        before = next(t for t in reversed(history) if "memory_aware schedule" not in str(t.get_provenance()))
        after = history[-1]
        assert "memory_aware schedule" in str(after.get_provenance())
        assert _compute_outputs(after) == _compute_outputs(before)


def _deletions_key(trace) -> list:
    """The bound symbols, deletions and clearings by what they name (each pass builds its own),
    every other by identity (the passes keep them)."""
    regenerated = (prims.PrimIDs.DEL, clear_mutable_collection.id)
    return [(b.sym.id, [p.name for p in b.flat_proxy_args]) if b.sym.id in regenerated else id(b) for b in trace.bound_symbols]


@pytest.mark.parametrize("sharding", ["zero2", "zero3"])
def test_regenerated_deletions_are_thunders(sharding):
    """with_deletions places what Thunder's del_last_used places, in the same order, on final
    traces as they are (earlier deletions and clearings in them) and stripped of deletions."""
    for trace in _traces(sharding):
        backward = TraceTag.BACKWARD in trace.tags
        stripped = from_trace(trace)
        stripped.bound_symbols = [b for b in trace.bound_symbols if b.sym.id is not prims.PrimIDs.DEL]
        for given in (trace, stripped):
            ours = with_deletions(given, clear_collections=backward)
            assert _deletions_key(ours) == _deletions_key(del_last_used(given, clear_mutable_collections=backward))
            assert any(b.sym.id is prims.PrimIDs.DEL for b in ours.bound_symbols)


@pytest.mark.parametrize("name", CONFIGS)
def test_every_policy_and_limit_keeps_thunders_compute_order_and_moves_each_parameter_once(name):
    stock = _traces(config=OverlapConfig(policy="stock"))
    scheduled = _traces(config=CONFIGS[name])
    for trace, reference in zip(scheduled, stock, strict=True):
        assert _compute_outputs(trace) == _compute_outputs(reference)
    # The choice is made on the traces before scheduling: the same under every policy and limit.
    jm = _stepped("zero3", CONFIGS[name])
    assert _kept(jm) == KEPT
    # Its step is predicted as scheduled only where a budget reads memory (a kept unit can cost
    # prefetching only there).
    reads_memory = (CONFIGS[name] or OverlapConfig()).policy.reads_memory
    assert (Zero3Transform.of(jm).choice.scheduled is not None) == reads_memory
    _assert_moves_each_parameter_once(*scheduled, "zero3", kept=KEPT)


@pytest.mark.parametrize("name", CONFIGS)
def test_waits_follow_their_issue_in_issue_order(name):
    for trace in _traces(config=CONFIGS[name]):
        annotated = classify_trace(trace)
        for c in annotated.collectives:
            assert c.start < c.wait
        # One process group: its collectives complete in the order they were issued.
        assert len({c.group_key for c in annotated.collectives}) == 1
        assert sorted(annotated.collectives, key=lambda c: c.start) == sorted(annotated.collectives, key=lambda c: c.wait)


# The overlapping policies without a byte limit (a binding one may force a wait early to make
# room for the next issue; just_in_time issues each collective right before its wait instead).
@pytest.mark.parametrize("name", ["default", "count limit", "greedy"])
def test_allgather_waits_sit_right_before_first_use(name):
    for trace in _traces(config=CONFIGS[name]):
        annotated = classify_trace(trace)
        # No compute runs between an all-gather's wait and the first op that reads its result
        # (a reduce-scatter's wait may come early: the memory budget forces the oldest ones).
        for c in annotated.collectives:
            if c.kind is CollectiveKind.ALL_GATHER:
                first_use = annotated.consumers[annotated.nodes[c.wait].outputs[0]][0]
                between = annotated.nodes[c.wait + 1 : first_use]
                assert all(n.kind is not NodeKind.COMPUTE for n in between), f"{annotated.nodes[c.wait].name} waits early"


def test_count_limit_bounds_allgathers_in_flight():
    unlimited = [schedule_stats(t) for t in _traces(config=CONFIGS["greedy"])]
    limited = _traces(config=CONFIGS["count limit"])
    assert max(s.max_allgathers_in_flight for s in unlimited) > 2, "the limit would not be exercised"
    for trace in limited:
        assert schedule_stats(trace).max_allgathers_in_flight <= 2
    # Two ahead are still enough for compute to run under every forward all-gather but the first.
    forward = classify_trace(limited[0])
    gathers = [c for c in forward.collectives if c.kind is CollectiveKind.ALL_GATHER]
    hidden = [_has_compute_between_issue_and_wait(forward, c) for c in sorted(gathers, key=lambda c: c.start)]
    assert sum(hidden) >= len(gathers) - 2, hidden


def _largest_module_bytes(model: torch.nn.Module) -> int:
    """The most parameter bytes one module holds itself: what one of its ops (a linear's weight and
    bias) reads at once, so what must be gathered together whatever a limit says."""
    return max(sum(p.numel() * p.element_size() for p in m.parameters(recurse=False)) for m in model.modules())


@pytest.mark.parametrize("limit", [BYTE_LIMIT, 10_000], ids=["half a block", "below one module"])
def test_byte_limits_bound_bytes_in_flight(limit):
    config = OverlapConfig(max_in_flight_allgather_bytes=limit, _tuning=Tuning(max_in_flight_reduce_scatter_bytes=limit))
    if limit == 10_000:
        assert config == CONFIGS["byte limit"]  # the same compile as the ordering checks'
    forward, backward = (schedule_stats(t) for t in _traces(config=config))
    unlimited = [schedule_stats(t) for t in _traces(config=CONFIGS["greedy"])]
    assert max(s.peak_allgather_bytes_in_flight for s in unlimited) > limit, "the limit would not be exercised"
    model = TinyGPT(MODEL)
    largest_param = max(p.numel() * p.element_size() for p in model.parameters())
    # Within the limit, except where one op reads more than it: a linear's weight and bias are
    # gathered for it together, whatever the limit.
    for stats in (forward, backward):
        assert stats.peak_allgather_bytes_in_flight <= max(limit, _largest_module_bytes(model))
    if limit < largest_param:  # and what exceeds the limit alone still goes out
        assert forward.peak_allgather_bytes_in_flight > limit
    # A reduce-scatter larger than the limit goes out alone: each has its own wait.
    assert 0 < backward.peak_reduce_scatter_bytes_in_flight <= max(limit, largest_param)


def test_stock_policy_keeps_thunder_order():
    forward, backward = (classify_trace(t) for t in _traces(config=OverlapConfig(policy="stock")))
    # Forward: every all-gather is issued before the first compute op.
    first_compute = next(n.index for n in forward.nodes if n.kind is NodeKind.COMPUTE)
    assert all(c.start < first_compute for c in forward.collectives)
    # Backward: every reduce-scatter is issued after the last matmul, so none overlaps one.
    last_matmul = max(n.index for n in backward.nodes if n.kind is NodeKind.COMPUTE and is_expensive(n.bsym))
    assert all(c.start > last_matmul for c in _reduce_scatters(backward))


def test_plugin_by_name_uses_the_defaults():
    from thunder.recipes import BaseRecipe

    torch.manual_seed(0)
    forward, backward = _traced(thunder.compile(TinyGPT(MODEL), recipe=BaseRecipe(fuser="torch.compile"), plugins="fsdp-overlap"))
    _assert_moves_each_parameter_once(forward, backward, "zero2")  # the default is ZeRO2


def test_plugin_by_instance():
    from thunder.recipes import BaseRecipe

    torch.manual_seed(0)
    # On CPU the only fuser is torch.compile, which would otherwise swallow the collectives.
    jm = thunder.compile(
        TinyGPT(MODEL),
        recipe=BaseRecipe(fuser="torch.compile"),
        plugins=[FSDPOverlap(sharding_strategy="zero3", device="cpu")],
    )
    # Under the torch.compile fuser's recipe the backward also re-gathers the norms' biases.
    _assert_moves_each_parameter_once(*_traced(jm), "zero3", kept=_kept(jm), exact_regathers=False)


def test_transforms_compose_with_thunder_jit():
    transforms = thunder_overlap.fsdp_transforms(
        device=torch.device("cpu"),
        process_group=dist.distributed_c10d._get_default_group(),
        sharding_strategy=thunder.distributed.FSDPType.ZERO3,
    )
    torch.manual_seed(0)
    jm = thunder.jit(TinyGPT(MODEL), transforms=transforms)
    forward, backward = _run(jm)
    _assert_moves_each_parameter_once(forward, backward, "zero3", kept=KEPT)
    assert _kept(jm) == KEPT
    assert schedule_stats(forward).max_allgathers_in_flight < schedule_stats(forward).allgathers
    # Another compile of the same model, through another entry point: the same schedule.
    assert [collective_sequence(t) for t in (forward, backward)] == [collective_sequence(t) for t in _traces("zero3")]


def test_already_jitted_module_is_accepted():
    torch.manual_seed(0)
    jm = thunder_overlap.fsdp(thunder.jit(TinyGPT(MODEL)), device="cpu", sharding_strategy="zero3")
    forward, backward = _run(jm)
    _assert_moves_each_parameter_once(forward, backward, "zero3", kept=KEPT)
    assert [collective_sequence(t) for t in (forward, backward)] == [collective_sequence(t) for t in _traces("zero3")]


def test_fusing_executor_cannot_swallow_collectives_or_the_schedule(monkeypatch):
    """Thunder's torchcompile executor would fuse each pass into one region after every wait
    ([Note: fusing executors]): matmuls stay top-level, compute runs between the waits, and ZeRO3
    re-gathers what the backward reads of the units it did not keep, not a gathered weight the
    fusion kept from the forward. The step runs, each region compiled by
    Dynamo as one graph, on Dynamo's eager backend: what is fused, and that it compiles, is the
    executor's and Dynamo's work checked here; Inductor's kernels for the regions are PyTorch's
    own, and on a cold cache their C++ compilation took 35 of this test's 50 s."""
    from thunder.executors.torch_compile import torch_compile_ex

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    torch.manual_seed(0)
    jm = thunder_overlap.fsdp(
        TinyGPT(MODEL), device="cpu", sharding_strategy="zero3", jit_options={"executors": [torch_compile_ex]}
    )
    forward, backward = _run(jm)
    _assert_moves_each_parameter_once(forward, backward, "zero3", kept=KEPT)
    assert _kept(jm) == KEPT
    for trace in (forward, backward):
        fusions = [b for b in trace.bound_symbols if b.sym.is_fusion]
        assert fusions, "the torchcompile executor fused nothing: the test no longer tests it"
        fused_matmuls = [s.sym.name for f in fusions for s in f.subsymbols if is_expensive(s)]
        assert not fused_matmuls, f"matmuls fused into a region, where the schedule cannot place collectives around them: {fused_matmuls}"
    nodes = classify_trace(forward).nodes
    waits = [i for i, n in enumerate(nodes) if n.kind is NodeKind.WAIT]
    matmuls = [i for i, n in enumerate(nodes) if n.kind is NodeKind.COMPUTE and is_expensive(n.bsym)]
    assert matmuls[0] < waits[-1], "every all-gather is waited on before the forward's first matmul: nothing overlaps"


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
    config = OverlapConfig(_tuning=Tuning(fallback_in_flight_allgathers=3))
    with pytest.warns(UserWarning, match="has no nn.ModuleList/nn.Sequential of blocks .* to 3"):
        jm = thunder_overlap.fsdp(_NoBlocks(), device="cpu", sharding_strategy="zero3", config=config)
    jm(torch.ones(2, 16)).sum().backward()
    forward = schedule_stats(thunder.last_traces(jm)[-1])
    assert forward.allgathers == 16
    assert forward.max_allgathers_in_flight <= 3
