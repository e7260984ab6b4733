"""What reducing in the pool costs on NCCL, predicted: Llama-2-7B shapes (4 layers, bf16), block
buckets, 64 H100s over InfiniBand, ZeRO2 and ZeRO3, with ``OverlapConfig.reduce_in_pool`` on and
off. On NCCL a bucket that does not reduce in the pool sends its gradients where they are; one
that does lays them out first (one copy on the compute stream, at memory bandwidth) and lets them
go at once instead of at the wait.

    python benchmarks/reduce_in_pool_prediction.py --out benchmarks/measured/reduce_in_pool
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from thunder_overlap._analysis.cost_model import CostModel
from thunder_overlap.config import OverlapConfig
from thunder_overlap.report._models import model_recipe, trace_model
from thunder_overlap.report._report import report
from thunder_overlap.report._thunder_baseline import fake_process_group

WORLD_SIZE = 64
N_LAYER = 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/measured/reduce_in_pool"), help="where the report JSONs go")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cost_model = CostModel.named("h100", "infiniband")
    recipe = model_recipe("llama-2-7b", N_LAYER)
    for sharding in ("zero2", "zero3"):
        for reduce_in_pool in (True, False):
            with torch.device("meta"):
                model = recipe.build().to(torch.bfloat16)
            config = OverlapConfig(cost_model=cost_model, reduce_in_pool=reduce_in_pool)
            with fake_process_group(WORLD_SIZE):
                jm = trace_model(
                    model, world_size=WORLD_SIZE, sharding=sharding, bucketing="block", idx_shape=(1, recipe.block_size), config=config
                )
                result = report(jm, cost_model=cost_model)
            name = f"{sharding}_block_{'reduce_in_pool' if reduce_in_pool else 'own_shards'}"
            result.to_json(args.out / f"{name}.json")
            print(f"{name}\n{result}\n")


if __name__ == "__main__":
    main()
