"""FSDP training benchmark: thunder_overlap vs Thunder's FSDP vs PyTorch FSDP2.

    torchrun --nproc_per_node=8 benchmarks/benchmark_fsdp.py \
        --model_name Llama-2-7b-hf --n_layers 8 --micro_batch_size 1 \
        --shard_mode zero3 --impl thunder_overlap --json_path results/overlap_zero3.json

Options follow Thunder's ``thunder/benchmarks/benchmark_litgpt.py`` (see ``--help`` and
benchmarks/README.md, which also gives the nsys command). Runs on CUDA with NCCL, or on CPU with
gloo (``--device cpu``). Rank 0 prints one progress line per iteration, then a summary, and writes
the result JSON to ``--json_path``.
"""

from __future__ import annotations

import json
import sys

import torch.distributed as dist

from fsdp_bench.bench_config import parse_args
from fsdp_bench.distributed import init_distributed
from fsdp_bench.runner import run_benchmark


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    ctx = init_distributed(cfg.device)
    try:
        result = run_benchmark(cfg, ctx)
        if ctx.rank == 0:
            print(result.summary())
            if cfg.json_path is not None:
                result.write(cfg.json_path)
                print(f"wrote {cfg.json_path}")
            else:
                print(json.dumps(result.to_json()))
        # Both ranks done before either tears its groups down: a gloo rank destroyed while its
        # peer still held the connection aborted at exit once ("terminate called without an
        # active exception", FSDP2's run). Not on an error, where the peer may never arrive.
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
