"""Ranks agree on their settings and on one issue order of collectives, so that they pair up and
never hang.

0. The first time any pass compiles, ranks compare every setting that shapes what they exchange
   and launch (:func:`agree_settings`: the OverlapConfig, the fsdp options, the bucket plan's
   digest) in one small all-gather, before any other exchange: ranks whose settings differ would
   make different numbers of exchanges and launches, so every rank raises, naming the fields.

Before any of that, ``fsdp()`` has the ranks compare their initial weights
(:func:`first_differing_value`, in ``_transforms/same_init.py``).

Every rank must issue the same collectives in the same order on a process group. The scheduler's
order depends on estimates (compute time, activation memory) that follow each rank's own input
shapes, and a rank retraces alone when its batch changes shape. So the order is fixed once:

1. The first time a pass (forward or backward, with a given set of collectives) compiles, every
   rank is there: the first step runs on every rank. Ranks schedule with their own estimates,
   then exchange their issue orders in one object all-gather. They must move the same
   collectives (else every rank raises, naming the ranks and the first differing collective),
   and all adopt the first rank's order.
2. Every later compile of that pass (a retrace for a new shape, on one rank or all) schedules
   with the agreed order as a constraint: placement around compute may follow the new shapes,
   which collective comes before which may not. No rank communicates to do so, so a rank that
   retraces alone cannot pair a check with its peers' collectives.

Ranks agree on the coalesced launches (:mod:`~thunder_overlap._scheduling.launches`) in the same
exchange: which collectives go out together is part of what must pair up. A retrace reproduces
the agreed launches.

Collectives are identified across traces by :class:`CollectiveKey`: kind, dtype, the shape of
what they move (parameter shapes, never activation shapes) and how many equal ones precede them
in Thunder's own order, which follows the parameters.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch.distributed as dist

from thunder_overlap._analysis.classify import AnnotatedTrace
from thunder_overlap._analysis.passes import Pass

__all__ = [
    "CollectiveKey",
    "Difference",
    "IssueOrderAgreement",
    "PrefixAgreement",
    "agree_settings",
    "agreed_prefix",
    "agreed_subset",
    "collective_keys",
    "exchange_is_possible",
    "first_differing_value",
    "ranks_where",
    "summed_over_ranks",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CollectiveKey:
    """A collective's identity that does not depend on activation shapes or proxy names."""

    kind: str
    dtype: str
    shape: tuple[int, ...]
    # Collectives of the same kind, dtype and shape before this one in Thunder's order.
    occurrence: int

    def __str__(self) -> str:
        return f"{self.kind} {self.dtype}{list(self.shape)} #{self.occurrence}"


def collective_keys(annotated: AnnotatedTrace) -> list[CollectiveKey]:
    """One key per collective of ``annotated`` (read from the trace before scheduling)."""
    seen: Counter[tuple] = Counter()
    keys = []
    for collective in annotated.collectives:
        moved = annotated.nodes[collective.start].bsym.flat_proxy_outs[0]
        identity = (collective.kind.value, str(moved.dtype), tuple(int(s) for s in moved.shape))
        keys.append(CollectiveKey(*identity, seen[identity]))
        seen[identity] += 1
    return keys


def exchange_is_possible(group: dist.ProcessGroup | None) -> bool:
    """Whether ``group`` has other ranks to exchange with (the fake backend, which traces at any
    world size in one process, has none)."""
    return group is not None and group.size() > 1 and dist.get_backend(group) != "fake"


def agreed_subset(mine: list[str], group: dist.ProcessGroup | None) -> list[str]:
    """The choices of ``mine`` that every rank of ``group`` made too (one object all-gather;
    ``mine`` unchanged where there is nobody to agree with), in ``mine``'s order. For choices
    that change which collectives a rank launches, where any subset is safe to take."""
    if not exchange_is_possible(group):
        return list(mine)
    gathered: list[list[str] | None] = [None] * group.size()
    dist.all_gather_object(gathered, list(mine), group=group)
    common = set.intersection(*(set(choices) for choices in gathered))
    return [choice for choice in mine if choice in common]


@dataclass(frozen=True)
class PrefixAgreement:
    """What :func:`agreed_prefix` found."""

    # The longest prefix every rank that could choose chose.
    common: tuple[str, ...]
    # The ranks that could not choose.
    failed: list[int]
    # Whether every rank chose the same (then ``common`` is each one's own choice).
    unanimous: bool


