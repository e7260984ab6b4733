"""Sharding "auto" on one CUDA device (world size 1, NCCL): ZeRO3, ZeRO2, and "auto" with the
default budget (a share of the device's memory) and with a given one, on the built-in Llama-2-7B
shapes with block buckets. Per run: the choice, the backward's all-gathers, the median step and
``torch.cuda.max_memory_allocated`` over the timed steps, and the optimizer state's bytes (which
the budget does not count).

    python benchmarks/gpu_selective_unsharding.py OUT.json [--n-layer 4] [--seq-len 4096] [--budget-mib 15500]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from dataclasses import asdict

import thunder
import torch
import torch.distributed as dist
import torch.nn.functional as F

import thunder_overlap
from thunder_overlap import OverlapConfig
from thunder_overlap._transforms import BucketingTransform
from thunder_overlap._transforms.zero3 import Zero3Transform
from thunder_overlap.report._models import BUILTIN_MODELS
from thunder_overlap.report._schedule_view import schedule_stats

_MIB = 1 << 20


def run(sharding: str, budget_bytes: int | None, n_layer: int, seq_len: int, steps: int = 8, untimed: int = 3) -> dict:
    recipe = BUILTIN_MODELS["llama-2-7b"](n_layer)
    with torch.device("meta"):
        model = recipe.build().to(torch.bfloat16)
    config = OverlapConfig(memory_budget_bytes=budget_bytes) if budget_bytes is not None else None
    jm = thunder_overlap.fsdp(model, device="cuda:0", sharding_strategy=sharding, bucketing_strategy="block", config=config)
    optimizer = torch.optim.AdamW(jm.parameters(), lr=1e-5)
    generator = torch.Generator(device="cuda").manual_seed(0)
    idx = torch.randint(0, recipe.vocab_size, (1, seq_len + 1), device="cuda", generator=generator)
    times = []
    for step in range(steps):
        if step == untimed:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        logits = jm(idx[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), idx[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    layouts = BucketingTransform.of(jm).layouts
    zero3 = Zero3Transform.of(jm)
    optimizer_state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t))
    result = {
        "sharding": sharding,
        "budget_bytes": budget_bytes,
        "choice": asdict(zero3.choice) if zero3 is not None and zero3.choice is not None else None,
        "backward_allgathers": schedule_stats(thunder.last_backward_traces(jm)[-1], layouts=layouts).allgathers,
        "median_step_ms": statistics.median(times[untimed:]),
        "max_memory_allocated_bytes": torch.cuda.max_memory_allocated(),
        "optimizer_state_bytes": optimizer_state,
        "final_loss": loss.item(),
    }
    del jm, optimizer, logits, loss
    gc.collect()
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--budget-mib", type=float, default=15500)
    args = parser.parse_args()
    dist.init_process_group("nccl", rank=0, world_size=1, init_method="tcp://127.0.0.1:29511")
    torch.cuda.set_device(0)
    runs = []
    for sharding, budget in (("zero3", None), ("zero2", None), ("auto", None), ("auto", int(args.budget_mib * _MIB))):
        result = run(sharding, budget, args.n_layer, args.seq_len)
        runs.append(result)
        choice = result["choice"]
        kept = f", kept {len(choice['kept'])}/{len(choice['candidates'])} within {choice['budget_bytes'] / _MIB:.0f} MiB" if choice else ""
        print(
            f"{sharding}{kept}: {result['median_step_ms']:.1f} ms, peak {result['max_memory_allocated_bytes'] / _MIB:.0f} MiB "
            f"(optimizer state {result['optimizer_state_bytes'] / _MIB:.0f} MiB), backward all-gathers {result['backward_allgathers']}",
            flush=True,
        )
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "runs": runs}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
