"""The result of one benchmark run: what rank 0 prints and writes as JSON."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["BenchmarkResult", "load_results"]


@dataclass(frozen=True)
class BenchmarkResult:
    impl: str
    model_name: str
    shard_mode: str
    bucketing_mode: str
    world_size: int
    device: str
    # The parameters' dtype; mixed_precision "bf16/fp32" gathers and computes in bf16.
    dtype: str
    n_layers: int
    block_size: int
    micro_batch_size: int
    max_iters: int
    warmup_iters: int
    # Wall time of every timed iteration on rank 0 (forward, backward, optimizer, loss.item()).
    iter_times_ms: list[float]
    # Optimizer step wall time of every timed iteration (CPU: exact; CUDA: launch time only).
    optimizer_times_ms: list[float]
    # Forward + backward FLOPs of one rank's micro-batch (0 for comm_only).
    model_flops_per_rank_step: int
    peak_memory_bytes: int
    peak_memory_method: str
    final_loss: float
    # Per trace ("forward", "backward") schedule figures of the Thunder impls; empty otherwise.
    schedule: dict[str, dict]
    # Bytes of each bucket pool buffer (held for the module's life, so a bucketed peak pays them
    # above an unbucketed one): as the steps grew it, and as planned from the final traces.
    # Empty without buckets.
    bucket_pool_bytes: list[int]
    bucket_pool_plan_bytes: list[int]
    # --mixed_precision ("bf16/fp32"), or None.
    mixed_precision: str | None = None
    # --max_norm: each step clipped the gradient to this global norm; None: no clipping.
    max_norm: float | None = None
    # --activation_checkpointing: every block recomputed its activations in the backward.
    activation_checkpointing: bool = False
    # --executors: Thunder's executors ("default" or "torchcompile").
    executors: str = "default"

    @property
    def median_iter_time_ms(self) -> float:
        return statistics.median(self.iter_times_ms)

    @property
    def average_iter_time_ms(self) -> float:
        return statistics.fmean(self.iter_times_ms)

    @property
    def tokens_per_sec(self) -> float:
        tokens = self.world_size * self.micro_batch_size * self.block_size
        return tokens / (self.average_iter_time_ms / 1e3)

    @property
    def model_tflop_per_sec(self) -> float:
        """All ranks together, as Thunder's benchmark reports it."""
        return self.world_size * self.model_flops_per_rank_step / (self.average_iter_time_ms / 1e3) / 1e12

    def to_json(self) -> dict:
        derived = {
            "average_iter_time_ms": self.average_iter_time_ms,
            "median_iter_time_ms": self.median_iter_time_ms,
            "tokens_per_sec": self.tokens_per_sec,
            "tokens_per_sec_per_rank": self.tokens_per_sec / self.world_size,
            "model_tflop_per_sec": self.model_tflop_per_sec,
            "peak_memory_gb": self.peak_memory_bytes / 1e9,
        }
        return {**asdict(self), **derived}

    def summary(self) -> str:
        return "\n".join(
            [
                f"Implementation: {self.impl} ({self.shard_mode}, bucketing {self.bucketing_mode})",
                f"Model: {self.model_name}, {self.n_layers} layers, seq {self.block_size}, micro batch {self.micro_batch_size}",
                f"World size: {self.world_size} x {self.device} ({self.dtype})",
                f"Average iter time: {self.average_iter_time_ms:.2f} ms (median {self.median_iter_time_ms:.2f} ms)",
                f"Tokens/s: {self.tokens_per_sec:.1f} ({self.tokens_per_sec / self.world_size:.1f} per rank)",
                f"TFLOP/s: {self.model_tflop_per_sec:.4f}",
                f"Peak memory per rank: {self.peak_memory_bytes / 2**20:.2f} MiB ({self.peak_memory_method})",
            ]
            + self._pool_lines()
        )

    def _pool_lines(self) -> list[str]:
        if not self.bucket_pool_bytes:
            return []
        mib = ", ".join(f"{b / 2**20:.2f}" for b in self.bucket_pool_bytes)
        return [f"Bucket pool: {len(self.bucket_pool_bytes)} buffers ({mib} MiB; planned {len(self.bucket_pool_plan_bytes)})"]

    def write(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2))


def load_results(paths: list[Path]) -> list[dict]:
    """Result JSONs as dicts, with an error naming any file that is not one."""
    results = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        if "impl" not in data or "iter_times_ms" not in data:
            raise ValueError(f"{path} is not a benchmark result JSON (no 'impl'/'iter_times_ms')")
        results.append(data)
    return results
