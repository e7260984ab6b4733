"""A short, deterministic training run on one rank, shared by the demo, the tests and benchmarks.

``train_rank`` trains :class:`~thunder_overlap.models.TinyGPT` with either thunder_overlap or
Thunder's own FSDP and reports losses, step times, measured peak memory, the final shards and
the schedule of the final traces. ``train_reference`` runs the same steps in one process without
any sharding: the ground truth for numerics.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
import thunder

from thunder_overlap.api import fsdp as overlap_fsdp, parse_bucketing_strategy, parse_sharding_strategy
from thunder_overlap.classify import NodeKind, classify_trace
from thunder_overlap.config import OverlapConfig
from thunder_overlap.memory import LiveMemoryTracker
from thunder_overlap.models import TinyGPT, TinyGPTConfig
from thunder_overlap.schedule_view import ScheduleStats, schedule_picture, schedule_stats

__all__ = ["IMPLEMENTATIONS", "TrainSetup", "RankResult", "train_rank", "train_reference", "collective_sequence"]

IMPLEMENTATIONS = ("thunder_overlap", "thunder")


@dataclass(frozen=True)
class TrainSetup:
    impl: str = "thunder_overlap"
    sharding: str = "zero3"
    bucketing: str = "none"
    model: TinyGPTConfig = field(default_factory=TinyGPTConfig)
    micro_batch: int = 2
    seq_len: int = 32
    steps: int = 3
    lr: float = 0.05
    seed: int = 0
    config: OverlapConfig | None = None
    # One extra forward+backward after training, under LiveMemoryTracker (not timed).
    measure_memory: bool = True

    def __post_init__(self) -> None:
        if self.impl not in IMPLEMENTATIONS:
            raise ValueError(f"impl must be one of {IMPLEMENTATIONS}, got {self.impl!r}")
        parse_sharding_strategy(self.sharding)
        parse_bucketing_strategy(self.bucketing)
        if self.seq_len > self.model.block_size:
            raise ValueError(f"seq_len={self.seq_len} exceeds the model's block_size={self.model.block_size}")


@dataclass
class RankResult:
    rank: int
    losses: list[float]
    step_ms: list[float]
    peak_step_bytes: int | None
    forward_picture: str
    backward_picture: str
    forward_stats: ScheduleStats
    backward_stats: ScheduleStats
    # "all_gather f32[64, 64]"-like entries, forward then backward, in trace order.
    collectives: list[str]
    # Local shards after training (name -> tensor, padded as Thunder pads).
    shards: dict[str, torch.Tensor]
    # Saved-for-backward tensors that are gathered parameters or views of them (ZeRO3: none).
    saved_unsharded: list[str]


def _global_batch(setup: TrainSetup, world_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(setup.seed * 1000 + step)
    shape = (setup.micro_batch * world_size, setup.seq_len + 1)
    tokens = torch.randint(0, setup.model.vocab_size, shape, generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _build_model(setup: TrainSetup) -> TinyGPT:
    torch.manual_seed(setup.seed)
    return TinyGPT(setup.model)


def saved_unsharded(forward) -> list[str]:
    annotated = classify_trace(forward)
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
    annotated = classify_trace(trace)
    sequence = []
    for node in annotated.nodes:
        if node.kind in (NodeKind.COLLECTIVE, NodeKind.WAIT):
            out = node.bsym.flat_proxy_outs[0]
            sequence.append(f"{node.name}({node.inputs[0]}) {out.dtype} {list(out.shape)}")
    return sequence


def train_rank(rank: int, world_size: int, setup: TrainSetup) -> RankResult:
    """Trains on this rank's slice of each global batch; call inside an initialised process group."""
    model = _build_model(setup)
    sharding = parse_sharding_strategy(setup.sharding)
    device = torch.device("cpu")
    if setup.impl == "thunder_overlap":
        jm = overlap_fsdp(
            model, device=device, sharding_strategy=sharding, bucketing_strategy=setup.bucketing, config=setup.config
        )
    else:
        bucketing = parse_bucketing_strategy(setup.bucketing)
        jm = thunder.distributed.fsdp(
            thunder.jit(model), device=device, sharding_strategy=sharding, bucketing_strategy=bucketing
        )
    optimizer = torch.optim.SGD([p for p in jm.parameters() if p.requires_grad], lr=setup.lr)

    rows = slice(rank * setup.micro_batch, (rank + 1) * setup.micro_batch)
    losses, step_ms = [], []
    for step in range(setup.steps):
        idx, targets = _global_batch(setup, world_size, step)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = _loss(jm(idx[rows]), targets[rows])
        loss.backward()
        optimizer.step()
        step_ms.append((time.perf_counter() - start) * 1e3)
        losses.append(loss.item())

    shards = {name: p.detach().clone() for name, p in jm.named_parameters()}
    peak = None
    if setup.measure_memory:
        idx, targets = _global_batch(setup, world_size, setup.steps)
        optimizer.zero_grad(set_to_none=True)
        with LiveMemoryTracker() as tracker:
            _loss(jm(idx[rows]), targets[rows]).backward()
        peak = tracker.peak_bytes
        optimizer.zero_grad(set_to_none=True)

    forward, backward = thunder.last_traces(jm)[-1], thunder.last_backward_traces(jm)[-1]
    return RankResult(
        rank=rank,
        losses=losses,
        step_ms=step_ms,
        peak_step_bytes=peak,
        forward_picture=schedule_picture(forward),
        backward_picture=schedule_picture(backward),
        forward_stats=schedule_stats(forward),
        backward_stats=schedule_stats(backward),
        collectives=collective_sequence(forward) + collective_sequence(backward),
        shards=shards,
        saved_unsharded=saved_unsharded(forward),
    )


def train_reference(setup: TrainSetup, world_size: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same steps on one process over the whole global batch, with no sharding."""
    model = _build_model(setup)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=setup.lr)
    losses = []
    for step in range(setup.steps):
        idx, targets = _global_batch(setup, world_size, step)
        optimizer.zero_grad(set_to_none=True)
        loss = _loss(model(idx), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def shard_of(full: torch.Tensor, rank: int, world_size: int) -> tuple[torch.Tensor, int]:
    """Rank's dim-0 chunk of ``full`` as Thunder shards it, and how many of its rows are real
    (the rest is padding)."""
    chunk = -(-full.shape[0] // world_size)
    start = min(rank * chunk, full.shape[0])
    real = full[start : start + chunk]
    return real, real.shape[0]
