"""The bucket pool's slot plan on synthetic live intervals: as many slots as intervals overlap."""

from __future__ import annotations

import random

import pytest

from thunder_overlap._analysis.layout import BucketLayout, GatherPath, ReducePath
from thunder_overlap._analysis.pool_slots import (
    PoolInterval,
    ReduceScatterIssue,
    fewest_per_tensor_gathers,
    fewest_reduce_scatters_from_copy,
    intervals_gathered_in_place,
    intervals_reduced_from_copy,
    max_overlap,
    plan_shards_in_pool,
    plan_slots,
)
from thunder_overlap._backends import GLOO, NCCL

BLOCK, SMALL = 1000, 10


def _use(user: str, start: int, end: int, numel: int = BLOCK, dtype: str = "torch.float32") -> PoolInterval:
    return PoolInterval(user, numel, dtype, 4 if dtype == "torch.float32" else 2, start, end)


def test_a_buffer_is_reused_once_its_use_has_ended():
    # A gather copied out at 2 and freed at 3: the copy-out overlaps it, the next gather reuses it.
    plan = plan_slots([_use("b0 all-gather", 0, 3), _use("b0 copy-out", 2, 6), _use("b1 all-gather", 3, 7)])
    assert [slot.users for slot in plan.slots] == [("b0 all-gather", "b1 all-gather"), ("b0 copy-out",)]
    assert plan.nbytes == 2 * BLOCK * 4


def test_sizes_and_dtypes_never_share_a_buffer():
    plan = plan_slots([
        _use("big", 0, 1),
        _use("small", 1, 2, numel=SMALL),
        _use("half", 2, 3, dtype="torch.bfloat16"),
        _use("big again", 3, 4),
    ])
    assert plan.counts() == {(BLOCK, "torch.float32"): 1, (SMALL, "torch.float32"): 1, (BLOCK, "torch.bfloat16"): 1}
    assert plan.nbytes == BLOCK * 4 + SMALL * 4 + BLOCK * 2


def test_empty_uses_hold_nothing_and_backward_intervals_are_refused():
    assert plan_slots([_use("empty", 4, 4)]).slots == ()
    with pytest.raises(ValueError, match="ends \\(1\\) before it starts \\(2\\)"):
        _use("backward", 2, 1)


@pytest.mark.parametrize("seed", range(20))
def test_slots_equal_the_most_intervals_alive_at_once(seed):
    rng = random.Random(seed)
    uses = []
    for i in range(rng.randint(1, 60)):
        start = rng.randint(0, 100)
        uses.append(_use(f"u{i}", start, start + rng.randint(0, 30), numel=rng.choice([BLOCK, SMALL])))
    assert plan_slots(uses).counts() == max_overlap(uses)


def _layout(label: str, backend=GLOO, *, padded: bool = False) -> BucketLayout:
    return BucketLayout.default(
        label, unsharded_numel=BLOCK, dtype="torch.float32", itemsize=4, tensors=3, world_size=2, backend=backend, padded=padded
    )


def _issue(label: str, start: int, laid_out: bool = False) -> ReduceScatterIssue:
    return ReduceScatterIssue(label, _layout(label), start, f"{label} reduce-scatter" if laid_out else None)


def test_zero2_reduces_every_bucket_in_the_buffer_its_gather_left():
    # ZeRO2: three gathers live from the forward to their block's backward (end 10, 14, 18, in
    # reverse); each reduce-scatter comes right after, when that buffer is idle to the end (20).
    gathers = [_use("b2 all-gather", 0, 10), _use("b1 all-gather", 1, 14), _use("b0 all-gather", 2, 18)]
    issues = [_issue("b2", 10), _issue("b1", 14), _issue("b0", 18)]
    chosen = plan_shards_in_pool(gathers, issues, step_end=20)
    assert [i.layout.label for i in chosen] == ["b2", "b1", "b0"]


def test_a_reduce_scatter_that_would_add_a_buffer_keeps_its_own_shard():
    # ZeRO3: two buffers alternate between gathers to the end; the first reduce-scatter (at 4)
    # would hold one from 4 to the end while two later gathers need both: refused. The last
    # (at 12, a laid-out one whose own interval is replaced) finds one idle to the end.
    gathers = [_use("g0", 0, 4), _use("g1", 2, 8), _use("g2", 4, 12), _use("g3", 8, 14)]
    laid_out = _use("b3 reduce-scatter", 14, 15)
    issues = [_issue("b0", 4), _issue("b3", 14, laid_out=True)]
    chosen = plan_shards_in_pool([*gathers, laid_out], issues, step_end=20)
    assert [i.layout.label for i in chosen] == ["b3"]


