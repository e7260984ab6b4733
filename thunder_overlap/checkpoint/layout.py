"""Where each parameter's rows live: Thunder's padded dim-0 shards seen as DTensors.

Thunder's FSDP pads dim 0 of every parameter to a multiple of the world size and gives rank r
rows ``[r * rows_per_rank, (r + 1) * rows_per_rank)`` of the padded tensor. Without the padding
that is exactly ``torch.chunk``'s split, which is what a DTensor with ``Shard(0)`` holds: rank r's
DTensor shard is the first ``real_rows`` rows of its padded shard (fewer on the last ranks, none
on a rank that holds only padding). So a checkpoint stores the unpadded, original shapes and any
world size can read it back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from thunder.core.module import ThunderModule
from thunder.distributed.transforms.fsdp_v2 import FSDPTransform
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

__all__ = ["ParameterShard", "ModelSharding", "model_sharding", "process_group_of"]


@dataclass(frozen=True)
class ParameterShard:
    """One parameter's original shape and the rows of it this rank holds."""

    name: str
    full_shape: tuple[int, ...]
    rows_per_rank: int
    rank: int
    world_size: int

    @property
    def first_row(self) -> int:
        return self.rank * self.rows_per_rank

    @property
    def real_rows(self) -> int:
        """Rows of the original parameter in this rank's shard; the rest is padding."""
        return max(0, min(self.rows_per_rank, self.full_shape[0] - self.first_row))

    @property
    def padded_shape(self) -> tuple[int, ...]:
        return (self.rows_per_rank, *self.full_shape[1:])

    def as_dtensor(self, padded: torch.Tensor, mesh: DeviceMesh) -> DTensor:
        """``padded`` (this rank's shard, or a tensor shaped like it) as a DTensor of the
        original shape; its local tensor is a view of ``padded``, not a copy."""
        self.check_padded(padded)
        local = padded.narrow(0, 0, self.real_rows)
        return DTensor.from_local(
            local,
            mesh,
            [Shard(0)],
            run_check=False,
            shape=torch.Size(self.full_shape),
            stride=torch.empty(self.full_shape, device="meta").stride(),
        )

    def rows_of(self, value: torch.Tensor) -> torch.Tensor:
        """This rank's rows of ``value``: a DTensor of the original shape (any placement) or a
        full tensor."""
        if tuple(value.shape) != self.full_shape:
            raise ValueError(f"{self.name}: the state dict has shape {tuple(value.shape)}, the model's parameter has {self.full_shape}")
        if isinstance(value, DTensor):
            # Sharded as we shard (torch.chunk's rows over as many ranks): the local rows are ours.
            if tuple(value.placements) == (Shard(0),) and value.device_mesh.size() == self.world_size:
                return value.to_local()
            value = value.full_tensor()
        return value.narrow(0, self.first_row, self.real_rows)

    def padded(self, value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """``value``'s rows for this rank in a new tensor shaped, typed and placed like ``like``
        (the live shard), with zero padding."""
        out = torch.zeros_like(like)
        out.narrow(0, 0, self.real_rows).copy_(self.rows_of(value))
        return out

    def check_padded(self, tensor: torch.Tensor) -> None:
        if tuple(tensor.shape) != self.padded_shape:
            raise ValueError(f"{self.name}: expected this rank's padded shard of shape {self.padded_shape}, got {tuple(tensor.shape)}")


@dataclass(frozen=True)
class ModelSharding:
    """How a thunder_overlap (or Thunder) FSDP model is sharded: its group and each parameter."""

    process_group: dist.ProcessGroup
    mesh: DeviceMesh
    parameters: dict[str, ParameterShard]


def _fsdp_transform(model: ThunderModule) -> FSDPTransform | None:
    transforms = [t for t in getattr(model, "_lc_transforms", ()) if isinstance(t, FSDPTransform)]
    return transforms[0] if transforms else None


def model_sharding(model: nn.Module) -> ModelSharding | None:
    """The sharding of an FSDP ``ThunderModule``; None for a module whose parameters are whole
    (a plain ``nn.Module``, or a ThunderModule without FSDP)."""
    if not isinstance(model, ThunderModule):
        return None
    transform = _fsdp_transform(model)
    if transform is None:
        return None
    group = transform.process_group
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    parameters = {
        name: ParameterShard(name, tuple(full_shape), int(shard_shape[0]), rank, world_size)
        for name, (full_shape, shard_shape, _device) in transform.sharded_params.items()
    }
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    mesh = DeviceMesh.from_group(group, device.type)
    return ModelSharding(group, mesh, parameters)


def process_group_of(model: nn.Module) -> dist.ProcessGroup | None:
    """The group that saves and loads ``model``: its FSDP group, else the default group if there
    is one, else None (one process, no collectives)."""
    transform = _fsdp_transform(model) if isinstance(model, ThunderModule) else None
    if transform is not None:
        return transform.process_group
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
