"""The timed training loop of one rank."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

import thunder
import torch
from thunder.core.module import ThunderModule

from thunder_overlap import BucketingTransform, OverlapScheduleTransform, schedule_picture, schedule_stats
from thunder_overlap._bucketing.path_choice import GATHERED_PER_PARAMETER, REDUCED_FROM_COPY
from thunder_overlap.report._report import module_layouts

from fsdp_bench.bench_config import BenchmarkConfig
from fsdp_bench.bench_models import ModelSpec, build_model, train_flops_per_step
from fsdp_bench.cuda_peak import record_step_peak
from fsdp_bench.distributed import RunContext
from fsdp_bench.impls import ModelStep, make_step
from fsdp_bench.peak_memory import CPU_METHOD, CUDA_METHOD, cpu_peak_bytes
from fsdp_bench.profiling import NsysWindow, nvtx_collectives, nvtx_range
from fsdp_bench.results import BenchmarkResult

__all__ = ["run_benchmark"]


def _batch(cfg: BenchmarkConfig, spec: ModelSpec, ctx: RunContext, iteration: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens, different on every rank and iteration, identical across implementations."""
    generator = torch.Generator().manual_seed(cfg.seed + 1_000_003 * iteration + ctx.rank)
    tokens = torch.randint(0, spec.vocab_size, (cfg.micro_batch_size, spec.block_size + 1), generator=generator)
    tokens = tokens.to(ctx.device)
    return tokens[:, :-1], tokens[:, 1:]


def _schedule(model: torch.nn.Module) -> dict[str, dict]:
    if not isinstance(model, ThunderModule):
        return {}
    traces = {"forward": thunder.last_traces(model)[-1], "backward": thunder.last_backward_traces(model)[-1]}
    layouts = module_layouts(model)
    schedule = {name: {"picture": schedule_picture(t), **asdict(schedule_stats(t, layouts=layouts))} for name, t in traces.items()}
    transform = OverlapScheduleTransform.of(model)
    paths = transform.bucket_paths if transform is not None else None
    if paths is None:
        return schedule
    # Chosen at the backward's first compile.
    for key, change in (("per_tensor_gather", GATHERED_PER_PARAMETER), ("reduce_from_copy", REDUCED_FROM_COPY)):
        outcome = paths.outcome(change)
        if outcome is not None:
            schedule["backward"][f"{key}s" if key == "per_tensor_gather" else "reduces_from_copy"] = list(outcome.labels)
            schedule["backward"][f"{key}_reason"] = outcome.reason
    return schedule


def _bucket_pool_bytes(model: torch.nn.Module) -> tuple[list[int], list[int]]:
    """The bucket pool's buffers as the steps grew them and as planned from the final traces."""
    bucketing = BucketingTransform.of(model) if isinstance(model, ThunderModule) else None
    if bucketing is None:
        return [], []
    grown = sorted((slot.nbytes for slot in bucketing.pool.slots), reverse=True)
    planned = sorted((slot.nbytes for slot in bucketing.slot_plan(model).slots), reverse=True)
    return grown, planned


def _dump_traces(model: torch.nn.Module, json_path: str) -> None:
    if not isinstance(model, ThunderModule):
        print(f"--dump_traces: {type(model).__name__} is not a Thunder module; no traces to write")
        return
    stem = Path(json_path).with_suffix("")
    for name, traces in (("forward", thunder.last_traces(model)), ("backward", thunder.last_backward_traces(model))):
        path = stem.with_name(f"{stem.name}.{name}_trace.py")
        path.write_text(str(traces[-1]))
        print(f"wrote the final {name} execution trace to {path}")


def _write_cuda_peak(path: str, one_step, ctx: RunContext) -> None:
    if not ctx.is_cuda:
        raise ValueError(f"--cuda_peak_json records the CUDA caching allocator; this run is on {ctx.device.type}")
    peak = record_step_peak(one_step, ctx.device)  # every rank steps: the collectives need them all
    if ctx.rank == 0:
        Path(path).write_text(json.dumps(peak.to_json(), indent=1))
        print(f"wrote the peak of one step, {peak.peak_over_start_bytes / 2**20:.1f} MiB over its start, to {path}")


