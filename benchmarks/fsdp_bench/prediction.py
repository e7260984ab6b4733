"""The Measuring stick's simulator, calibrated to the testbed, predicting a run's step time.

Calibration uses the testbed's two measured numbers and nothing else:
- compute: the CPU cost model's per-op estimates are scaled so that the trace's compute sums to
  the measured compute-only step C (op *proportions* come from the roofline, the total from C);
- link: a ring with no latency whose bus bandwidth makes the trace's collectives, run back to
  back, take the measured communication-only step M.
The simulator then places the implementation's own schedule on the two streams; everything the
prediction says about overlap comes from that schedule.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
import thunder
import torch

from thunder_overlap.api import parse_sharding_strategy
from thunder_overlap.classify import classify_trace
from thunder_overlap.cost_model import CostModel, NetworkProfile, device_profile
from thunder_overlap.report_cli import trace_model
from thunder_overlap.simulator import simulate

from fsdp_bench.models import build_model, math_sdpa
from fsdp_bench.simulator_hook import TestbedSetting

__all__ = ["predict_testbed_step_ms"]

# A bandwidth to price collectives before calibration rescales it; its value cancels out.
_REFERENCE_BANDWIDTH = 1e9


def _thunder_traces(model, setting: TestbedSetting):
    """Thunder's own FSDP traced on meta over a fake group, like report_cli.trace_model."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=setting.world_size)
    try:
        sharding = parse_sharding_strategy(setting.shard_mode)
        jm = thunder.distributed.fsdp(thunder.jit(model), device=torch.device("meta"), sharding_strategy=sharding)
        idx = torch.zeros((setting.micro_batch_size, setting.block_size), dtype=torch.long, device="meta")
        with math_sdpa():
            thunder.compile_data(jm).get_computation_and_inputs(idx)
        return jm
    finally:
        dist.destroy_process_group()


def predict_testbed_step_ms(setting: TestbedSetting) -> float | None:
    """Predicted forward+backward step of ``setting.impl``; None for implementations whose
    schedule is not a Thunder trace (FSDP2)."""
    model, spec = build_model(setting.model_name, setting.n_layers or None, setting.block_size or None)
    block_size = setting.block_size or spec.block_size
    setting = TestbedSetting(**{**setting.__dict__, "block_size": block_size})
    if setting.impl == "thunder_overlap":
        jm = trace_model(model, world_size=setting.world_size, sharding=setting.shard_mode, bucketing=setting.bucketing, idx_shape=(setting.micro_batch_size, block_size))
    elif setting.impl == "thunder":
        jm = _thunder_traces(model, setting)
    else:
        return None
    traces = [thunder.last_traces(jm)[-1], thunder.last_backward_traces(jm)[-1]]
    annotated = [classify_trace(t) for t in traces]

    reference = CostModel(device_profile("cpu"), NetworkProfile("reference", 0.0, _REFERENCE_BANDWIDTH))
    raw = [simulate(a, list(range(len(a.nodes))), reference) for a in annotated]
    compute_scale = setting.compute_ms / sum(s.compute_ms for s in raw)
    comm_scale = setting.comm_ms / sum(s.communication_ms for s in raw)
    calibrated = CostModel(
        device_profile("cpu"),
        NetworkProfile("testbed", 0.0, _REFERENCE_BANDWIDTH / comm_scale),
        user_estimate=lambda bsym: compute_scale * reference.compute_ms(bsym),
    )
    return sum(simulate(a, list(range(len(a.nodes))), calibrated).step_ms for a in annotated)
