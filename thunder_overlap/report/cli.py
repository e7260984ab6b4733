"""``python -m thunder_overlap report``: predicted overlap and memory at any world size, no GPU.

The model is built on the meta device and traced (never run) in one process that pretends to be
rank 0 of ``--world-size`` ranks through PyTorch's ``fake`` process group, so a 1024-rank
Llama-2-7B report needs neither GPUs nor memory for the weights. Thunder's tracing dominates the
run time (about 5 s per transformer layer here); a heartbeat shows it is still going.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

__all__ = ["BUILTIN_MODELS", "main"]

# The fake process group takes any size; beyond this no FSDP job exists and shards get silly.
MAX_WORLD_SIZE = 1 << 20
# Seconds between progress lines while Thunder traces.
HEARTBEAT_S = 15.0


@dataclass(frozen=True)
class BuiltinModel:
    build: Callable[[int | None], nn.Module]  # n_layer (None: the config's) -> module
    block_size: int
    vocab_size: int


def _tiny_gpt(n_layer: int | None) -> nn.Module:
    from thunder_overlap.tools.tiny_models import TinyGPT, TinyGPTConfig

    config = TinyGPTConfig()
    return TinyGPT(replace(config, n_layer=n_layer or config.n_layer))


def _llama_2_7b(n_layer: int | None) -> nn.Module:
    from thunder_overlap.tools.tiny_models import Llama, LlamaConfig

    config = LlamaConfig()
    return Llama(replace(config, n_layer=n_layer or config.n_layer))


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "tiny-gpt": BuiltinModel(_tiny_gpt, block_size=32, vocab_size=101),
    "llama-2-7b": BuiltinModel(_llama_2_7b, block_size=4096, vocab_size=32000),
}


_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class UsageError(ValueError):
    """A bad command-line value; printed without a traceback."""


def _litgpt_model(name: str, n_layer: int | None) -> BuiltinModel:
    try:
        from litgpt import GPT, Config
    except ImportError:
        raise UsageError(
            f"unknown model {name!r}; built-in models: {sorted(BUILTIN_MODELS)}. litgpt config names "
            "(such as 'Llama-2-7b-hf') need litgpt: pip install litgpt==0.5.13"
        ) from None
    try:
        config = Config.from_name(name, **({"n_layer": n_layer} if n_layer else {}))
    except ValueError:
        raise UsageError(f"unknown model {name!r}: neither built-in ({sorted(BUILTIN_MODELS)}) nor a litgpt config name") from None
    return BuiltinModel(lambda _: GPT(config), block_size=config.block_size, vocab_size=config.padded_vocab_size)


def _parse(argv: list[str]) -> argparse.Namespace:
    from thunder_overlap.analysis.cost_model import DEVICE_PROFILES, NETWORK_PROFILES

    parser = argparse.ArgumentParser(prog="python -m thunder_overlap report", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-2-7b", help=f"built-in {sorted(BUILTIN_MODELS)} or a litgpt config name")
    parser.add_argument("--n-layer", type=int, default=None, help="override the number of transformer layers")
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--sharding", default="zero3", help="zero2 or zero3")
    parser.add_argument("--bucketing", default="none", help="none, layer or block")
    parser.add_argument("--device-profile", default="h100", help=f"one of {sorted(DEVICE_PROFILES)}")
    parser.add_argument(
        "--network", default="auto", help=f"auto (nvlink up to 8 ranks, else infiniband), {sorted(NETWORK_PROFILES)}, or custom:<latency_us>:<GB/s>"
    )
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPES), help="parameter and activation dtype")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=None, help="default: the model's block size")
    parser.add_argument("--out", default="thunder_overlap_report", help="directory for report.json, report.trace.json, report.png")
    parser.add_argument("--steps", type=int, default=0, help="also print the first N rows of the per-step table")
    parser.add_argument(
        "--compare-policies",
        action="store_true",
        help="also schedule with every policy (stock, just_in_time, heuristic, greedy, memory_aware) and print them side by side",
    )
    args = parser.parse_args(argv)
    if not 1 <= args.world_size <= MAX_WORLD_SIZE:
        raise UsageError(f"--world-size {args.world_size} is impossible; accepted: 1 to {MAX_WORLD_SIZE} ranks")
    if args.n_layer is not None and args.n_layer < 1:
        raise UsageError(f"--n-layer {args.n_layer} is impossible; a model needs at least 1 layer")
    if args.batch_size < 1:
        raise UsageError(f"--batch-size {args.batch_size} must be at least 1")
    if args.network == "auto":
        args.network = "nvlink" if args.world_size <= 8 else "infiniband"
    return args


class _Heartbeat:
    """Prints elapsed time every ``HEARTBEAT_S`` seconds while a long step runs."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True)

    def _beat(self) -> None:
        start = time.perf_counter()
        while not self._stop.wait(HEARTBEAT_S):
            print(f"  ... {self.what}: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)

    def __enter__(self) -> _Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def trace_model(
    model: nn.Module, *, world_size: int, sharding: str, bucketing: str, idx_shape: tuple[int, int], config=None
):
    """Traces ``model`` (on meta) with thunder_overlap's FSDP on a fake group of ``world_size``
    and ``config`` (an OverlapConfig; give it the report's cost model, as the meta device has no
    profile of its own); returns the jitted module, whose last traces the report reads."""
    import thunder
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import thunder_overlap

    if dist.is_initialized():
        raise RuntimeError("report traces on its own fake process group; call it where no process group is initialised")
    # Thunder's SDPA executor asks CUDA whether flash/memory-efficient attention fits the inputs,
    # which fails on meta tensors (and on machines without a driver); the math path needs nothing.
    sdpa_flags = torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled()
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        jm = thunder_overlap.fsdp(model, device="meta", sharding_strategy=sharding, bucketing_strategy=bucketing, config=config)
        idx = torch.zeros(idx_shape, dtype=torch.long, device="meta")
        thunder.compile_data(jm).get_computation_and_inputs(idx)
        return jm
    finally:
        dist.destroy_process_group()
        torch.backends.cuda.enable_flash_sdp(sdpa_flags[0])
        torch.backends.cuda.enable_mem_efficient_sdp(sdpa_flags[1])


def main(argv: list[str] | None = None) -> int:
    """Runs the report command; returns the process exit status."""
    from thunder_overlap.options import parse_bucketing_strategy, parse_sharding_strategy
    from thunder_overlap.config import OverlapConfig
    from thunder_overlap.analysis.cost_model import CostModel
    from thunder_overlap.report.policies import compare_policies
    from thunder_overlap.report.report import report

    argv = sys.argv[1:] if argv is None else argv
    try:
        args = _parse(argv)
        cost_model = CostModel.named(args.device_profile, args.network)
        parse_sharding_strategy(args.sharding, flag="--sharding")
        parse_bucketing_strategy(args.bucketing, flag="--bucketing")
        spec = BUILTIN_MODELS.get(args.model) or _litgpt_model(args.model, args.n_layer)
        seq_len = args.seq_len or spec.block_size
        if not 1 <= seq_len <= spec.block_size:
            raise UsageError(f"--seq-len {seq_len} must be between 1 and the model's block size {spec.block_size}")
    except (UsageError, ValueError, NotImplementedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    start = time.perf_counter()
    _progress(f"building {args.model} ({args.n_layer or 'all'} layers) on the meta device")
    with torch.device("meta"):
        model = spec.build(args.n_layer).to(_DTYPES[args.dtype])
    layers = args.n_layer or "all"
    _progress(f"tracing forward and backward at world size {args.world_size}, {args.sharding} (about 5 s per layer, {layers} layers)")
    with _Heartbeat("tracing"):
        jm = trace_model(
            model,
            world_size=args.world_size,
            sharding=args.sharding,
            bucketing=args.bucketing,
            idx_shape=(args.batch_size, seq_len),
            config=OverlapConfig(cost_model=cost_model),
        )
    traced = time.perf_counter()
    _progress(f"traced in {traced - start:.1f} s; simulating with {args.device_profile} / {args.network}")
    result = report(jm, cost_model=cost_model)
    _progress(f"analysed in {time.perf_counter() - traced:.2f} s")

    print(result)
    if args.steps:
        print(result["forward"].step_table(max_rows=args.steps))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result.to_json(out / "report.json")
    result.to_chrome_trace(out / "report.trace.json")
    written = ["report.json", "report.trace.json"]
    if args.compare_policies:
        comparison = compare_policies(jm, cost_model=cost_model, config=OverlapConfig(cost_model=cost_model))
        print(comparison)
        comparison.to_json(out / "policies.json")
        written.append("policies.json")
    try:
        result.to_png(out / "report.png")
        written.append("report.png")
    except RuntimeError as e:  # no matplotlib: the text and JSON are still useful
        _progress(f"skipped the PNG: {e}")
    _progress(f"wrote {', '.join(str(out / w) for w in written)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
