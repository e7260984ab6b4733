"""The bucket pool's slot plan on synthetic live intervals: as many slots as intervals overlap."""

from __future__ import annotations

import random

import pytest

from thunder_overlap.analysis.pool_slots import PoolInterval, max_overlap, plan_slots

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