def agreed_prefix(mine: Sequence[str] | None, group: dist.ProcessGroup | None) -> PrefixAgreement:
    """The longest prefix of ``mine`` that every rank of ``group`` chose too, and the ranks that
    could not choose (their ``mine`` is None), in one object all-gather (``mine`` unchanged where
    there is nobody to agree with). Every rank takes part even when it could not choose, so that
    its peers stop with it instead of waiting for it."""
    if not exchange_is_possible(group):
        return PrefixAgreement(tuple(mine or ()), [], True)
    gathered: list[list[str] | None] = [None] * group.size()
    dist.all_gather_object(gathered, None if mine is None else list(mine), group=group)
    failed = [rank for rank, theirs in enumerate(gathered) if theirs is None]
    chosen = [theirs for theirs in gathered if theirs is not None]
    common = 0
    while chosen and all(len(theirs) > common and theirs[common] == chosen[0][common] for theirs in chosen):
        common += 1
    unanimous = not failed and all(theirs == chosen[0] for theirs in chosen)
    return PrefixAgreement(tuple(chosen[0][:common]) if chosen else (), failed, unanimous)


def ranks_where(condition: bool, group: dist.ProcessGroup | None) -> list[int]:
    """The ranks of ``group`` whose ``condition`` holds, the same list on every rank (one object
    all-gather; this rank's alone where there is nobody to ask)."""
    if not exchange_is_possible(group):
        return [0] if condition else []
    gathered: list[bool | None] = [None] * group.size()
    dist.all_gather_object(gathered, bool(condition), group=group)
    return [rank for rank, holds in enumerate(gathered) if holds]


def summed_over_ranks(values: Sequence[float], group: dist.ProcessGroup | None) -> list[float]:
    """Each of ``values`` summed over the ranks of ``group``, the same on every rank (one object
    all-gather); this rank's own where there is nobody to ask."""
    if not exchange_is_possible(group):
        return list(values)
    gathered: list[list[float] | None] = [None] * group.size()
    dist.all_gather_object(gathered, list(values), group=group)
    return [sum(each) for each in zip(*gathered, strict=True)]


@dataclass(frozen=True)
class Difference:
    """The first key whose value some rank does not share with the first rank."""

    key: str
    # The ranks whose value differs from the first rank's.
    ranks: list[int]
    # Every rank's value of ``key`` (None where a rank has no such key).
    values: list[object]


def first_differing_value(values: Mapping[str, object], group: dist.ProcessGroup | None) -> Difference | None:
    """The first key (in the first rank's order, then the others') whose value some rank of
    ``group`` does not share with the first rank; None where every rank holds the same (one object
    all-gather; nothing where there is nobody to compare with). The same answer on every rank."""
    if not exchange_is_possible(group):
        return None
    gathered: list[dict | None] = [None] * group.size()
    dist.all_gather_object(gathered, dict(values), group=group)
    reference = gathered[0]
    for key in [*reference, *(k for theirs in gathered for k in theirs if k not in reference)]:
        ranks = [rank for rank, theirs in enumerate(gathered) if theirs.get(key) != reference.get(key)]
        if ranks:
            return Difference(key, ranks, [theirs.get(key) for theirs in gathered])
    return None


def agree_settings(settings: Mapping[str, object], plan_digest: str | None, group: dist.ProcessGroup | None) -> None:
    """Raises on every rank of ``group`` when some rank's settings or bucket plan differ from the
    first rank's, naming the fields and each rank's value (one object all-gather; nothing where
    there is nobody to agree with)."""
    if not exchange_is_possible(group):
        return
    mine = {name: repr(value) for name, value in settings.items()}
    gathered: list[tuple | None] = [None] * group.size()
    dist.all_gather_object(gathered, (mine, plan_digest), group=group)
    reference = gathered[0][0]
    for rank, (theirs, _) in enumerate(gathered):
        differing = sorted(name for name in reference.keys() | theirs.keys() if reference.get(name) != theirs.get(name))
        if differing:
            shown = "; ".join(f"{name}: rank 0 {reference.get(name)}, rank {rank} {theirs.get(name)}" for name in differing)
            raise RuntimeError(
                f"thunder_overlap: rank {rank} of the process group was given other settings than rank 0 ({shown}); "
                "their collectives would not pair up. Give every rank the same fsdp options and OverlapConfig."
            )
    _check_same_bucket_plan([digest for _, digest in gathered])


def _first_difference(theirs: list[CollectiveKey], reference: list[CollectiveKey], rank: int) -> str:
    """The first collective, in issue order, that one of the two ranks moves and the other does not."""
    only_reference, only_theirs = Counter(reference) - Counter(theirs), Counter(theirs) - Counter(reference)
    for position, key in enumerate(reference):
        if key in only_reference:
            return f"rank 0 issues {key} at position {position}, which rank {rank} does not"
    for position, key in enumerate(theirs):
        if key in only_theirs:
            return f"rank {rank} issues {key} at position {position}, which rank 0 does not"
    raise AssertionError("the two orders move the same collectives")


