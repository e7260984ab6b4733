"""Activation checkpointing's memory on 2 gloo ranks: the step's measured peak with and without
``fsdp(..., activation_checkpointing=True)``, side by side in one run, and the memory
estimator's prediction of each; the backward's all-gathers of each.

    python benchmarks/activation_checkpointing.py --out benchmarks/measured/activation_checkpointing/memory.json

TinyGPT (8 blocks, 64 channels) at sequence 256: activations dominate the step, as in training.
The peaks are what one more forward and backward allocated beyond its inputs
(``thunder_overlap.testing.live_memory``), the bytes ``memory_budget_bytes`` is held against less
the shards and batch it keeps all along.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from thunder_overlap.report._builtin_models import TinyGPTConfig
from thunder_overlap.testing.local_ranks import run_local_ranks
from thunder_overlap.testing.training import TrainSetup, train_rank

SETTINGS = (("zero3", "block"), ("zero2", "none"))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--out", default=None, help="where to write the JSON (default: print only)")
    args = parser.parse_args(argv)
    model = TinyGPTConfig(n_layer=args.n_layer, block_size=args.seq_len)
    rows = []
    for sharding, bucketing in SETTINGS:
        for checkpointing in (False, True):
            setup = TrainSetup(
                sharding=sharding,
                bucketing=bucketing,
                model=model,
                seq_len=args.seq_len,
                micro_batch=args.micro_batch,
                steps=1,
                activation_checkpointing=checkpointing,
            )
            rank = run_local_ranks(train_rank, 2, (setup,))[0]
            rows.append(
                {
                    "sharding": sharding,
                    "bucketing": bucketing,
                    "activation_checkpointing": checkpointing,
                    "peak_step_bytes": rank.peak_step_bytes,
                    "predicted_peak_step_bytes": rank.predicted_peak_step_bytes,
                    "held_inputs_bytes": rank.held_inputs_bytes,
                    "backward_all_gathers": rank.backward_stats.allgathers,
                }
            )
    for row in rows:
        error = row["predicted_peak_step_bytes"] / row["peak_step_bytes"] - 1
        print(
            f"{row['sharding']}/{row['bucketing']} checkpointing={row['activation_checkpointing']!s:<5} "
            f"peak {row['peak_step_bytes'] / 2**20:7.2f} MiB, predicted {row['predicted_peak_step_bytes'] / 2**20:7.2f} MiB "
            f"({error:+.2%}), backward all-gathers {row['backward_all_gathers']}"
        )
    for sharding, bucketing in SETTINGS:
        plain, checkpointed = (
            next(r for r in rows if (r["sharding"], r["bucketing"], r["activation_checkpointing"]) == (sharding, bucketing, c))
            for c in (False, True)
        )
        ratio = checkpointed["peak_step_bytes"] / plain["peak_step_bytes"]
        verdict = "PASS" if ratio <= 0.6 else "FAIL"
        print(f"{verdict} {sharding}/{bucketing}: the peak with checkpointing is {ratio:.2f}x the peak without (<= 0.6)")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"config": vars(args), "runs": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