@pytest.mark.parametrize("seed", range(20))
def test_reducing_in_the_pool_never_grows_it(seed):
    rng = random.Random(seed)
    uses, issues = [], []
    for i in range(rng.randint(1, 30)):
        start = rng.randint(0, 100)
        uses.append(_use(f"u{i}", start, start + rng.randint(1, 30)))
    for i in range(rng.randint(1, 8)):
        issues.append(_issue(f"b{i}", rng.randint(0, 130)))
    chosen = plan_shards_in_pool(uses, issues, step_end=140)
    in_place = [_use(f"{i.layout.label} in place", i.start, 140) for i in chosen]
    assert max_overlap([*uses, *in_place]).get((BLOCK, "torch.float32"), 0) <= max_overlap(uses).get((BLOCK, "torch.float32"), 0)
    # And every one left out would have grown it, taken after those chosen before it.
    for issue in issues:
        if issue not in chosen:
            earlier = [_use("in place", i.start, 140) for i in chosen if i.start <= issue.start]
            trial = [*uses, *earlier, _use("trial", issue.start, 140)]
            assert max_overlap(trial)[(BLOCK, "torch.float32")] > max_overlap(uses).get((BLOCK, "torch.float32"), 0)


def test_a_gather_in_place_keeps_its_buffer_as_long_as_its_copy_out_was():
    # b0 gathered at 0, copied out at 2 (the gather's future dies at 3), parameters alive to 6.
    uses = [_use("b0 all-gather", 0, 3), _use("b0 copy-out", 2, 6), _use("b0 reduce-scatter", 7, 9), _use("b1 all-gather", 3, 7)]
    merged = intervals_gathered_in_place(uses, ["b0"])
    assert merged == [_use("b0 all-gather", 0, 6), _use("b0 reduce-scatter", 7, 9), _use("b1 all-gather", 3, 7)]
    assert intervals_gathered_in_place(uses, ["b1"]) == uses  # b1 has no copy-out
    # ZeRO3 gathers a bucket twice: each copy-out merges into its own gather.
    twice = [_use("b0 all-gather", 0, 2), _use("b0 copy-out", 1, 4), _use("b0 all-gather", 10, 12), _use("b0 copy-out", 11, 15)]
    assert intervals_gathered_in_place(twice, ["b0"]) == [_use("b0 all-gather", 0, 4), _use("b0 all-gather", 10, 15)]


def test_only_the_gathers_in_place_the_smallest_pool_needs_are_taken():
    # ZeRO2's forward, one bucket ahead: each block's copy-out lives to the step's end (20); a
    # gather buffer is free once copied out and the next gather reuses it. Three buffers are busy
    # at each copy-out after the first (the copy-outs so far, and the gather being copied out).
    uses = [
        _use("b0 all-gather", 0, 3), _use("b0 copy-out", 2, 20),
        _use("b1 all-gather", 3, 6), _use("b1 copy-out", 5, 20),
        _use("b2 all-gather", 6, 9), _use("b2 copy-out", 8, 20),
    ]  # fmt: skip
    assert max_overlap(uses) == {(BLOCK, "torch.float32"): 4}
    everything = ["b0", "b1", "b2"]
    assert max_overlap(intervals_gathered_in_place(uses, everything)) == {(BLOCK, "torch.float32"): 3}
    # Three buffers need only the last block gathered in place: at b1's copy-out three are busy
    # anyway (b0's copy-out, b1's gather and copy-out), and so they are at the end.
    assert fewest_per_tensor_gathers(uses, everything) == ["b2"]
    assert fewest_per_tensor_gathers(uses, []) == []


@pytest.mark.parametrize("seed", range(20))
def test_gathers_in_place_never_grow_the_pool_and_the_fewest_keep_it_smallest(seed):
    rng = random.Random(seed)
    uses, candidates = [], []
    for b in range(rng.randint(1, 8)):
        start = rng.randint(0, 40)
        for _ in range(rng.randint(1, 2)):  # ZeRO3 gathers twice, the second after the first is done
            wait = start + rng.randint(1, 10)
            end = wait + rng.randint(1, 40)
            uses += [_use(f"b{b} all-gather", start, wait + rng.randint(1, 3)), _use(f"b{b} copy-out", wait, end)]
            start = end + rng.randint(0, 20)
        issue = rng.randint(0, 100)
        uses.append(_use(f"b{b} reduce-scatter", issue, issue + rng.randint(1, 10)))
        candidates.append(f"b{b}")

    _assert_never_grows_and_fewest_keep_smallest(uses, candidates, intervals_gathered_in_place, fewest_per_tensor_gathers, rng)


