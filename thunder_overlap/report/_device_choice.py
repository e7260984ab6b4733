"""Which device profile and network a report simulates with, and why.

``report(model)`` without a cost model describes the hardware the model actually ran on: the
device of its parameters and the backend and size of the process group its collectives use.
Explicit ``device_profile`` / ``network`` arguments win over what is read from the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from thunder_overlap._analysis.classify import AnnotatedTrace
from thunder_overlap._analysis.cost_model import CostModel
from thunder_overlap._analysis.devices import FALLBACK_GPU_PROFILE, gpu_profile_of
from thunder_overlap._analysis.network import default_network, gpus_per_node

__all__ = ["ProfileChoice", "choose_profile"]


@dataclass(frozen=True)
class ProfileChoice:
    device_profile: str
    network: str
    # Why these two, in words for the printed report.
    reason: str

    def cost_model(self) -> CostModel:
        return CostModel.named(self.device_profile, self.network)


def _parameter_device(model: torch.nn.Module) -> torch.device | None:
    return next((p.device for p in model.parameters()), None)


def _group_of(annotated: list[AnnotatedTrace]):
    return next((a.process_group for a in annotated if a.process_group is not None), None)


def _backend(group) -> str:
    try:
        return dist.get_backend(group)
    except (ValueError, RuntimeError):  # the group was destroyed after tracing
        return "unknown"


def _gpu_profile(device: torch.device) -> tuple[str, str]:
    name = torch.cuda.get_device_name(device) if torch.cuda.is_available() else "an unknown GPU"
    profile = gpu_profile_of(name)
    if profile is None:
        return FALLBACK_GPU_PROFILE, f"{name} has no profile of its own, so {FALLBACK_GPU_PROFILE} is assumed"
    return profile, f"the model's parameters are on {name}"


def _device_profile(device: torch.device | None) -> tuple[str, str]:
    """(profile name, why) for the device of the model's parameters."""
    if device is not None and device.type == "cuda":
        return _gpu_profile(device)
    if device is not None and device.type == "cpu":
        return "cpu", "the model's parameters are on cpu"
    where = device.type if device is not None else "no device"
    return FALLBACK_GPU_PROFILE, f"the model's parameters are on {where}, which has no profile, so {FALLBACK_GPU_PROFILE} is assumed"


def _network(backend: str, size: int, device_profile: str) -> tuple[str, str]:
    """(network name, why) for a process group of ``backend`` and ``size`` ranks. A backend that
    names no link (fake, none) is taken as gloo on a cpu and as NCCL on a GPU profile."""
    if backend == "gloo" or (backend != "nccl" and device_profile == "cpu"):
        return "gloo-loopback", f"its process group is {backend}"
    per_node = gpus_per_node()
    network = default_network(size, per_node)
    where = f"fits in one node of {per_node} GPUs" if network == "nvlink" else f"spans nodes of {per_node} GPUs"
    return network, f"its process group is {backend} with {size} ranks, which {where}"


def choose_profile(
    model: torch.nn.Module, annotated: list[AnnotatedTrace], *, device_profile: str | None = None, network: str | None = None
) -> ProfileChoice:
    """The profiles of ``model``'s device and of the process group of its traces' collectives;
    ``device_profile`` and ``network`` win when given."""
    if device_profile is None:
        device_profile, device_why = _device_profile(_parameter_device(model))
    else:
        device_why = f"device profile {device_profile} as given"
    if network is None:
        group = _group_of(annotated)
        backend = _backend(group) if group is not None else "none"
        network, network_why = _network(backend, group.size() if group is not None else 1, device_profile)
    else:
        network_why = f"network {network} as given"
    return ProfileChoice(device_profile, network, f"{device_why} and {network_why}")