class IssueOrderAgreement:
    """The agreed issue order of each pass, and the one exchange that agrees on it.

    ``exchange=False`` (``Tuning.check_ranks_agree=False``) skips the exchange: each rank
    keeps its own first order, which is only safe when every rank's first step has equal shapes
    and estimates.
    """

    def __init__(self, *, exchange: bool = True) -> None:
        self.exchange = exchange
        # (pass name, sorted keys) -> the keys in the agreed issue order.
        self._agreed: dict[tuple[str, tuple[CollectiveKey, ...]], list[CollectiveKey]] = {}
        # (pass name, sorted keys) -> the agreed coalesced launches, each a list of keys in issue order.
        self._launches: dict[tuple[str, tuple[CollectiveKey, ...]], list[list[CollectiveKey]]] = {}
        # Pass name -> whether this rank gave up its own first order for the first rank's.
        self.adopted: dict[Pass, bool] = {}

    @staticmethod
    def _entry(pass_: Pass, keys: list[CollectiveKey]) -> tuple[Pass, tuple[CollectiveKey, ...]]:
        return pass_, tuple(sorted(keys, key=str))

    def agreed_order(self, pass_: Pass, keys: list[CollectiveKey]) -> list[int] | None:
        """Collective indices (into ``keys``) in the order agreed for this pass, or None when
        this pass has not compiled before."""
        agreed = self._agreed.get(self._entry(pass_, keys))
        if agreed is None:
            return None
        index_of = {key: i for i, key in enumerate(keys)}
        return [index_of[key] for key in agreed]

    def agreed_launches(self, pass_: Pass, keys: list[CollectiveKey]) -> list[list[int]] | None:
        """The coalesced launches agreed for this pass (each a list of indices into ``keys``, in
        issue order), or None when this pass has not compiled before."""
        agreed = self._launches.get(self._entry(pass_, keys))
        if agreed is None:
            return None
        index_of = {key: i for i, key in enumerate(keys)}
        return [[index_of[key] for key in launch] for launch in agreed]

    def agree(
        self,
        pass_: Pass,
        keys: list[CollectiveKey],
        issue_order: list[int],
        group: dist.ProcessGroup | None,
        launches: list[list[int]] = (),
    ) -> list[int]:
        """Agrees on this pass's issue order and coalesced ``launches`` at its first compile, where
        every rank is present; returns the agreed order as indices into ``keys`` (this rank's own
        when it is the first rank's, or when there is nobody to agree with). The agreed launches
        are :meth:`agreed_launches`."""
        mine = [keys[c] for c in issue_order]
        my_launches = [[keys[c] for c in launch] for launch in launches]
        agreed, agreed_launches = mine, my_launches
        if self.exchange and exchange_is_possible(group):
            agreed, agreed_launches = self._exchange(mine, my_launches, group)
        self._agreed[self._entry(pass_, keys)] = agreed
        self._launches[self._entry(pass_, keys)] = agreed_launches
        self.adopted[pass_] = agreed != mine
        logger.debug("%s: %d collectives, issue order %s", pass_, len(agreed), "adopted from rank 0" if agreed != mine else "own")
        index_of = {key: i for i, key in enumerate(keys)}
        return [index_of[key] for key in agreed]

    @staticmethod
    def _exchange(
        mine: list[CollectiveKey], my_launches: list[list[CollectiveKey]], group: dist.ProcessGroup
    ) -> tuple[list[CollectiveKey], list[list[CollectiveKey]]]:
        gathered: list[tuple | None] = [None] * group.size()
        dist.all_gather_object(gathered, (mine, my_launches), group=group)
        orders = [order for order, _ in gathered]
        reference = orders[0]
        differing = [rank for rank, order in enumerate(orders) if sorted(order, key=str) != sorted(reference, key=str)]
        if differing:
            # Every rank sees every order, so every rank raises: none is left waiting.
            first = differing[0]
            raise RuntimeError(
                f"thunder_overlap: ranks {differing} of the process group would issue other collectives than rank 0, "
                f"which would hang at the first differing one: {_first_difference(orders[first], reference, first)}. "
                "Give every rank the same model, sharding and bucketing."
            )
        return reference, gathered[0][1]


def _check_same_bucket_plan(digests: list[str | None]) -> None:
    """Raises (on every rank: each sees every digest) when ranks planned other buckets than rank 0."""
    differing = [rank for rank, digest in enumerate(digests) if digest != digests[0]]
    if differing:
        shown = ", ".join(f"rank {rank}: {digests[rank]}" for rank in [0, *differing])
        raise RuntimeError(
            f"thunder_overlap: ranks {differing} of the process group planned other buckets than rank 0 (plan digests {shown}), "
            "so their collectives would not pair up. Give every rank the same model, bucketing_strategy, bucket_cap_mb, "
            "block_types and OverlapConfig; BucketingTransform.of(model).summaries.plan lists each rank's buckets."
        )