def _assert_never_grows_and_fewest_keep_smallest(uses, candidates, changed, fewest, rng) -> None:
    """Changing any subset of ``candidates`` (``changed``) never grows the pool, and ``fewest``
    keeps it as small as changing all of them, with none to spare."""

    def buffers(labels):
        return max_overlap(changed(uses, labels))[(BLOCK, "torch.float32")]

    smallest = buffers(candidates)
    for _ in range(5):
        assert smallest <= buffers([c for c in candidates if rng.random() < 0.5]) <= buffers([])
    chosen = fewest(uses, candidates)
    assert buffers(chosen) == smallest
    # Minimal: dropping any one of them would need a bigger pool.
    for label in chosen:
        assert buffers([c for c in chosen if c != label]) > smallest


def _zero3_backward_over_gloo(n_blocks: int) -> list[PoolInterval]:
    """ZeRO3's backward over gloo, one block ahead, 10 ops per block from block ``n_blocks - 1``
    down: block k's parameters copied out at its start and alive for 7 ops, the next block's
    gather issued right after and waited on at that block's start, and block k's laid-out
    gradients, all-reduced in place, busy from the end of its compute until the wait, 10 ops on."""
    uses = []
    for i, k in enumerate(reversed(range(n_blocks))):
        start = 10 * i
        uses += [_use(f"b{k} all-gather", start - 9, start + 1), _use(f"b{k} copy-out", start, start + 7)]
        uses.append(_use(f"b{k} reduce-scatter", start + 8, start + 18))
    return uses


def test_a_reduce_scatter_from_the_backends_copy_holds_its_lay_out_for_the_launch_only():
    uses = [_use("b0 all-gather", 0, 3), _use("b0 reduce-scatter", 4, 9), _use("b1 reduce-scatter", 5, 8)]
    shortened = intervals_reduced_from_copy(uses, ["b0"])
    assert shortened == [_use("b0 all-gather", 0, 3), _use("b0 reduce-scatter", 4, 5), _use("b1 reduce-scatter", 5, 8)]
    assert intervals_reduced_from_copy(uses, []) == uses


def test_zero3_over_gloo_needs_two_block_buffers_once_its_lay_outs_go_to_the_backends_copy():
    # Busy at a block's start: its copy-out, the gather it is copied from, and the block
    # before's lay-out; then the next gather takes the gather's place.
    uses = _zero3_backward_over_gloo(4)
    assert max_overlap(uses) == {(BLOCK, "torch.float32"): 3}
    everything = [f"b{k}" for k in range(4)]
    assert max_overlap(intervals_reduced_from_copy(uses, everything)) == {(BLOCK, "torch.float32"): 2}
    # The first block's lay-out comes once nothing else is busy but its own wait: it may hold
    # its buffer to the wait.
    assert fewest_reduce_scatters_from_copy(uses, everything) == ["b1", "b2", "b3"]
    assert fewest_reduce_scatters_from_copy(uses, []) == []


@pytest.mark.parametrize("seed", range(10))
def test_reduce_scatters_from_the_copy_never_grow_the_pool_and_the_fewest_keep_it_smallest(seed):
    rng = random.Random(seed)
    uses = [_use(f"b{b} {purpose}", start, start + rng.randint(1, 30)) for b in range(rng.randint(1, 8)) for purpose, start in (
        ("all-gather", rng.randint(0, 60)), ("copy-out", rng.randint(0, 60)), ("reduce-scatter", rng.randint(0, 60)),
    )]  # fmt: skip
    candidates = sorted({v.user.split()[0] for v in uses})
    _assert_never_grows_and_fewest_keep_smallest(uses, candidates, intervals_reduced_from_copy, fewest_reduce_scatters_from_copy, rng)


def test_a_layout_refuses_paths_its_backend_cannot_run():
    # One path per direction: reducing in the pool and from the backend's copy cannot both be set.
    gloo = _layout("b0")
    assert (gloo.gather, gloo.reduce) == (GatherPath.COPY_OUT, ReducePath.LAID_OUT)
    assert gloo.with_paths(reduce=ReducePath.FROM_COPY).reduce is ReducePath.FROM_COPY
    # On NCCL the buffer would be overwritten in flight: it keeps no copy of a reduce-scatter's input.
    nccl = gloo.as_on(NCCL)
    assert (nccl.gather, nccl.reduce) == (GatherPath.IN_PLACE, ReducePath.SEND)
    with pytest.raises(ValueError, match=r"bucket 'b0': nccl reads a reduce-scatter's input in flight"):
        nccl.with_paths(reduce=ReducePath.FROM_COPY)
    # Gradients that need padding, or several over gloo, cannot be sent where they are.
    assert _layout("b0", NCCL, padded=True).reduce is ReducePath.LAID_OUT
    with pytest.raises(ValueError, match=r"bucket 'b0': its gradients cannot be sent where they are"):
        gloo.with_paths(reduce=ReducePath.SEND)
    # Several tensors are never views of one gathered buffer.
    with pytest.raises(ValueError, match=r"gather path 'views' with 3 tensors on 2 ranks"):
        gloo.with_paths(gather=GatherPath.VIEWS)
