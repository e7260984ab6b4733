"""The demo's predicted step times on H100s: the demo's TinyGPT traced at 8 and 64 ranks.

Each prediction traces the model on the meta device in a process that pretends to be rank 0 of
``world_size`` ranks (PyTorch's fake process group) and simulates the traces with the cost model,
as ``python -m thunder_overlap report`` does, in the report's three orders:

- thunder 0.2.6: the traces Thunder's own FSDP produces for the model (one collective per
  parameter; ZeRO3 run as ZeRO2, so no re-gather in backward);
- unscheduled: thunder_overlap's traces (the demo's buckets, ZeRO3 re-gathers) in Thunder's order;
- thunder_overlap: those traces as thunder_overlap schedules them.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PREDICTED_SCALES", "PredictedStep", "PredictionSetup", "predict_step"]

# (ranks, network): one NVLink node, and eight nodes over InfiniBand.
PREDICTED_SCALES: tuple[tuple[int, str], ...] = ((8, "nvlink"), (64, "infiniband"))
DEVICE_PROFILE = "h100"
DTYPE = "bfloat16"
# Tokens per GPU for the prediction: the demo's CPU batch (16 tokens) would leave an H100 idle
# and every collective's latency exposed. 256 sequences of the model's 32 positions (8192
# tokens) is a usual per-GPU batch for a model this small.
PREDICTED_BATCH = 256


@dataclass(frozen=True)
class PredictionSetup:
    model: object  # tiny_models.TinyGPTConfig (kept untyped here so this module imports no torch)
    sharding: str
    bucketing: str
    world_size: int
    network: str

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {self.world_size}")


@dataclass(frozen=True)
class PredictedStep:
    """Predicted forward + backward time of one step on one rank, both orders."""

    world_size: int
    network: str
    device: str
    dtype: str
    batch: int
    seq_len: int
    thunder_ms: float  # Thunder's own FSDP
    unscheduled_ms: float  # thunder_overlap's traces (buckets, ZeRO3 re-gathers) in Thunder's order
    overlap_ms: float  # the same traces as thunder_overlap schedules them
    # Estimated peak live bytes of a step (forward, then backward on what the forward kept).
    thunder_peak_bytes: int
    overlap_peak_bytes: int


def _traced_report(setup: PredictionSetup, cost_model):
    import torch

    from thunder_overlap.config import OverlapConfig
    from thunder_overlap.report._builtin_models import TinyGPT
    from thunder_overlap.report._models import trace_model
    from thunder_overlap.report._report import report

    with torch.device("meta"):
        model = TinyGPT(setup.model).to(getattr(torch, DTYPE))
    jm = trace_model(
        model,
        world_size=setup.world_size,
        sharding=setup.sharding,
        bucketing=setup.bucketing,
        idx_shape=(PREDICTED_BATCH, setup.model.block_size),
        config=OverlapConfig(cost_model=cost_model),
    )
    return report(jm, cost_model=cost_model)  # traces Thunder's own FSDP of the same model


def predict_step(setup: PredictionSetup) -> PredictedStep:
    """Traces and simulates; call where no process group is initialised (it makes a fake one)."""
    from thunder_overlap._analysis.cost_model import CostModel
    from thunder_overlap.report._report import BASELINE, OVERLAP, UNSCHEDULED

    cost_model = CostModel.named(DEVICE_PROFILE, setup.network)
    result = _traced_report(setup, cost_model)
    return PredictedStep(
        world_size=setup.world_size,
        network=setup.network,
        device=DEVICE_PROFILE,
        dtype=DTYPE,
        batch=PREDICTED_BATCH,
        seq_len=setup.model.block_size,
        thunder_ms=result.step_ms(BASELINE),
        unscheduled_ms=result.step_ms(UNSCHEDULED),
        overlap_ms=result.step_ms(OVERLAP),
        thunder_peak_bytes=max(p.baseline.peak_bytes for p in result.passes),
        overlap_peak_bytes=max(p.overlap.peak_bytes for p in result.passes),
    )
