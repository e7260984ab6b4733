"""The Foundation figures: 8-block TinyGPT, 2 gloo ranks, thunder_overlap vs Thunder's FSDP.

    python benchmarks/foundation_figures.py [--n-layer 8]

Prints, for ZeRO2 and ZeRO3, each implementation's overlap fractions and in-flight bytes (read
from the final traces) and the measured peak live tensor memory of one step, then the targets:
forward all-gathers overlapped >= 0.9, ZeRO3 all-gather bytes in flight <= 3 x the largest block,
reduce-scatters overlapped >= 0.8, ZeRO3 peak memory <= 0.6 x Thunder's FSDP.
"""

from __future__ import annotations

import argparse

from thunder_overlap._analysis.blocks import largest_block_bytes
from thunder_overlap.report._builtin_models import TinyGPT, TinyGPTConfig
from thunder_overlap.testing.local_ranks import run_local_ranks
from thunder_overlap.testing.training import TrainSetup, train_rank


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-layer", type=int, default=8)
    args = parser.parse_args()
    # The demo's shape: parameters dominate memory, as for FSDP at small micro-batches.
    model = TinyGPTConfig(n_layer=args.n_layer, n_embd=128)
    block_bytes = largest_block_bytes(TinyGPT(model))

    results = {}
    for sharding in ("zero2", "zero3"):
        for impl in ("thunder", "thunder_overlap"):
            setup = TrainSetup(impl=impl, sharding=sharding, model=model, micro_batch=1, seq_len=16, steps=2)
            results[impl, sharding] = run_local_ranks(train_rank, 2, (setup,))[0]
            print(f"ran {impl} {sharding}", flush=True)

    print(f"\nTinyGPT {args.n_layer} blocks, largest block {block_bytes} bytes unsharded, 2 gloo ranks")
    header = f"{'impl':<16}{'shard':<7}{'fwd AG ovl':>11}{'bwd AG':>8}{'RS ovl':>8}{'AG bytes in flight (xblock)':>30}{'peak MiB':>10}"
    print(header)
    for (impl, sharding), r in results.items():
        in_flight = max(r.forward_stats.peak_allgather_bytes_in_flight, r.backward_stats.peak_allgather_bytes_in_flight)
        print(
            f"{impl:<16}{sharding:<7}{r.forward_stats.allgather_overlap_fraction:>11.2f}"
            f"{r.backward_stats.allgathers:>8}{r.backward_stats.reduce_scatter_overlap_fraction:>8.2f}"
            f"{in_flight:>20} ({in_flight / block_bytes:4.1f}x)"
            f"{r.peak_step_bytes / 2**20:>10.2f}"
        )

    ours = results["thunder_overlap", "zero3"]
    base = results["thunder", "zero3"]
    in_flight = max(ours.forward_stats.peak_allgather_bytes_in_flight, ours.backward_stats.peak_allgather_bytes_in_flight)
    allgathers_overlapped = ours.forward_stats.allgather_overlap_fraction
    reduce_scatters_overlapped = ours.backward_stats.reduce_scatter_overlap_fraction
    peak_ratio = ours.peak_step_bytes / base.peak_step_bytes
    checks = [
        ("forward all-gathers overlapped (zero3)", allgathers_overlapped, ">= 0.9", allgathers_overlapped >= 0.9),
        ("all-gather bytes in flight / largest block (zero3)", in_flight / block_bytes, "<= 3", in_flight <= 3 * block_bytes),
        ("reduce-scatters overlapped (zero3)", reduce_scatters_overlapped, ">= 0.8", reduce_scatters_overlapped >= 0.8),
        ("peak memory zero3 / Thunder's FSDP zero3", peak_ratio, "<= 0.6", peak_ratio <= 0.6),
    ]
    print("\nfigure                                              value   target")
    for name, value, target, ok in checks:
        print(f"{name:<50}{value:>8.3f}   {target:<8}{'ok' if ok else 'MISSED'}")


if __name__ == "__main__":
    main()
