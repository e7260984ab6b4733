"""Process-group setup from the environment torchrun (or the slow-link testbed) provides."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["RunContext", "init_distributed"]

# Parameter dtype per device type: bf16 on GPUs, as Thunder's benchmark_litgpt.py; float32 on
# CPU, where bf16 matmuls are slow on most cores and would distort the compute/communication ratio.
_DTYPES = {"cuda": torch.bfloat16, "cpu": torch.float32}
_BACKENDS = {"cuda": "nccl", "cpu": "gloo"}
_LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class RunContext:
    rank: int
    world_size: int
    device: torch.device
    dtype: torch.dtype

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


def init_distributed(device_choice: str) -> RunContext:
    """Initialises the default process group (NCCL on CUDA, gloo on CPU) from the environment."""
    missing = [k for k in _LAUNCH_ENV if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"environment variables {missing} are not set: launch with "
            "`torchrun --nproc_per_node=N benchmarks/benchmark_fsdp.py ...`"
        )
    device_type = device_choice
    if device_choice == "auto":
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device=cuda but no GPU is visible; use --device cpu (gloo)")
    device = torch.device("cpu")
    if device_type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group(_BACKENDS[device_type])
    return RunContext(dist.get_rank(), dist.get_world_size(), device, _DTYPES[device_type])
