"""The benchmark's options: one validated dataclass, and the command line that fills it.

Flag names follow Thunder's ``thunder/benchmarks/benchmark_litgpt.py`` so that commands carry over.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields

from thunder_overlap._analysis.cost_model import CostModel, network_profile
from thunder_overlap.config import OverlapConfig, Tuning
from thunder_overlap.options import BucketingStrategy, ShardingStrategy

__all__ = [
    "BenchmarkConfig",
    "OVERLAP_OPTIONS",
    "variant_config",
    "TRAINING_IMPLS",
    "CALIBRATION_IMPLS",
    "IMPLS",
    "SHARD_MODES",
    "BUCKETING_MODES",
    "DEVICES",
    "MIXED_PRECISIONS",
    "EXECUTORS",
    "parse_args",
]

# thunder_overlap and its variants, each the OverlapConfig (or Tuning) options it sets over the defaults.
OVERLAP_OPTIONS: dict[str, dict[str, object]] = {
    "thunder_overlap": {},
    # Every collective launched on its own: what coalesced launches save.
    "thunder_overlap_uncoalesced": {"coalesce": False},
    # Buckets prefetched as eagerly as per-parameter all-gathers (two ahead), as before the
    # pool's buffers were counted: what the second bucket in flight buys.
    "thunder_overlap_two_ahead": {"bucket_eager_prefetch_blocks": None},
    # Every gradient shard in a buffer of its own, as before reduce-scatters ran in place in
    # idle pool buffers: what reducing in the pool costs or saves in time.
    "thunder_overlap_own_shards": {"reduce_in_pool": False},
    # Every bucket gathered rank-major and copied out over gloo and every lay-out all-reduced in
    # place until its wait, none gathered per parameter or reduce-scattered from gloo's copy
    # where the pool would hold a spare buffer: what those paths cost in time.
    "thunder_overlap_laid_out": {"per_tensor_gather_max_slowdown": None, "reduce_from_copy_max_slowdown": None},
    # Reduce-scatters that hold a pool buffer to their wait capped by reduce-scatter bytes alone
    # (two blocks), as before they were capped at one block: what that cap costs in time.
    "thunder_overlap_two_lay_outs": {"bucket_reduce_scatter_blocks": None},
    # ZeRO3 re-gathering every parameter, as before it kept what its backward needs first where
    # that is free: what keeping them saves. [Note: ZeRO3 keeps what is free]
    "thunder_overlap_regather_all": {"zero3_keeps_free_units": False},
}


def variant_config(impl: str, cost_model: CostModel | None) -> OverlapConfig:
    """The configuration of thunder_overlap variant ``impl``: its options of OverlapConfig's own,
    the others of its tuning."""
    options = OVERLAP_OPTIONS[impl]
    public = {f.name for f in fields(OverlapConfig)} - {"_tuning"}
    tuning = Tuning(**{name: value for name, value in options.items() if name not in public})
    return OverlapConfig(cost_model=cost_model, _tuning=tuning, **{name: value for name, value in options.items() if name in public})


# What is being compared: thunder_overlap's variants, Thunder's own FSDP, PyTorch FSDP2 (eager,
# and with each block torch.compile'd), and a hand-written ZeRO2 loop that gathers a block ahead.
TRAINING_IMPLS = (*OVERLAP_OPTIONS, "thunder", "fsdp2", "fsdp2_compile", "hand_prefetch")
# Calibration runs of the slow-link testbed: the same per-rank compute with no communication,
# thunder_overlap's collectives with no compute, and both at once with no dependencies between
# them (see fsdp_bench.impls).
CALIBRATION_IMPLS = ("compute_only", "comm_only", "compute_with_comm")
IMPLS = TRAINING_IMPLS + CALIBRATION_IMPLS
SHARD_MODES = ShardingStrategy.names()
BUCKETING_MODES = BucketingStrategy.names()
# "auto": CUDA (NCCL) when a GPU is visible, else CPU (gloo).
DEVICES = ("auto", "cpu", "cuda")
# --mixed_precision: fp32 parameters gathered and computed in bf16, gradients reduced in fp32.
MIXED_PRECISIONS = ("bf16/fp32",)
# --executors: Thunder's default executors; its torchcompile executor alone (torch.compile fuses
# the regions between collectives, which thunder_overlap keeps out of its fusions; SDPA is
# decomposed into matmuls); or torchcompile ahead of the defaults, as Thunder's own
# benchmark_litgpt.py --compile thunder_inductor (SDPA stays with its executor).
EXECUTORS = ("default", "torchcompile", "thunder_inductor")


def _check_choice(name: str, value: str, accepted: tuple[str, ...]) -> None:
    if value not in accepted:
        raise ValueError(f"--{name}={value!r} is not supported; accepted: {', '.join(accepted)}")


def _check_positive(name: str, value: int | None, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"--{name} must be a positive integer, got {value!r}")


def _option(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class BenchmarkConfig:
    model_name: str = _option("tiny-gpt", "a litgpt config name (needs the 'bench' extra) or a TinyGPT preset: tiny-gpt, tiny-gpt-4m")
    n_layers: int | None = _option(None, "override the model's number of transformer blocks")
    block_size: int | None = _option(None, "override the model's sequence length")
    micro_batch_size: int = _option(1, "sequences per rank per iteration")
    impl: str = _option("thunder_overlap", "implementation to run")
    shard_mode: str = _option("zero2", "ZeRO stage of the parameters")
    bucketing_mode: str = _option("none", "how parameters are grouped per collective")
    device: str = _option("auto", "auto: CUDA (NCCL) when a GPU is visible, else CPU (gloo)")
    network: str | None = _option(
        None,
        "the link thunder_overlap schedules for and sizes auto buckets to: a profile name or "
        "custom:<latency_us>:<GB/s>[:ring|tree[:<concurrent launches>]]; default: its own choice for the device",
    )
    # Thunder's defaults: 45 iterations, the first 25 untimed (jit compilation, allocator warm-up).
    max_iters: int = _option(45, "iterations in all")
    warmup_iters: int = _option(25, "leading iterations that are not timed")
    nsys_enabled: bool = _option(False, "rank 0 brackets iterations profiler_start..profiler_stop with cudaProfilerStart/Stop")
    profiler_start: int = _option(15, "first profiled iteration")
    profiler_stop: int = _option(15, "last profiled iteration (inclusive)")
    dump_traces: bool = _option(False, "write the final forward/backward execution traces next to the JSON (Thunder impls)")
    json_path: str | None = _option(None, "where rank 0 writes the result JSON; printed to stdout when not given")
    cuda_peak_json: str | None = _option(
        None, "CUDA only: where rank 0 writes what one more step had alive at its peak, by the trace line that allocated it"
    )
    seed: int = _option(1337, "seed of the token batches")
    memory_budget_bytes: int | None = _option(
        None, "thunder_overlap: OverlapConfig.memory_budget_bytes, the per-rank budget sharding auto chooses within"
    )
    mixed_precision: str | None = _option(
        None,
        "bf16/fp32: fp32 parameters gathered and computed in bf16, gradients reduced in fp32 (thunder_overlap's "
        "MixedPrecision, fsdp2's MixedPrecisionPolicy; compute_only computes a bf16 copy); Thunder's FSDP has none",
    )
    activation_checkpointing: bool = _option(
        False,
        "every block recomputes its activations in the backward (thunder_overlap's activation_checkpointing; "
        "compute_only checkpoints the same blocks); Thunder's FSDP and fsdp2 are not wired",
    )
    executors: str = _option(
        "default",
        "Thunder's executors: default; torchcompile (Thunder's torch.compile executor alone, fusing what runs between "
        "collectives); thunder_inductor (torchcompile ahead of the defaults, as Thunder's benchmark_litgpt.py). "
        "thunder_overlap and compute_only; fsdp2_compile is FSDP2's counterpart",
    )
    max_norm: float | None = _option(
        None,
        "clip the gradient to this global norm before each optimizer step (thunder_overlap.clip_grad_norm_; fsdp2 and "
        "compute_only: torch.nn.utils.clip_grad_norm_); Thunder's FSDP has none",
    )

    def __post_init__(self) -> None:
        _check_choice("impl", self.impl, IMPLS)
        _check_choice("shard_mode", self.shard_mode, SHARD_MODES)
        _check_choice("bucketing_mode", self.bucketing_mode, BUCKETING_MODES)
        _check_choice("device", self.device, DEVICES)
        if self.network is not None:
            network_profile(self.network)  # raises naming the accepted profiles
        _check_positive("n_layers", self.n_layers, optional=True)
        _check_positive("block_size", self.block_size, optional=True)
        _check_positive("micro_batch_size", self.micro_batch_size)
        _check_positive("max_iters", self.max_iters)
        if not 0 <= self.warmup_iters < self.max_iters:
            raise ValueError(
                f"--warmup_iters={self.warmup_iters} must be in [0, --max_iters={self.max_iters}): at least one iteration has to be timed"
            )
        if self.nsys_enabled and not 0 <= self.profiler_start <= self.profiler_stop < self.max_iters:
            raise ValueError(
                f"--profiler_start={self.profiler_start} and --profiler_stop={self.profiler_stop} must satisfy "
                f"0 <= start <= stop < --max_iters={self.max_iters}"
            )
        if self.cuda_peak_json is not None and self.device == "cpu":
            raise ValueError("--cuda_peak_json records the CUDA caching allocator; it needs --device cuda or auto, not cpu")
        if self.mixed_precision is not None:
            _check_choice("mixed_precision", self.mixed_precision, MIXED_PRECISIONS)
            if self.impl == "thunder":
                raise ValueError("--mixed_precision: Thunder's own FSDP has no mixed precision; leave it out for --impl thunder")
        if self.impl == "hand_prefetch" and self.shard_mode != "zero2":
            raise ValueError(f"--impl hand_prefetch is a ZeRO2 loop; --shard_mode={self.shard_mode} is not wired, use zero2")
        if self.impl == "thunder_overlap_regather_all" and self.shard_mode != "zero3":
            raise ValueError(
                f"--impl thunder_overlap_regather_all changes ZeRO3's backward; --shard_mode={self.shard_mode} has none, use zero3"
            )
        if self.mixed_precision is not None and self.impl == "hand_prefetch":
            raise ValueError("--mixed_precision: --impl hand_prefetch computes in the parameters' dtype; leave it out")
        if self.activation_checkpointing and self.impl in ("thunder", "fsdp2", "fsdp2_compile", "hand_prefetch"):
            raise ValueError(f"--activation_checkpointing: not wired for --impl {self.impl}; leave it out")
        _check_choice("executors", self.executors, EXECUTORS)
        if self.executors != "default" and not (self.impl.startswith("thunder_overlap") or self.impl == "compute_only"):
            raise ValueError(
                f"--executors={self.executors}: wired for thunder_overlap and compute_only, not --impl {self.impl} "
                "(Thunder's FSDP would fuse its collectives into torch.compile; FSDP2's counterpart is fsdp2_compile)"
            )
        if self.max_norm is not None:
            if not self.max_norm > 0:
                raise ValueError(f"--max_norm must be a positive number, got {self.max_norm!r}")
            if self.impl in ("thunder", "comm_only"):
                raise ValueError(f"--max_norm: --impl {self.impl} has no gradient to clip by its global norm; leave it out")
            if self.impl == "hand_prefetch":
                raise ValueError("--max_norm: --impl hand_prefetch's gradients are flat shards, whose norm is local; leave it out")
        if (self.shard_mode == "auto" or self.memory_budget_bytes is not None) and not self.impl.startswith("thunder_overlap"):
            raise ValueError(
                f"--shard_mode={self.shard_mode} --memory_budget_bytes={self.memory_budget_bytes}: sharding auto and its "
                f"budget are thunder_overlap's; --impl {self.impl} takes --shard_mode zero2 or zero3 and no budget"
            )
        if self.dump_traces and self.json_path is None:
            raise ValueError("--dump_traces writes the traces next to the result JSON; give --json_path too")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="FSDP training benchmark; launch with `torchrun --nproc_per_node=N benchmarks/benchmark_fsdp.py`.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    choices = {"impl": IMPLS, "shard_mode": SHARD_MODES, "bucketing_mode": BUCKETING_MODES, "device": DEVICES, "executors": EXECUTORS}
    for f in fields(BenchmarkConfig):
        if f.default is False:
            parser.add_argument(f"--{f.name}", action="store_true", help=f.metadata["help"])
            continue
        kind = int if f.type in ("int", "int | None") else float if f.type == "float | None" else str
        parser.add_argument(f"--{f.name}", type=kind, default=f.default, choices=choices.get(f.name), help=f.metadata["help"])
    return parser


def parse_args(argv: list[str] | None = None) -> BenchmarkConfig:
    """The command line as a BenchmarkConfig; bad values exit with the validation message."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        return BenchmarkConfig(**vars(args))
    except ValueError as e:
        parser.error(str(e))
