"""Hook: the Measuring stick simulator's prediction for a testbed run, to compare with the measurement.

The slow-link testbed calls :func:`simulator_prediction_ms` for every implementation it
measured. It looks up ``SIMULATOR_ENTRY_POINT`` and, when that exists, calls it with a
:class:`TestbedSetting`: everything the simulator needs to be calibrated to this CPU and link
(the measured compute-only and communication-only step times, the link rate) and the run it
predicts (its result JSON has the final traces' schedule). Until the entry point exists the
prediction is ``None`` and the testbed prints ``-`` for it.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, field

__all__ = ["SIMULATOR_ENTRY_POINT", "TestbedSetting", "simulator_prediction_ms"]

# "module:function" taking a TestbedSetting and returning the predicted step time in ms.
SIMULATOR_ENTRY_POINT = "fsdp_bench.prediction:predict_testbed_step_ms"


@dataclass(frozen=True)
class TestbedSetting:
    impl: str
    shard_mode: str
    model_name: str
    n_layers: int
    block_size: int
    micro_batch_size: int
    world_size: int
    # htb rate of the link in each direction.
    rate_mbit: float
    # Calibration: per-rank compute with no communication (C) and communication alone with this
    # implementation's bucketing (M).
    compute_ms: float
    comm_ms: float
    # The implementation's result JSON (one round), with its traces' schedule figures.
    result_json: str
    bucketing: str = "none"
    # M of every communication-only run, by bucketing strategy ("none" is thunder_overlap's
    # per-parameter collectives): with two or more the simulator fits a per-collective latency.
    comm_ms_by_bucketing: dict[str, float] = field(default_factory=dict)
    # C and M run at once with no dependencies (this implementation's bucketing), when measured:
    # what overlapping costs on this machine.
    concurrent_ms: float | None = None


def simulator_prediction_ms(setting: TestbedSetting) -> float | None:
    """The simulator's predicted step time for ``setting``, or None when it is not connected or
    cannot read that implementation's schedule (FSDP2)."""
    module_name, _, function_name = SIMULATOR_ENTRY_POINT.partition(":")
    if importlib.util.find_spec(module_name) is None:
        return None
    module = importlib.import_module(module_name)
    predict = getattr(module, function_name, None)
    if predict is None:
        return None
    predicted = predict(setting)  # None: the simulator has no schedule for this implementation
    return None if predicted is None else float(predicted)
