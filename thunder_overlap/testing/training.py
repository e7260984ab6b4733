"""A short, deterministic training run on one rank, shared by the demo, the tests and benchmarks.

``train_rank`` trains :class:`~thunder_overlap.report._builtin_models.TinyGPT` (or the Llama-shaped
model) with either thunder_overlap or
Thunder's own FSDP and reports losses, step times, measured peak memory, the shards and gradients
of every step and the schedule of the final traces. ``check_against_reference`` checks every step
against the same steps in one float64 process without any sharding (``parity.check_steps``).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import thunder
import torch
import torch.nn.functional as F
from thunder.core.proxies import FutureTensorProxy

from thunder_overlap._analysis.blocks import find_blocks
from thunder_overlap._analysis.classify import NodeKind, classify_trace
from thunder_overlap._analysis.layout import NO_BUCKETS
from thunder_overlap._analysis.memory_estimate import estimate_memory
from thunder_overlap._backends import NCCL
from thunder_overlap._transforms import BucketingTransform
from thunder_overlap._transforms.activation_checkpointing import checkpoint_blocks
from thunder_overlap._transforms.zero3 import Zero3Transform
from thunder_overlap.api import fsdp as overlap_fsdp
from thunder_overlap.config import OverlapConfig
from thunder_overlap.options import (
    BucketingStrategy,
    MixedPrecision,
    ShardingStrategy,
    parse_bucketing_strategy,
    parse_sharding_strategy,
)
from thunder_overlap.report._builtin_models import Llama, LlamaConfig, TinyGPT, TinyGPTConfig
from thunder_overlap.report._schedule_view import ScheduleStats, schedule_picture, schedule_stats
from thunder_overlap.testing.bucket_census import BucketCensus, bucket_census
from thunder_overlap.testing.live_memory import LiveMemoryTracker
from thunder_overlap.testing.op_census import OpCensus

__all__ = [
    "IMPLEMENTATIONS",
    "BucketCensus",
    "RankResult",
    "TrainSetup",
    "check_against_reference",
    "collective_groups",
    "collective_sequence",
    "global_batch",
    "shard_group_rank",
    "train_rank",
]

IMPLEMENTATIONS = ("thunder_overlap", "thunder")


@dataclass(frozen=True)
class TrainSetup:
    impl: str = "thunder_overlap"
    # Strings (any case) or enums; parsed into ShardingStrategy / BucketingStrategy.
    sharding: ShardingStrategy | str = ShardingStrategy.ZERO3
    bucketing: BucketingStrategy | str = BucketingStrategy.NONE
    model: TinyGPTConfig | LlamaConfig = field(default_factory=TinyGPTConfig)
    micro_batch: int = 2
    seq_len: int = 32
    steps: int = 3
    lr: float = 0.05
    seed: int = 0
    config: OverlapConfig | None = None
    # One extra forward+backward after training, under LiveMemoryTracker (not timed).
    measure_memory: bool = True
    # Above 1: hybrid sharding over a (replicas, world_size // replicas) device mesh.
    replicas: int = 1
    optimizer: str = "sgd"  # or "adamw"
    adamw_eps: float = 1e-8
    # Buckets run as they do on NCCL whatever the backend (BucketLayout.as_on): parameters
    # gathered in place and unpadded gradients reduce-scattered where they are, each a coalesced
    # launch (over gloo this runs those paths for real, one collective after another).
    buckets_as_on_nccl: bool = False
    # Each step clips the gradient before the optimizer: model.clip_grad_norm_(max_norm, norm_type).
    max_norm: float | None = None
    norm_type: float = 2.0
    mixed_precision: MixedPrecision | None = None
    # fsdp(activation_checkpointing=True); the reference checkpoints the same blocks.
    activation_checkpointing: bool = False

    def __post_init__(self) -> None:
        if self.impl not in IMPLEMENTATIONS:
            raise ValueError(f"impl must be one of {IMPLEMENTATIONS}, got {self.impl!r}")
        object.__setattr__(self, "sharding", parse_sharding_strategy(self.sharding))
        object.__setattr__(self, "bucketing", parse_bucketing_strategy(self.bucketing))
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {tuple(OPTIMIZERS)}, got {self.optimizer!r}")
        overlap_only = self.max_norm is not None or self.mixed_precision is not None or self.activation_checkpointing
        if self.impl != "thunder_overlap" and overlap_only:
            raise ValueError(f"max_norm, mixed_precision and activation_checkpointing need impl='thunder_overlap', got {self.impl!r}")
        if self.seq_len > self.model.block_size:
            raise ValueError(f"seq_len={self.seq_len} exceeds the model's block_size={self.model.block_size}")


@dataclass
class RankResult:
    rank: int
    losses: list[float]
    step_ms: list[float]
    # Peak live bytes of one more forward and backward (LiveMemoryTracker: what the step
    # allocates or writes, the bucket pool and the backend's copies), and the memory estimator's
    # prediction of it from the final traces (persistent inputs left out, as the tracker does).
    peak_step_bytes: int | None
    predicted_peak_step_bytes: int | None
    # The inputs the step holds all along, which the tracker leaves out (parameter shards, the
    # batch): with them, the step's peak in the units of OverlapConfig.memory_budget_bytes.
    held_inputs_bytes: int | None
    forward_picture: str
    backward_picture: str
    forward_stats: ScheduleStats
    backward_stats: ScheduleStats
    # "all_gather f32[64, 64]"-like entries, forward then backward, in trace order.
    collectives: list[str]
    # Local shards after training (name -> tensor, padded as Thunder pads).
    shards: dict[str, torch.Tensor]
    # Saved-for-backward tensors that are gathered parameters or views of them (ZeRO3: those of
    # the parameters it keeps), and the parameters ZeRO3 keeps ([Note: ZeRO3 keeps what is free]).
    saved_unsharded: list[str]
    kept_parameters: list[str] = field(default_factory=list)
    bucket_census: BucketCensus | None = None
    # Per collective of the final forward and backward: (kind, the global ranks of its
    # process group, numel of its future).
    forward_groups: list[tuple[str, tuple[int, ...], int]] = field(default_factory=list)
    backward_groups: list[tuple[str, tuple[int, ...], int]] = field(default_factory=list)
    # Local shards before each step and after the last, and gradient shards of each step: what
    # parity.check_steps compares with a float64 reference step by step.
    step_shards: list[dict[str, torch.Tensor]] = field(default_factory=list)
    step_grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    # With TrainSetup.max_norm: each step's total norm (clip_grad_norm_'s result) and its gradient
    # shards before clipping (step_grads are after: what the optimizer used).
    grad_norms: list[float] = field(default_factory=list)
    step_unclipped_grads: list[dict[str, torch.Tensor]] = field(default_factory=list)


OPTIMIZERS = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}


def _optimizer(setup: TrainSetup, parameters) -> torch.optim.Optimizer:
    trainable = [p for p in parameters if p.requires_grad]
    if setup.optimizer == "adamw":
        return torch.optim.AdamW(trainable, lr=setup.lr, eps=setup.adamw_eps)
    return OPTIMIZERS[setup.optimizer](trainable, lr=setup.lr)


def shard_group_rank(rank: int, world_size: int, setup: TrainSetup) -> tuple[int, int]:
    """(rank within its shard group, the shard group's size): a device mesh (replicas, shards)
    puts consecutive ranks in one shard group."""
    shards = world_size // setup.replicas
    return rank % shards, shards


def global_batch(setup: TrainSetup, world_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(setup.seed * 1000 + step)
    shape = (setup.micro_batch * world_size, setup.seq_len + 1)
    tokens = torch.randint(0, setup.model.vocab_size, shape, generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _build_model(setup: TrainSetup) -> TinyGPT | Llama:
    torch.manual_seed(setup.seed)
    return Llama(setup.model) if isinstance(setup.model, LlamaConfig) else TinyGPT(setup.model)


def saved_unsharded(forward) -> list[str]:
    annotated = classify_trace(forward, roles_only=True)
    saved, _ = forward.bound_symbols[-1].args[1]
    gathered = (NodeKind.WAIT, NodeKind.EPILOGUE)
    return [
        t.name
        for t in saved
        if t.name in annotated.producer and annotated.nodes[annotated.producer[t.name]].kind in gathered
    ]


def collective_sequence(trace) -> list[str]:
    """Each collective and wait as ``name(input) dtype[shape]``, in trace order. Input names come
    from parameter names, so two ranks that order equally shaped blocks differently differ here."""
    annotated = classify_trace(trace, roles_only=True)
    sequence = []
    for node in annotated.nodes:
        if node.kind in (NodeKind.COLLECTIVE, NodeKind.WAIT):
            out = node.bsym.flat_proxy_outs[0]
            sequence.append(f"{node.name}({node.inputs[0]}) {out.dtype} {list(out.shape)}")
    return sequence


def collective_groups(trace) -> list[tuple[str, tuple[int, ...], int]]:
    """Each collective of ``trace``: kind, its group's global ranks and the numel of its future
    (an all-gather's gathered output, a reduce-scatter's reduced shard)."""
    annotated = classify_trace(trace, roles_only=True)
    groups = []
    for c in annotated.collectives:
        future = next(o for o in annotated.nodes[c.start].bsym.flat_proxy_outs if isinstance(o, FutureTensorProxy))
        ranks = tuple(torch.distributed.get_process_group_ranks(c.process_group)) if c.process_group is not None else ()
        groups.append((c.kind.value, ranks, int(future.numel)))
    return groups


def _sharded(setup: TrainSetup, model: TinyGPT | Llama, world_size: int):
    """``model`` sharded by thunder_overlap or by Thunder's own FSDP, on the CPU."""
    device = torch.device("cpu")
    if setup.impl != "thunder_overlap":
        jitted = thunder.jit(model)
        return thunder.distributed.fsdp(
            jitted, device=device, sharding_strategy=setup.sharding.thunder_type, bucketing_strategy=setup.bucketing.thunder_type
        )
    mesh = None
    if setup.replicas > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (setup.replicas, world_size // setup.replicas))
    return overlap_fsdp(
        model,
        device=device,
        sharding_strategy=setup.sharding,
        bucketing_strategy=setup.bucketing,
        config=setup.config,
        device_mesh=mesh,
        mixed_precision=setup.mixed_precision,
        activation_checkpointing=setup.activation_checkpointing,
    )


# Steps whose least peak is the measured one (see _measured_peaks).
MEASURED_STEPS = 3


def _measured_peaks(jm, setup: TrainSetup, world_size: int, rows: slice, bucketing, optimizer) -> tuple[int, int, int]:
    """(measured, predicted) peak bytes of one more forward and backward, beyond its inputs, and
    the bytes of those inputs (the parameters' shards, the batch) that the step holds all along.

    The measured peak is the least of ``MEASURED_STEPS`` such steps: gloo's worker thread drops
    its reference to a collective's tensors a moment after the wait returns, so where the trace
    frees one right after its wait, a loaded machine can free it later than the program does,
    which only ever adds to a step's peak."""
    idx, targets = global_batch(setup, world_size, setup.steps)
    peaks = []
    for _ in range(MEASURED_STEPS):
        optimizer.zero_grad(set_to_none=True)
        with LiveMemoryTracker() as tracker:
            for buffer in bucketing.held_buffers() if bucketing is not None else ():
                tracker.track(buffer)  # held all along, as the estimate counts it
            _loss(jm(idx[rows]), targets[rows]).backward()
        peaks.append(tracker.peak_bytes)
    optimizer.zero_grad(set_to_none=True)
    layouts = bucketing.layouts if bucketing is not None else NO_BUCKETS
    forward_memory = estimate_memory(thunder.last_traces(jm)[-1], layouts=layouts)
    backward_memory = estimate_memory(thunder.last_backward_traces(jm)[-1], layouts=layouts, after=forward_memory)
    predicted = max(forward_memory.peak_beyond_inputs_bytes, backward_memory.peak_beyond_inputs_bytes)
    return min(peaks), predicted, forward_memory.peak_bytes - forward_memory.peak_beyond_inputs_bytes


def _shards(jm) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in jm.named_parameters()}


def _grads(jm) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in jm.named_parameters() if p.grad is not None}


