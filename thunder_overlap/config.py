"""The scheduler's options: :class:`OverlapConfig` for what a user sets, :class:`Tuning` for the
internal constants behind it (defaults chosen from measurements, see ``docs/design.md``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from enum import Enum

from thunder_overlap._analysis.cost_model import CostModel

__all__ = ["SCHEDULING_POLICIES", "OverlapConfig", "Policy", "Tuning"]


class Policy(str, Enum):
    """How the scheduler orders collectives. A member equals its name as a string (what
    ``OverlapConfig(policy=...)`` takes), and says what the policy needs of the scheduler."""

    # Prefetch as early as the limits and the memory budget allow (the default).
    MEMORY_AWARE = "memory_aware"
    # Prefetch within the in-flight limits only, no memory budget.
    HEURISTIC = "heuristic"
    # No limit at all, to show what unbounded overlap costs in memory.
    GREEDY = "greedy"
    # No overlap and the least memory (the memory budget's baseline).
    JUST_IN_TIME = "just_in_time"
    # Thunder's own order, for comparisons.
    STOCK = "stock"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def keeps_thunder_order(self) -> bool:
        """Whether the trace keeps the order Thunder gave it (nothing is scheduled)."""
        return self is Policy.STOCK

    @property
    def limits_in_flight(self) -> bool:
        """Whether collectives in flight are limited at all (greedy and stock leave them unbounded)."""
        return self in (Policy.MEMORY_AWARE, Policy.HEURISTIC, Policy.JUST_IN_TIME)

    @property
    def prefetches(self) -> bool:
        """Whether all-gathers may go out before the compute just before their first use."""
        return self is not Policy.JUST_IN_TIME

    @property
    def limits_by_block(self) -> bool:
        """Whether the in-flight limits are counted in the model's largest block (or bucket)."""
        return self.limits_in_flight and self.prefetches

    @property
    def reads_memory(self) -> bool:
        """Whether the schedule predicts memory and keeps to a budget (so it can take
        ``OverlapConfig.memory_budget_bytes``)."""
        return self in (Policy.MEMORY_AWARE, Policy.JUST_IN_TIME)

    @property
    def coalesces(self) -> bool:
        """Whether collectives issued together may be launched as one (the stock and
        just-in-time baselines never are)."""
        return self not in (Policy.STOCK, Policy.JUST_IN_TIME)

    @classmethod
    def parse(cls, value: object) -> Policy:
        """The policy ``value`` names (a member or its name), or ValueError naming the accepted ones."""
        if isinstance(value, str):
            try:
                return cls(value)
            except ValueError:
                pass
        raise ValueError(f"OverlapConfig.policy must be one of {SCHEDULING_POLICIES}, got {value!r}")


# The policies' names, as OverlapConfig(policy=...) takes them.
SCHEDULING_POLICIES = tuple(policy.value for policy in Policy)

_GIB = 1 << 30


def _check(owner: str, name: str, value: object, kind: type, *, optional: bool, zero: bool, below_one: bool = False) -> None:
    """Refuses a value of another type, NaN, infinity or a value out of range, naming the field
    and what is accepted."""
    if value is None and optional:
        return
    if kind is bool:
        if not isinstance(value, bool):
            raise TypeError(f"{owner}.{name} must be a bool, got {value!r}")
        return
    numbers = (int,) if kind is int else (int, float)
    what = ("an integer" if kind is int else "a number") + (" between 0 and 1" if below_one else " >= 0" if zero else " > 0")
    accepted = what + (", or None (no limit)" if optional else "")
    if isinstance(value, bool) or not isinstance(value, numbers):
        raise TypeError(f"{owner}.{name} must be {accepted}, got {value!r}")
    in_range = value >= 0 if zero else value > 0
    if not math.isfinite(value) or not in_range or (below_one and not value < 1):
        raise ValueError(f"{owner}.{name} must be {accepted}, got {value!r}")


# Tuning's fields by what they accept: (type, None allowed, zero allowed).
_TUNING_RULES: dict[tuple[type, bool, bool], tuple[str, ...]] = {
    (int, True, False): ("max_in_flight_allgathers", "max_in_flight_reduce_scatter_bytes"),
    (int, True, True): ("max_prefetch_compute_ops",),
    (int, False, False): ("fallback_in_flight_allgathers",),
    (int, False, True): ("chained_wait_compute_ops",),
    (float, True, False): ("bucket_eager_prefetch_blocks", "bucket_reduce_scatter_blocks", "prefetch_time_margin"),
    (float, True, True): ("per_tensor_gather_max_slowdown", "reduce_from_copy_max_slowdown"),
    (bool, False, False): ("check_ranks_agree", "coalesce", "zero3_keeps_free_units", "auto_weighs_block_buckets"),
}


