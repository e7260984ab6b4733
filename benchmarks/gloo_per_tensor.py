"""What a bucket's collectives cost over gloo run per tensor, against one launch for the bucket.

    python benchmarks/gloo_per_tensor.py --out benchmarks/measured/gloo_per_tensor.json

Two gloo ranks on this machine (loopback) move one transformer block of TinyGPT (8 x 128, the
bucket_memory benchmark's model) as a bucket does, each way timed alone (median of repeats, each
waited on before the next):

- gather: the flat shard all-gathered rank-major in one launch (then copied out), against one
  all-gather per parameter into its place in one coalesced launch (gloo runs its members one
  after another): what ``Tuning.per_tensor_gather_max_slowdown`` trades for a buffer;
- reduce-scatter: the laid-out gradients all-reduced in place in one launch (gloo's
  reduce-scatter is an all-reduce of a copy of its input), against one reduce-scatter per
  gradient where it is in one coalesced launch: why buckets never send gradients per tensor
  over gloo.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from thunder_overlap.report._builtin_models import TinyGPT, TinyGPTConfig
from thunder_overlap.testing.local_ranks import run_local_ranks

_REPEATS = 40
_WARMUP = 5


def _median_ms(fn) -> float:
    import torch.distributed as dist

    for _ in range(_WARMUP):
        fn()
    times = []
    for _ in range(_REPEATS):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _measure(rank: int, world_size: int, numels: list[int]) -> dict[str, float]:
    import torch.distributed as dist

    shard_numels = [-(-n // world_size) for n in numels]
    gathered = torch.empty(world_size * sum(shard_numels))
    flat_shard = torch.randn(sum(shard_numels))
    places = list(torch.split(gathered, [world_size * n for n in shard_numels]))
    shards = list(torch.split(flat_shard, shard_numels))
    gradients = [torch.randn(world_size * n) for n in shard_numels]
    received = [torch.empty(n) for n in shard_numels]
    laid_out = torch.randn(world_size * sum(shard_numels))

    def gather_once() -> None:
        dist.all_gather_into_tensor(gathered, flat_shard, async_op=True).wait()

    def gather_per_parameter() -> None:
        with dist._coalescing_manager(async_ops=True) as launch:
            for place, shard in zip(places, shards, strict=True):
                dist.all_gather_into_tensor(place, shard)
        launch.wait()

    def reduce_once() -> None:
        dist.all_reduce(laid_out, async_op=True).wait()

    def reduce_per_gradient() -> None:
        with dist._coalescing_manager(async_ops=True) as launch:
            for piece, gradient in zip(received, gradients, strict=True):
                dist.reduce_scatter_tensor(piece, gradient)
        launch.wait()

    return {
        "gather_one_launch_ms": _median_ms(gather_once),
        "gather_per_parameter_ms": _median_ms(gather_per_parameter),
        "reduce_one_launch_ms": _median_ms(reduce_once),
        "reduce_per_gradient_ms": _median_ms(reduce_per_gradient),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="write the figures here (JSON)")
    args = parser.parse_args()
    block = TinyGPT(TinyGPTConfig(n_layer=1, n_embd=128)).blocks[0]
    numels = [p.numel() for p in block.parameters()]
    result = run_local_ranks(_measure, 2, (numels,))[0]
    result = {"parameters": len(numels), "block_bytes": 4 * sum(numels), **result}
    result["gather_ratio"] = result["gather_per_parameter_ms"] / result["gather_one_launch_ms"]
    result["reduce_ratio"] = result["reduce_per_gradient_ms"] / result["reduce_one_launch_ms"]
    for key, value in result.items():
        print(f"{key}: {value:.3f}" if isinstance(value, float) else f"{key}: {value}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