def train_rank(rank: int, world_size: int, setup: TrainSetup) -> RankResult:
    """Trains on this rank's slice of each global batch; call inside an initialised process group."""
    model = _build_model(setup)
    unsharded_numels = {name: p.numel() for name, p in model.named_parameters()}
    jm = _sharded(setup, model, world_size)
    optimizer = _optimizer(setup, jm.parameters())

    rows = slice(rank * setup.micro_batch, (rank + 1) * setup.micro_batch)
    bucketing = BucketingTransform.of(jm) if setup.impl == "thunder_overlap" else None
    if setup.buckets_as_on_nccl and bucketing is not None:
        bucketing.set_layouts({bucket: layout.as_on(NCCL) for bucket, layout in bucketing.layouts.items()})
    census, allocations_after_first_step = OpCensus(), None
    losses, step_ms, step_grads, grad_norms, unclipped = [], [], [], [], []
    step_shards = [_shards(jm)]
    for step in range(setup.steps):
        idx, targets = global_batch(setup, world_size, step)
        counted = bucketing is not None and step == setup.steps - 1 and step > 0
        start = time.perf_counter()
        with census if counted else contextlib.nullcontext():
            optimizer.zero_grad(set_to_none=True)
            loss = _loss(jm(idx[rows]), targets[rows])
            loss.backward()
            if setup.max_norm is not None:
                unclipped.append(_grads(jm))
                grad_norms.append(jm.clip_grad_norm_(setup.max_norm, setup.norm_type).item())
            optimizer.step()
        step_ms.append((time.perf_counter() - start) * 1e3)
        losses.append(loss.item())
        # Outside the census: the optimizer left .grad as it used it.
        step_grads.append(_grads(jm))
        step_shards.append(_shards(jm))
        if bucketing is not None and step == 0:
            allocations_after_first_step = bucketing.allocations
    buckets_counted = None
    if census.records:
        backward = thunder.last_backward_traces(jm)[-1]
        buckets_counted = bucket_census(jm, bucketing, census, allocations_after_first_step, unsharded_numels, backward)

    peak = predicted_peak = held = None
    if setup.measure_memory:
        peak, predicted_peak, held = _measured_peaks(jm, setup, world_size, rows, bucketing, optimizer)
    forward, backward = thunder.last_traces(jm)[-1], thunder.last_backward_traces(jm)[-1]
    layouts = bucketing.layouts if bucketing is not None else NO_BUCKETS

    return RankResult(
        rank=rank,
        losses=losses,
        step_ms=step_ms,
        peak_step_bytes=peak,
        predicted_peak_step_bytes=predicted_peak,
        held_inputs_bytes=held,
        forward_picture=schedule_picture(forward),
        backward_picture=schedule_picture(backward),
        forward_stats=schedule_stats(forward, layouts=layouts),
        backward_stats=schedule_stats(backward, layouts=layouts),
        collectives=collective_sequence(forward) + collective_sequence(backward),
        shards=step_shards[-1],
        saved_unsharded=saved_unsharded(forward),
        kept_parameters=sorted(zero3.kept_parameters()) if (zero3 := Zero3Transform.of(jm)) is not None else [],
        bucket_census=buckets_counted,
        step_shards=step_shards,
        step_grads=step_grads,
        grad_norms=grad_norms,
        step_unclipped_grads=unclipped,
        forward_groups=collective_groups(forward),
        backward_groups=collective_groups(backward),
    )