@dataclass(frozen=True)
class Tuning:
    """Internal constants of the scheduler and the bucket paths. Their defaults are the
    measured choices of ``docs/design.md``; benchmarks and tests set them through
    ``OverlapConfig(_tuning=Tuning(...))``. ``None`` means no limit, or never."""

    max_in_flight_allgathers: int | None = None
    # Buckets: units (largest blocks) in flight up to which a bucket's all-gather goes out as
    # early as allowed; beyond, only when it must to be hidden. [Note: eager bucket prefetch]
    bucket_eager_prefetch_blocks: float | None = 1.0
    # Bucket paths over gloo (most slowdown accepted for a pool buffer less). [Note: bucket paths]
    per_tensor_gather_max_slowdown: float | None = 0.01
    reduce_from_copy_max_slowdown: float | None = 0.02
    # Reduce-scatter bytes, in largest blocks, that hold a pool buffer to their wait where the
    # backward also gathers. [Note: pool reduce-scatter cap]
    bucket_reduce_scatter_blocks: float | None = 1.0
    max_in_flight_reduce_scatter_bytes: int | None = None  # None: prefetch_blocks x the largest block
    fallback_in_flight_allgathers: int = 4  # a model without repeated blocks
    chained_wait_compute_ops: int = 2  # [Note: chained waits]
    max_prefetch_compute_ops: int | None = 16  # about two transformer blocks of forward
    prefetch_time_margin: float | None = 1.5  # compute before first use >= margin x the collective
    check_ranks_agree: bool = True  # one exchange at the first compile [Note: rank agreement]
    coalesce: bool = True  # [Note: coalesced launches]
    # ZeRO3 keeps what its backward needs first, up to its first block, gathered where that is
    # free; False re-gathers every parameter. [Note: ZeRO3 keeps what is free]
    zero3_keeps_free_units: bool = True
    auto_bucket_latency_share: float = 0.1  # auto buckets: latency <= this share of their time
    # auto buckets: the first compile runs block buckets instead where it predicts them faster;
    # False keeps auto's plan. [Note: auto against block]
    auto_weighs_block_buckets: bool = True

    def __post_init__(self) -> None:
        for (kind, optional, zero), names in _TUNING_RULES.items():
            for name in names:
                _check("Tuning", name, getattr(self, name), kind, optional=optional, zero=zero)
        _check("Tuning", "auto_bucket_latency_share", self.auto_bucket_latency_share, float, optional=False, zero=False, below_one=True)


@dataclass(frozen=True)
class OverlapConfig:
    """Options of the overlap scheduler. ``None`` means no limit of that kind."""

    # One of SCHEDULING_POLICIES (a Policy, or its name).
    policy: Policy = Policy.MEMORY_AWARE
    # All-gather bytes in flight, in units of the model's largest block (or bucket, where
    # buckets hold several blocks): the next two arrive while the current one computes
    # ([Note: prefetch depth]).
    prefetch_blocks: float = 2.0
    # A byte cap on all-gathers in flight instead of prefetch_blocks (what one op reads at once is
    # gathered for it even beyond the cap).
    max_in_flight_allgather_bytes: int | None = None
    # Memory budget: predicted peak <= the just-in-time step's peak + max(slack_bytes,
    # slack_ratio x that peak) (Inductor's defaults; [Note: the step's budget]).
    memory_slack_bytes: int = _GIB
    memory_slack_ratio: float = 0.05
    # An absolute budget on the predicted peak of a step's traces per rank (shards, activations,
    # gathered parameters, gradients, the bucket pool; not optimizer state): prefetching stays
    # under it, and sharding_strategy="auto" keeps as many blocks unsharded as it allows.
    memory_budget_bytes: int | None = None
    # Buckets reduce-scatter in place in pool buffers idle to the step's end; set False when
    # .grad is kept across steps (accumulation without no_sync), which would grow the pool.
    reduce_in_pool: bool = True
    # Times of ops and collectives; None: CostModel.for_device(the shards' device, world size).
    cost_model: CostModel | None = field(default=None, compare=False)
    # Internal constants, for benchmarks and tests (see Tuning).
    _tuning: Tuning = field(default_factory=Tuning, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", Policy.parse(self.policy))
        _check("OverlapConfig", "prefetch_blocks", self.prefetch_blocks, float, optional=False, zero=False)
        _check("OverlapConfig", "max_in_flight_allgather_bytes", self.max_in_flight_allgather_bytes, int, optional=True, zero=False)
        _check("OverlapConfig", "memory_slack_bytes", self.memory_slack_bytes, int, optional=False, zero=True)
        _check("OverlapConfig", "memory_slack_ratio", self.memory_slack_ratio, float, optional=False, zero=True)
        _check("OverlapConfig", "memory_budget_bytes", self.memory_budget_bytes, int, optional=True, zero=False)
        _check("OverlapConfig", "reduce_in_pool", self.reduce_in_pool, bool, optional=False, zero=False)
        if self.memory_budget_bytes is not None and not self.policy.reads_memory:
            reading = " or ".join(repr(p.value) for p in Policy if p.reads_memory)
            raise ValueError(
                f"OverlapConfig.memory_budget_bytes={self.memory_budget_bytes} needs a policy that reads memory "
                f"({reading}); policy={self.policy.value!r} would not keep to it"
            )
        if self.cost_model is not None and not isinstance(self.cost_model, CostModel):
            raise TypeError(f"OverlapConfig.cost_model must be a thunder_overlap.CostModel or None, got {self.cost_model!r}")
        if not isinstance(self._tuning, Tuning):
            raise TypeError(f"OverlapConfig._tuning must be a thunder_overlap.config.Tuning, got {self._tuning!r}")

    @property
    def tuning(self) -> Tuning:
        return self._tuning

    @property
    def coalesces(self) -> bool:
        """Whether schedules under this configuration may coalesce launches (the stock and
        just-in-time baselines never do)."""
        return self._tuning.coalesce and self.policy.coalesces

    def agreed_fields(self) -> dict[str, object]:
        """Every option that shapes the collectives ranks issue, by name (tuning included), for
        the ranks' agreement at the first compile. Not the cost model: its estimates may differ
        between ranks (measured timings), and they move collectives around compute only, never
        the agreed issue order."""
        agreed = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("cost_model", "_tuning")}
        agreed["policy"] = self.policy.value
        agreed.update({f"tuning.{f.name}": getattr(self._tuning, f.name) for f in fields(self._tuning)})
        return agreed
