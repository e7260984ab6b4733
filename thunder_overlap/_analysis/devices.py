"""Devices: the peak rates of one accelerator that the cost model's roofline reads.

Kept apart from ``cost_model`` (which imports torch and Thunder) so that the report's command line
can check ``--device-profile`` and list the profiles in ``--help`` without importing them.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEVICE_PROFILES", "FALLBACK_GPU_PROFILE", "DeviceProfile", "device_profile", "gpu_profile_of"]


@dataclass(frozen=True)
class DeviceProfile:
    """Peak rates of one accelerator and how much of them real kernels reach."""

    name: str
    # Dense matmul peak, FLOP/s, for 16-bit floats and for 32-bit floats.
    matmul_flops_16bit: float
    matmul_flops_32bit: float
    # Memory bandwidth, bytes/s.
    memory_bandwidth: float
    # Large, well-shaped kernels reach about 70% of peak FLOPs and 80% of peak bandwidth
    # (cuBLAS GEMMs in the 700 TFLOP/s range on an H100 SXM, elementwise kernels ~2.6 TB/s).
    flops_efficiency: float = 0.7
    bandwidth_efficiency: float = 0.8
    # Fixed cost of each kernel or host op: CUDA launch plus framework dispatch.
    launch_overhead_s: float = 5e-6


# Datasheet peaks (dense, no sparsity): NVIDIA H100 SXM5 (989 TFLOP/s BF16, 67 FP32, 3.35 TB/s
# HBM3), H200 SXM (same compute, 4.8 TB/s HBM3e), A100 SXM 80GB (312 BF16, 19.5 FP32, 2.04 TB/s).
# The CPU profile is a small x86 machine (two AVX2 cores at ~50 GFLOP/s each, ~10 GB/s per core
# of memory bandwidth, ~20 us of Python dispatch per op): a rough guess, calibrate for truth.
DEVICE_PROFILES: dict[str, DeviceProfile] = {
    "h100": DeviceProfile("h100", 989e12, 67e12, 3.35e12),
    "h200": DeviceProfile("h200", 989e12, 67e12, 4.8e12),
    "a100": DeviceProfile("a100", 312e12, 19.5e12, 2.04e12),
    "cpu": DeviceProfile("cpu", 100e9, 100e9, 20e9, flops_efficiency=0.5, bandwidth_efficiency=0.5, launch_overhead_s=20e-6),
}


# A GPU whose name matches no profile is simulated as this one: the GPU of the 8-GPU nodes the
# other defaults describe (network.DEFAULT_GPUS_PER_NODE).
FALLBACK_GPU_PROFILE = "h100"


def gpu_profile_of(device_name: str) -> str | None:
    """The profile of a GPU named ``device_name`` (``torch.cuda.get_device_name``), or None where
    its name matches none. The one place GPUs are told apart, for the scheduler and the report."""
    lowered = device_name.lower()
    return next((p for p in ("h200", "h100", "a100") if p in lowered), None)


def device_profile(name: str | DeviceProfile) -> DeviceProfile:
    if isinstance(name, DeviceProfile):
        return name
    if name not in DEVICE_PROFILES:
        raise ValueError(f"unknown device profile {name!r}; accepted: {sorted(DEVICE_PROFILES)} or a DeviceProfile")
    return DEVICE_PROFILES[name]