def _peak_memory(model, step, batch, ctx: RunContext) -> tuple[int, str]:
    if ctx.is_cuda:
        return torch.cuda.max_memory_allocated(), CUDA_METHOD
    optimizer = step.optimizer if isinstance(step, ModelStep) else None
    return cpu_peak_bytes(model, optimizer, lambda: step(*batch)), CPU_METHOD


def _timed_loop(cfg: BenchmarkConfig, ctx: RunContext, spec: ModelSpec, step) -> tuple[list[float], float]:
    """The iterations: wall times of the timed ones (ms) and the last loss."""
    window = NsysWindow(cfg.nsys_enabled, cfg.profiler_start, cfg.profiler_stop, ctx.rank)
    iter_ms: list[float] = []
    loss_value = float("nan")
    for i in range(cfg.max_iters):
        if i == cfg.warmup_iters and ctx.is_cuda:
            torch.cuda.reset_peak_memory_stats()
        idx, targets = _batch(cfg, spec, ctx, i)
        window.before_iteration(i)
        start = time.perf_counter()
        with nvtx_range(f"iteration {i}", ctx.is_cuda):
            loss = step(idx, targets)
        loss_value = loss.item()  # synchronises the device
        elapsed_ms = (time.perf_counter() - start) * 1e3
        window.after_iteration(i)
        if i >= cfg.warmup_iters:
            iter_ms.append(elapsed_ms)
        if ctx.rank == 0:
            print(f"iter {i}: loss {loss_value:.4f}, iter time: {elapsed_ms:.2f}ms, t: {spec.block_size}", flush=True)
    return iter_ms, loss_value


def run_benchmark(cfg: BenchmarkConfig, ctx: RunContext) -> BenchmarkResult:
    """Runs ``cfg.max_iters`` iterations and times those after the first ``cfg.warmup_iters``.
    Rank 0 prints a progress line per iteration."""
    # Every rank initialises the same weights (torchrun's ranks start from different generator states).
    torch.manual_seed(cfg.seed)
    model, spec = build_model(cfg.model_name, cfg.n_layers, cfg.block_size)
    model = model.to(ctx.dtype)
    flops = 0 if cfg.impl == "comm_only" else train_flops_per_step(model, spec, cfg.micro_batch_size)
    # Untimed steps (comm_only's trace capture, the CPU memory step) use the batch after the last.
    untimed_batch = _batch(cfg, spec, ctx, cfg.max_iters)
    model, step = make_step(model, cfg, ctx, untimed_batch)
    with nvtx_collectives(ctx.is_cuda):
        iter_ms, loss_value = _timed_loop(cfg, ctx, spec, step)
        peak, method = _peak_memory(model, step, untimed_batch, ctx)

    if cfg.dump_traces and ctx.rank == 0:
        _dump_traces(model, cfg.json_path)
    if cfg.cuda_peak_json is not None:
        _write_cuda_peak(cfg.cuda_peak_json, lambda: step(*untimed_batch), ctx)
    optimizer_ms = getattr(step, "optimizer_ms", [])[cfg.warmup_iters : cfg.max_iters]
    pool_bytes, pool_plan_bytes = _bucket_pool_bytes(model)
    return BenchmarkResult(
        impl=cfg.impl,
        model_name=cfg.model_name,
        shard_mode=cfg.shard_mode,
        bucketing_mode=cfg.bucketing_mode,
        world_size=ctx.world_size,
        device=ctx.device.type,
        dtype=str(ctx.dtype).removeprefix("torch."),
        mixed_precision=cfg.mixed_precision,
        max_norm=cfg.max_norm,
        activation_checkpointing=cfg.activation_checkpointing,
        executors=cfg.executors,
        n_layers=spec.n_layers,
        block_size=spec.block_size,
        micro_batch_size=cfg.micro_batch_size,
        max_iters=cfg.max_iters,
        warmup_iters=cfg.warmup_iters,
        iter_times_ms=iter_ms,
        optimizer_times_ms=optimizer_ms,
        model_flops_per_rank_step=flops,
        peak_memory_bytes=peak,
        peak_memory_method=method,
        final_loss=loss_value,
        schedule=_schedule(model),
        bucket_pool_bytes=pool_bytes,
        bucket_pool_plan_bytes=pool_plan_bytes,
    )
