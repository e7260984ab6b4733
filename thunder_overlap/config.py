"""The one typed home for every scheduling knob of thunder_overlap."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from thunder_overlap._analysis.cost_model import CostModel

__all__ = ["JUST_IN_TIME_LIMITS", "OverlapConfig", "ScheduleLimits", "SCHEDULING_POLICIES"]

# "memory_aware" (default): issue every collective as early as its inputs allow within three
# limits: a prefetch distance in compute ops (stretched by the cost model for collectives that
# need more compute to hide), bytes in flight, and a memory budget relative to the
# just-in-time order's predicted peak; over budget, the oldest reduce-scatter waits are forced.
# "heuristic": the Foundation policy: prefetch all-gathers in order of first use within the
# in-flight byte/count limits only, reduce-scatters as soon as their gradient is complete.
# "greedy": raise every collective, sink every wait, no limit at all: shows what overlap costs
# in memory when nothing bounds it. For comparisons, not for training.
# "just_in_time": issue each all-gather right before its first use and wait on each
# reduce-scatter right after issuing it: no overlap, the least memory; the budget's baseline.
# "stock": leave Thunder's order alone, for comparisons. With ZeRO3 the backward's re-gathers then
# all stay at its start, where the rewrite puts them, as Thunder <= 0.2.3 had them before it
# limited all-gathers in flight: a baseline for overlap, not a memory-sensible configuration.
SCHEDULING_POLICIES = ("memory_aware", "heuristic", "greedy", "just_in_time", "stock")

_GIB = 1 << 30


def _check_number(name: str, value: object, kind: type | tuple[type, ...], *, allow_zero: bool = False, optional: bool = True) -> None:
    if value is None and optional:
        return
    kinds = kind if isinstance(kind, tuple) else (kind,)
    accepted = " or ".join(("an " if k is int else "a ") + k.__name__ for k in kinds) + (" or None" if optional else "")
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise TypeError(f"OverlapConfig.{name} must be {accepted}, got {value!r}")
    if not value >= 0 or (value == 0 and not allow_zero):  # NaN too
        bound = "non-negative" if allow_zero else "positive"
        raise ValueError(f"OverlapConfig.{name} must be {bound}{' or None (no limit)' if optional else ''}, got {value!r}")


def _check_slowdown(name: str, slowdown: object, never: str) -> None:
    accepted = f"a share of step time >= 0, or None (never {never})"
    if slowdown is not None and (isinstance(slowdown, bool) or not isinstance(slowdown, (int, float))):
        raise TypeError(f"OverlapConfig.{name} must be {accepted}, got {slowdown!r}")
    if slowdown is not None and not slowdown >= 0:  # NaN too
        raise ValueError(f"OverlapConfig.{name} must be {accepted}, got {slowdown!r}")


@dataclass(frozen=True)
class OverlapConfig:
    """Options of the overlap scheduler.

    The all-gather limits bound what is *in flight*: issued but not yet used. A limit of
    ``None`` means no limit of that kind. With every all-gather limit ``None`` the byte limit is
    derived from the model as ``prefetch_blocks`` times the unsharded bytes of its largest
    transformer block (see :func:`thunder_overlap.blocks.find_blocks`), or of its largest bucket
    where that is larger.
    """

    # Scheduling policy, one of SCHEDULING_POLICIES.
    policy: str = "memory_aware"
    # Most all-gathers in flight at once (count).
    max_in_flight_allgathers: int | None = None
    # Most all-gather output bytes in flight at once.
    max_in_flight_allgather_bytes: int | None = None
    # Default byte limit in units of the largest block (or of the largest bucket, where auto
    # buckets hold several blocks): 2 keeps the next two units arriving while the current one
    # computes (FSDP2 keeps about one block, Thunder <= 0.2.3 kept 3 ops). Two, not one, so that
    # a launch is queued while the one before it still moves: backends that run collectives
    # concurrently (gloo's worker threads) then hide one's latency behind the other's transfer.
    prefetch_blocks: float = 2.0
    # Buckets: units in flight up to which a bucket's all-gather goes out as early as the prefetch
    # distance allows; beyond it (up to prefetch_blocks) only at the latest moment the compute
    # before its first use still hides it and the collectives queued ahead of it on the link
    # (prefetch_time_margin, by the cost model), so never without time estimates: where the
    # link is the bottleneck, a second bucket in flight keeps it busy. A gathered bucket is a pool buffer, and the pool keeps as many as
    # were ever busy at once for the whole step: each bucket more ahead costs its bytes at the
    # step's peak, wherever that is, where per-parameter all-gathers hold memory only in flight.
    # One: the next bucket, as FSDP2 prefetches the next module. (Reduce-scatters keep
    # prefetch_blocks: on NCCL a bucket's reduce-scatter holds its gradients, as per-parameter
    # ones do, and no pool buffer; capping them at one bucket made the demo's predicted step at
    # 64 GPUs 3% slower, 7.67 -> 7.90 ms, for at most half a block of ZeRO3 peak.) None: buckets
    # are prefetched like per-parameter all-gathers.
    bucket_eager_prefetch_blocks: float | None = 1.0
    # Buckets: a reduce-scatter issued when a pool buffer would sit idle from then to the end of
    # the step (ZeRO2's gathered buffer of the block whose backward just ended; ZeRO3's last
    # blocks) runs in place in that buffer, whose row becomes the gradient shard: no gradient
    # shard allocated beside the pool, and the gradients free once laid out (one copy) instead
    # of held to the wait. Chosen from the final backward schedule so that the pool never grows
    # for it, and agreed between ranks at the first compile. The buffer stays busy while .grad
    # aliases it: gradients kept into the next step (accumulation without no_sync,
    # zero_grad(set_to_none=False)) make the pool grow once; set False for such loops.
    reduce_in_pool: bool = True
    # Buckets, where the backend runs a coalesced launch one collective at a time (gloo): a
    # bucket whose copy-out would make the pool hold more buffers than the smallest pool the
    # schedule allows gathers each parameter into its place instead, as on NCCL: no copy-out and
    # no second buffer, one launch latency per parameter. Chosen at the backward's first compile
    # where the memory estimate's step peak falls and the simulator predicts the step at most
    # this share slower (bucketing/per_tensor_gathers.py). 0.01: a point of step time for a
    # block of memory. None: never.
    per_tensor_gather_max_slowdown: float | None = 0.01
    # Buckets, where the backend copies a reduce-scatter's input at the launch (gloo): a bucket
    # whose laid-out gradients, all-reduced in place in their pool buffer until the wait, would
    # make the pool hold more buffers than the smallest pool the schedule allows hands them to
    # that copy instead: the buffer is free at the launch, the copy (outside the pool) is held
    # while the collective is in flight, and the bucket is copied once more. Chosen at the
    # backward's first compile where the step peak falls and the simulator predicts the step at
    # most this share slower (bucketing/reduce_from_copy.py). 0.02, not 0.01 as above: the cost
    # is a copy in local memory, which the CPU profile prices at 10 GB/s where copies of a block
    # run at about 50 GB/s on the 2-core test machine (the demo's ZeRO3 blocks: predicted 1.0%
    # slower for a block buffer less). None: never.
    reduce_from_copy_max_slowdown: float | None = 0.02
    # Buckets: reduce-scatter bytes in flight, in units of the largest block (or bucket), that
    # keep a pool buffer busy until their wait: gradients laid out into it and all-reduced in
    # place there (gloo, or a bucket that pads), not those sent where they are (NCCL) or handed
    # to the backend's copy. The pool keeps as many buffers as were ever busy at once for the
    # whole step, and in ZeRO3's backward two such reduce-scatters beside the two gathers in
    # flight made it one block buffer larger (bucket_memory.py's parameters shape over gloo:
    # peak +1.08 block buffers over unbucketed, +0.26 at one). One: the previous block's
    # reduce-scatter is waited on as the next one goes out, one block of backward after its
    # issue. Applied once the buckets reduce-scattered from the backend's copy are chosen
    # (reduce_from_copy_max_slowdown), which then hold no pool buffer to the wait. None: only
    # max_in_flight_reduce_scatter_bytes counts them.
    bucket_reduce_scatter_blocks: float | None = 1.0
    # Most reduce-scatter input bytes in flight; None: prefetch_blocks x the largest block (or bucket).
    # Waiting on a reduce-scatter frees its unsharded gradient, so this bounds gradient memory.
    max_in_flight_reduce_scatter_bytes: int | None = None
    # All-gathers in flight when no limit is set and the model has no repeated blocks to size
    # one from: a few parameters ahead, rather than the whole model gathered at once.
    fallback_in_flight_allgathers: int = 4
    # A reduce-scatter whose result another collective reads (hybrid sharding's all-reduce
    # across replicas) is waited on once this many expensive compute ops (matmuls) have run
    # since its issue, so that the all-reduce goes out while backward still computes. Two:
    # long enough for the reduce-scatter to finish behind them (the wait then costs nothing),
    # short enough to leave compute for the all-reduce. 0: right after the issue.
    chained_wait_compute_ops: int = 2

    # --- memory_aware only ---------------------------------------------------------------
    # Prefetch distance: a collective is issued at most this many expensive compute ops
    # (matmuls, attention) before its first use. 16 is about two transformer blocks of forward
    # (Inductor's overlap scheduler uses 5 matmuls; Thunder's blocks are coarser units of overlap).
    max_prefetch_compute_ops: int | None = 16
    # ... unless the cost model says that is too little compute to hide it: the distance is then
    # stretched until the compute before the first use is this many times the collective's
    # estimated time. Above 1 to absorb estimation error; None: never stretch.
    prefetch_time_margin: float | None = 1.5
    # Memory budget: predicted peak <= the just-in-time order's peak + max(slack_bytes,
    # slack_ratio x that peak). Inductor's defaults: 1 GB and 5%.
    memory_slack_bytes: int = _GIB
    memory_slack_ratio: float = 0.05
    # How long ops and collectives take, for stretching the prefetch distance. Default:
    # CostModel.for_device(the shards' device, world size). Estimates may differ between ranks (a
    # measured model, other input shapes): they move collectives relative to compute, never the
    # issue order, which the ranks agree on once (check_ranks_agree).
    cost_model: CostModel | None = field(default=None, compare=False)
    # The first time a pass compiles (every rank is there: the first step), ranks exchange their
    # collective issue orders in one small all-gather, raise on every rank if they would move
    # different collectives, and all keep the first rank's order from then on, through every
    # retrace. False skips the exchange: each rank keeps its own first order, safe only when every
    # rank's first step has the same shapes and estimates. Skipped on the fake group and one rank.
    check_ranks_agree: bool = True
    # Collectives of one kind, process group and dtype that the schedule issues back to back go
    # out as one coalesced launch (one latency instead of one each) where the cost model says it
    # does not make the rank wait longer: waiting for the whole launch at its first member's wait
    # stalls compute no longer than the members' separate launches did (scheduling/launches.py).
    # Ranks agree on the launches with the issue order. The "stock" and "just_in_time" policies
    # never coalesce: they are baselines of Thunder's own launches.
    coalesce: bool = True

    # --- bucketing_strategy="auto" ---------------------------------------------------------
    # A bucket is large enough once one launch's latency is at most this share of its
    # all-gather's time (latency + transfer): at 10% it moves within 10% of the bandwidth bound,
    # and growing it further buys little while it holds more memory in flight and coarsens the
    # unit of overlap. Smaller shares give larger buckets (up to the caps).
    auto_bucket_latency_share: float = 0.1

    def __post_init__(self) -> None:
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"OverlapConfig.policy must be one of {SCHEDULING_POLICIES}, got {self.policy!r}")
        _check_number("max_in_flight_allgathers", self.max_in_flight_allgathers, int)
        _check_number("max_in_flight_allgather_bytes", self.max_in_flight_allgather_bytes, int)
        _check_number("max_in_flight_reduce_scatter_bytes", self.max_in_flight_reduce_scatter_bytes, int)
        _check_number("fallback_in_flight_allgathers", self.fallback_in_flight_allgathers, int, optional=False)
        _check_number("chained_wait_compute_ops", self.chained_wait_compute_ops, int, allow_zero=True, optional=False)
        if isinstance(self.prefetch_blocks, bool) or not isinstance(self.prefetch_blocks, (int, float)):
            raise TypeError(f"OverlapConfig.prefetch_blocks must be a number, got {self.prefetch_blocks!r}")
        if self.prefetch_blocks <= 0:
            raise ValueError(f"OverlapConfig.prefetch_blocks must be positive, got {self.prefetch_blocks!r}")
        _check_number("bucket_eager_prefetch_blocks", self.bucket_eager_prefetch_blocks, (int, float))
        _check_number("bucket_reduce_scatter_blocks", self.bucket_reduce_scatter_blocks, (int, float))
        _check_number("max_prefetch_compute_ops", self.max_prefetch_compute_ops, int, allow_zero=True)
        _check_number("prefetch_time_margin", self.prefetch_time_margin, (int, float))
        _check_number("memory_slack_bytes", self.memory_slack_bytes, int, allow_zero=True, optional=False)
        _check_number("memory_slack_ratio", self.memory_slack_ratio, (int, float), allow_zero=True, optional=False)
        if isinstance(self.auto_bucket_latency_share, bool) or not isinstance(self.auto_bucket_latency_share, (int, float)):
            raise TypeError(f"OverlapConfig.auto_bucket_latency_share must be a number, got {self.auto_bucket_latency_share!r}")
        if not 0 < self.auto_bucket_latency_share < 1:
            raise ValueError(
                f"OverlapConfig.auto_bucket_latency_share must be between 0 and 1 (a share of a bucket's time), "
                f"got {self.auto_bucket_latency_share!r}"
            )
        if not isinstance(self.check_ranks_agree, bool):
            raise TypeError(f"OverlapConfig.check_ranks_agree must be a bool, got {self.check_ranks_agree!r}")
        _check_slowdown("per_tensor_gather_max_slowdown", self.per_tensor_gather_max_slowdown, "gather buckets per parameter")
        _check_slowdown("reduce_from_copy_max_slowdown", self.reduce_from_copy_max_slowdown, "reduce-scatter from the backend's copy")
        if not isinstance(self.reduce_in_pool, bool):
            raise TypeError(f"OverlapConfig.reduce_in_pool must be a bool, got {self.reduce_in_pool!r}")
        if not isinstance(self.coalesce, bool):
            raise TypeError(f"OverlapConfig.coalesce must be a bool, got {self.coalesce!r}")
        if self.cost_model is not None and not isinstance(self.cost_model, CostModel):
            raise TypeError(f"OverlapConfig.cost_model must be a thunder_overlap.CostModel or None, got {self.cost_model!r}")

    @property
    def coalesces(self) -> bool:
        """Whether schedules under this configuration may coalesce launches."""
        return self.coalesce and self.policy not in ("stock", "just_in_time")

    def limits(self, largest_block_bytes: int | None, *, runs_buckets: bool = False) -> ScheduleLimits:
        """Resolves the limits the policy applies, given the model's largest block size (None
        when the model has no repeated blocks) and whether the schedule's collectives move buckets."""
        if self.policy in ("greedy", "stock"):
            return ScheduleLimits()
        if self.policy == "just_in_time":
            return JUST_IN_TIME_LIMITS
        block_limit = int(self.prefetch_blocks * largest_block_bytes) if largest_block_bytes else None
        eager_limit = None
        if runs_buckets and self.bucket_eager_prefetch_blocks is not None and block_limit is not None:
            eager_limit = min(block_limit, int(self.bucket_eager_prefetch_blocks * largest_block_bytes))
        allgather_bytes = self.max_in_flight_allgather_bytes
        allgathers = self.max_in_flight_allgathers
        early_allgather_bytes = None
        if allgather_bytes is None and allgathers is None:
            allgather_bytes, early_allgather_bytes = block_limit, eager_limit
            if block_limit is None:
                allgathers = self.fallback_in_flight_allgathers
        reduce_scatter_bytes = self.max_in_flight_reduce_scatter_bytes
        if reduce_scatter_bytes is None:
            reduce_scatter_bytes = block_limit
        pool_reduce_scatter_bytes = None
        if runs_buckets and self.bucket_reduce_scatter_blocks is not None and largest_block_bytes:
            pool_reduce_scatter_bytes = int(self.bucket_reduce_scatter_blocks * largest_block_bytes)
        limits = ScheduleLimits(
            max_allgathers=allgathers,
            max_allgather_bytes=allgather_bytes,
            early_allgather_bytes=early_allgather_bytes,
            max_reduce_scatter_bytes=reduce_scatter_bytes,
            max_pool_reduce_scatter_bytes=pool_reduce_scatter_bytes,
            chained_wait_compute_ops=self.chained_wait_compute_ops,
        )
        if self.policy == "heuristic":
            return limits
        return replace(
            limits,
            max_prefetch_compute_ops=self.max_prefetch_compute_ops,
            prefetch_time_margin=self.prefetch_time_margin,
            memory_budget=MemoryBudgetRule(self.memory_slack_bytes, float(self.memory_slack_ratio)),
        )


