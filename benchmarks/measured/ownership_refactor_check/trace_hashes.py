"""Hashes of the final forward and backward execution traces (their source, comments left out:
those name file paths) of TinyGPT with 3 blocks on the fake process group (4 ranks), for each
sharding and bucketing, checkpointing and bf16/fp32 mixed precision. Run before and after a
refactor: equal hashes mean the step runs the same program.

    python benchmarks/measured/ownership_refactor_check/trace_hashes.py OUT.json
"""

from __future__ import annotations

import hashlib
import json
import sys
import warnings

import thunder
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import thunder_overlap
from thunder_overlap import MixedPrecision, OverlapConfig
from thunder_overlap.report._builtin_models import TinyGPT, TinyGPTConfig

MODEL = TinyGPTConfig(n_layer=3, n_embd=32)
# Sharding "auto"'s budget by bucketing: room for some blocks without buckets, for all with them.
AUTO_BUDGET_BYTES = {"none": 330_000, "block": 600_000, "auto": 600_000}


def _configs() -> list[dict]:
    configs = [dict(sharding_strategy=s, bucketing_strategy=b) for s in ("zero2", "zero3", "auto") for b in ("none", "block", "auto")]
    configs.append(dict(sharding_strategy="zero3", bucketing_strategy="block", activation_checkpointing=True))
    configs.append(dict(sharding_strategy="zero3", mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)))
    return configs


def _digest(trace) -> str:
    source = "\n".join(line for line in str(trace).splitlines() if not line.strip().startswith("#"))
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def main(out: str) -> None:
    warnings.filterwarnings("ignore")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    hashes = {}
    for config in _configs():
        options = dict(config)
        if options["sharding_strategy"] == "auto":
            options["config"] = OverlapConfig(memory_budget_bytes=AUTO_BUDGET_BYTES[options["bucketing_strategy"]])
        torch.manual_seed(0)
        jm = thunder_overlap.fsdp(TinyGPT(MODEL), device="cpu", **options)
        jm(torch.randint(0, 64, (2, 8))).sum().backward()
        key = ",".join(f"{k}={v}" for k, v in sorted(config.items()) if k != "mixed_precision")
        key += ",bf16" if "mixed_precision" in config else ""
        hashes[key] = {"forward": _digest(thunder.last_traces(jm)[-1]), "backward": _digest(thunder.last_backward_traces(jm)[-1])}
        print(key, hashes[key], flush=True)
    with open(out, "w") as f:
        json.dump(hashes, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
