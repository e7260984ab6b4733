"""Side-by-side PNG of benchmark result JSONs: step time and peak memory per implementation.

    python benchmarks/plot_results.py results/slow_link/runs/*.json --out results/slow_link.png

Runs with the same implementation and shard mode (the testbed's rounds) form one bar: the median
of their median step times, with the range over runs as the error bar. Calibration runs
(compute_only, comm_only) are drawn hatched. Needs matplotlib (the "bench" extra).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from fsdp_bench.bench_config import CALIBRATION_IMPLS
from fsdp_bench.results import load_results

# Bars per row of the figure stay readable up to about a dozen labels at this width.
_FIGURE_SIZE = (12, 4.5)
_DPI = 150


# Results drawn in one figure must agree on these, or the bars would not be comparable.
_SHARED_FIELDS = ("model_name", "n_layers", "block_size", "micro_batch_size", "world_size", "device", "dtype")


def _check_comparable(results: list[dict]) -> None:
    for field in _SHARED_FIELDS:
        values = sorted({str(r[field]) for r in results})
        if len(values) > 1:
            raise SystemExit(f"results differ in {field} ({', '.join(values)}); plot comparable runs together")


def _group(results: list[dict]) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in results:
        groups[f"{r['impl']}\n{r['shard_mode']}"].append(r)
    return dict(groups)


def plot(results: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    _check_comparable(results)
    groups = _group(results)
    labels = list(groups)
    medians = [[statistics.median(r["iter_times_ms"]) for r in groups[k]] for k in labels]
    step = [statistics.median(m) for m in medians]
    errors = [[s - min(m) for s, m in zip(step, medians, strict=True)], [max(m) - s for s, m in zip(step, medians, strict=True)]]
    memory_mib = [max(r["peak_memory_bytes"] for r in groups[k]) / 2**20 for k in labels]
    hatches = ["//" if groups[k][0]["impl"] in CALIBRATION_IMPLS else "" for k in labels]

    first = results[0]
    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=_FIGURE_SIZE)
    fig.suptitle(
        f"{first['model_name']}, {first['world_size']} x {first['device']}, micro batch {first['micro_batch_size']}, "
        f"seq {first['block_size']}"
    )
    ax_time.bar(labels, step, yerr=errors, capsize=4, hatch=hatches, color="tab:blue", edgecolor="black")
    ax_time.set_ylabel("step time (ms, median)")
    ax_mem.bar(labels, memory_mib, hatch=hatches, color="tab:orange", edgecolor="black")
    ax_mem.set_ylabel("peak memory per rank (MiB)")
    ax_mem.set_title(first["peak_memory_method"], fontsize=8)
    for ax in (ax_time, ax_mem):
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=_DPI)
    print(f"wrote {out}")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", type=Path, help="result JSONs of benchmark_fsdp.py")
    parser.add_argument("--out", type=Path, default=Path("benchmark_comparison.png"))
    args = parser.parse_args(argv)
    plot(load_results(args.results), args.out)


if __name__ == "__main__":
    main(sys.argv[1:])
