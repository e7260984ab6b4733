"""The dependence bound: a lower bound on a pass's time under any placement of its collectives,
with its compute in the order it has, tighter than max(compute, communication) where the data
flow leaves some communication nothing to hide behind.

thunder_overlap's scheduler moves collectives and keeps Thunder's compute order. A collective can
then start no earlier than the compute up to its last input's producer has run, and what depends
on its result computes from its first consumer on. On a link that runs one launch at a time, take
any set S of one group's collectives: the first of them to start waits for the compute before it,
the link runs the whole set, and the compute after the last still has to run. So no placement is
faster than

    min over S of the compute up to an issue's inputs + the set's time + min over S of the compute
    from a result's first use

for every S: the first forward all-gather (nothing computes before it) and the last backward
reduce-scatters (little computes after them) are the sets that bind. The bound keeps the
collectives as they are (buckets, coalesced launches): it says what no schedule of these ops can
beat, not what other buckets or another compute order could.

Local copies of bucketed collectives (lay-out, copy-out) and compute slowed by communication only
lengthen a pass, so leaving them out keeps this a lower bound. Links that run several launches at
once (gloo) are left to the busiest-link bound.
"""

from __future__ import annotations

from thunder_overlap._analysis.classify import AnnotatedTrace, NodeKind
from thunder_overlap._analysis.cost_model import CostModel
from thunder_overlap._analysis.simulator import collective_ancestry

__all__ = ["dependence_bound_ms"]


def dependence_bound_ms(annotated: AnnotatedTrace, cost_model: CostModel) -> float:
    """The largest bound over every group's sets of collectives (see the module's docstring),
    never below the compute's total."""
    above, below = collective_ancestry(annotated)
    count = len(annotated.collectives)
    compute = [(node.index, cost_model.compute_ms(node.bsym)) for node in annotated.nodes if node.kind is NodeKind.COMPUTE]
    total = sum(ms for _, ms in compute)
    before = [0.0] * count  # compute in order up to the last op feeding each issue
    after = [0.0] * count  # compute in order from the first op using each result
    done, used = 0.0, 0
    for index, ms in compute:
        for i in _bits(below[index] & ~used):
            after[i] = total - done
        used |= below[index]
        done += ms
        for i in _bits(above[index]):
            before[i] = done
    groups: dict[int, list[tuple[float, float, float]]] = {}
    for i, coll in enumerate(annotated.collectives):
        if cost_model.network_for(coll).concurrent_launches == 1:
            groups.setdefault(coll.group_key, []).append((before[i], cost_model.collective_ms(coll), after[i]))
    return max([total, *(_serial_link_bound(collectives) for collectives in groups.values())])


def _bits(mask: int):
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def _serial_link_bound(collectives: list[tuple[float, float, float]]) -> float:
    """max over sets S of min(before) + sum(duration) + min(after), given (before, duration,
    after) per collective: for each least ``before``, the best sets are those of every
    collective at or above it and at or above some least ``after``."""
    best = 0.0
    for least_before in {b for b, _, _ in collectives}:
        chosen = sorted(((a, d) for b, d, a in collectives if b >= least_before), reverse=True)
        total = 0.0
        for i, (after, duration) in enumerate(chosen):
            total += duration
            # Sets end where ``after`` drops: every collective at or above it is in.
            if i + 1 == len(chosen) or chosen[i + 1][0] < after:
                best = max(best, least_before + total + after)
    return best
