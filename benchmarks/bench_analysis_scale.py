"""How the analysis and scheduling passes scale with trace size, against Thunder's own tracing.

Traces Llama-2-7B-shaped models (built-in config, meta device, fake process group of 8 ranks,
ZeRO3) with 1 to 32 layers and times, per forward+backward pair of final traces: classification,
the overlap scheduler, the memory estimate and the two-stream simulation (with the
potentially-hideable analysis). Prints microseconds per bound symbol (flat when the passes are
linear) and the passes' share of Thunder's tracing time (the issue's budget: under 2% on the full
32-layer model).

    python benchmarks/bench_analysis_scale.py --layers 1 2 4 8
    python benchmarks/bench_analysis_scale.py --layers 32     # about 3 minutes of tracing
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, replace

import torch

from thunder_overlap import CostModel, OverlapConfig
from thunder_overlap._analysis.blocks import largest_block_bytes
from thunder_overlap._analysis.classify import classify_trace
from thunder_overlap._analysis.memory_estimate import estimate_memory
from thunder_overlap._analysis.simulator import simulate
from thunder_overlap._scheduling.limits import resolve_limits
from thunder_overlap._scheduling.scheduler import OverlapScheduler
from thunder_overlap.report._builtin_models import Llama, LlamaConfig
from thunder_overlap.report._models import trace_model
from thunder_overlap.report._report import unscheduled_trace

# Repeat the passes and keep the fastest run: the machine is shared, the minimum is the cost.
REPEATS = 3


@dataclass(frozen=True)
class ScaleRow:
    n_layer: int
    bound_symbols: int
    tracing_s: float
    classify_s: float
    schedule_s: float
    memory_s: float
    simulate_s: float

    @property
    def analysis_s(self) -> float:
        return self.classify_s + self.schedule_s + self.memory_s + self.simulate_s

    @property
    def us_per_bound_symbol(self) -> float:
        return self.analysis_s / self.bound_symbols * 1e6


def _best(fn) -> float:
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def measure(n_layer: int, world_size: int, seq_len: int) -> ScaleRow:
    import thunder

    with torch.device("meta"):
        model = Llama(replace(LlamaConfig(), n_layer=n_layer)).to(torch.bfloat16)
    limits = resolve_limits(OverlapConfig(), largest_block_bytes(model))
    start = time.perf_counter()
    jm = trace_model(model, world_size=world_size, sharding="zero3", bucketing="none", idx_shape=(1, seq_len))
    tracing = time.perf_counter() - start
    # The scheduler's input is the trace before its own pass; the other passes read final traces.
    histories = (thunder.last_traces(jm), thunder.last_backward_traces(jm))
    inputs = [unscheduled_trace(h) for h in histories]
    finals = [h[-1] for h in histories]
    cost_model = CostModel.named("h100", "nvlink")
    annotated_inputs = [classify_trace(t) for t in inputs]
    annotated_finals = [classify_trace(t) for t in finals]

    def memory() -> None:
        forward = estimate_memory(finals[0])
        estimate_memory(finals[1], after=forward)

    return ScaleRow(
        n_layer=n_layer,
        bound_symbols=sum(len(t.bound_symbols) for t in finals),
        tracing_s=tracing,
        classify_s=_best(lambda: [classify_trace(t) for t in finals]),
        schedule_s=_best(lambda: [OverlapScheduler(a, limits).schedule() for a in annotated_inputs]),
        memory_s=_best(memory),
        simulate_s=_best(lambda: [simulate(a, list(range(len(a.nodes))), cost_model) for a in annotated_finals]),
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=4096)
    args = parser.parse_args(argv)
    print(
        f"{'layers':>6} {'bsyms':>7} {'tracing s':>9} {'classify':>9} {'schedule':>9} {'memory':>9} {'simulate':>9} "
        f"{'us/bsym':>8} {'% tracing':>9}"
    )
    for n_layer in args.layers:
        r = measure(n_layer, args.world_size, args.seq_len)
        print(
            f"{r.n_layer:>6} {r.bound_symbols:>7} {r.tracing_s:>9.1f} {r.classify_s:>9.3f} {r.schedule_s:>9.3f} "
            f"{r.memory_s:>9.3f} {r.simulate_s:>9.3f} {r.us_per_bound_symbol:>8.1f} {r.analysis_s / r.tracing_s:>9.2%}",
            flush=True,
        )


if __name__ == "__main__":
    main()