def check_against_reference(setup: TrainSetup, world_size: int, results: list[RankResult]):
    """Every step of ``results`` against a float64 single-process reference of the same steps:
    parity.check_steps, whose mismatches say which tensor, rank and element differ by how much."""
    from thunder_overlap.testing.float_error import OptimizerReplay, rounding_count
    from thunder_overlap.testing.parity import Clipping, RankSteps, check_steps

    def loss_terms(model, step: int) -> list[torch.Tensor]:
        idx, targets = global_batch(setup, world_size, step)
        rows = [slice(r * setup.micro_batch, (r + 1) * setup.micro_batch) for r in range(world_size)]
        return [_loss(model(idx[r]), targets[r]) for r in rows]

    model = _build_model(setup)
    if setup.activation_checkpointing:
        checkpoint_blocks(model, find_blocks(model))
    tokens = setup.micro_batch * setup.seq_len
    roundings = rounding_count(model.parameters(), tokens=tokens, seq_len=setup.seq_len, world_size=world_size)
    ranks = [RankSteps(r.rank, r.step_shards, r.step_grads, r.grad_norms) for r in results]
    clip = Clipping(setup.max_norm, setup.norm_type) if setup.max_norm is not None else None

    def replay() -> OptimizerReplay:
        return OptimizerReplay(setup.optimizer, setup.lr, eps=setup.adamw_eps)

    return check_steps(ranks, model, loss_terms, replay, roundings, shards=world_size // setup.replicas, clip=clip)


def shard_of(full: torch.Tensor, rank: int, world_size: int) -> tuple[torch.Tensor, int]:
    """Rank's dim-0 chunk of ``full`` as Thunder shards it, and how many of its rows are real
    (the rest is padding)."""
    chunk = -(-full.shape[0] // world_size)
    start = min(rank * chunk, full.shape[0])
    real = full[start : start + chunk]
    return real, real.shape[0]