@dataclass(frozen=True)
class MemoryBudgetRule:
    """Predicted peak may exceed the just-in-time order's by max(slack_bytes, slack_ratio x peak)."""

    slack_bytes: int
    slack_ratio: float

    def budget(self, baseline_peak_bytes: int) -> int:
        return baseline_peak_bytes + max(self.slack_bytes, int(self.slack_ratio * baseline_peak_bytes))


@dataclass(frozen=True)
class ScheduleLimits:
    """Concrete limits the scheduler enforces (None: unlimited)."""

    max_allgathers: int | None = None
    max_allgather_bytes: int | None = None
    # All-gather bytes in flight up to which one more goes out as early as the distance allows;
    # beyond them (within max_allgather_bytes) only once issuing later would leave too little
    # compute to hide it and what is queued ahead of it (PrefetchDistance.hides_only_if_issued_now).
    # None: as early as allowed.
    early_allgather_bytes: int | None = None
    max_reduce_scatter_bytes: int | None = None
    # Of those, the bytes that keep a bucket pool buffer busy until the wait (Collective.pool_bytes_to_wait).
    max_pool_reduce_scatter_bytes: int | None = None
    # Most reduce-scatters in flight (0: wait right after issuing).
    max_reduce_scatters: int | None = None
    # Expensive compute ops between a collective's issue and its first use (0: just in time).
    max_prefetch_compute_ops: int | None = None
    # Stretch the distance until compute covers this many times the collective's time.
    prefetch_time_margin: float | None = None
    memory_budget: MemoryBudgetRule | None = None
    # Expensive compute ops after which a reduce-scatter that feeds another collective is
    # waited on (None: at its first use, as any other).
    chained_wait_compute_ops: int | None = None


# Each all-gather right before its first use, each reduce-scatter waited right after its issue.
JUST_IN_TIME_LIMITS = ScheduleLimits(max_prefetch_compute_ops=0, max_reduce_scatters=0)
