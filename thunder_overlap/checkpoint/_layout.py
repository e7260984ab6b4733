"""Where each parameter's rows live: Thunder's padded dim-0 shards seen as DTensors.

Thunder's FSDP pads dim 0 of every parameter to a multiple of the world size and gives rank r
rows ``[r * rows_per_rank, (r + 1) * rows_per_rank)`` of the padded tensor. Without the padding
that is exactly ``torch.chunk``'s split, which is what a DTensor with ``Shard(0)`` holds: rank r's
DTensor shard is the first ``real_rows`` rows of its padded shard (fewer on the last ranks, none
on a rank that holds only padding). So a checkpoint stores the unpadded, original shapes and any
world size can read it back.

Under hybrid sharding the DTensors live on the 2-D mesh (replicate, shard) with placements
``(Replicate(), Shard(0))``: every replica holds the same shards, which a checkpoint stores once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist
import torch.nn as nn
from thunder.core.module import ThunderModule
from thunder.distributed.transforms.fsdp_v2 import FSDPTransform
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from thunder_overlap._process_groups import real_rows as _real_rows
from thunder_overlap._transforms.replicate import ReplicaReduceTransform

__all__ = ["ParameterShard", "ModelSharding", "model_sharding", "process_group_of"]

_T = TypeVar("_T")


@dataclass(frozen=True)
class ParameterShard:
    """One parameter's original shape and the rows of it this rank holds."""

    name: str
    full_shape: tuple[int, ...]
    rows_per_rank: int
    # This rank's place in the shard group and the group's size.
    rank: int
    world_size: int
    # How its DTensor is placed on the model's mesh: (Shard(0),), or (Replicate(), Shard(0))
    # on a hybrid mesh (replicate, shard).
    placements: tuple[Placement, ...] = (Shard(0),)

    @property
    def first_row(self) -> int:
        return self.rank * self.rows_per_rank

    @property
    def real_rows(self) -> int:
        """Rows of the original parameter in this rank's shard; the rest is padding."""
        return _real_rows(self.full_shape[0], self.rows_per_rank, self.rank)

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
            list(self.placements),
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
            # Sharded as we shard (torch.chunk's rows over as many ranks on the mesh's shard
            # dim, its last): the local rows are ours.
            if tuple(value.placements) == self.placements and value.device_mesh.shape[-1] == self.world_size:
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
    """How a thunder_overlap (or Thunder) FSDP model is sharded: the group that saves and loads
    it, the mesh of its DTensors and each parameter."""

    process_group: dist.ProcessGroup
    mesh: DeviceMesh
    parameters: dict[str, ParameterShard]


def _transform(model: ThunderModule, kind: type[_T]) -> _T | None:
    return next((t for t in getattr(model, "_lc_transforms", ()) if isinstance(t, kind)), None)


def _fsdp_transform(model: ThunderModule) -> FSDPTransform | None:
    return _transform(model, FSDPTransform)


def _hybrid_mesh(model: ThunderModule) -> DeviceMesh | None:
    replicate = _transform(model, ReplicaReduceTransform)
    return None if replicate is None else replicate.device_mesh


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
    mesh = _hybrid_mesh(model)
    placements: tuple[Placement, ...] = (Shard(0),) if mesh is None else (Replicate(), Shard(0))
    parameters = {
        name: ParameterShard(name, tuple(full_shape), int(shard_shape[0]), rank, world_size, placements)
        for name, (full_shape, shard_shape, _device) in transform.sharded_params.items()
    }
    if mesh is None:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        mesh = DeviceMesh.from_group(group, device.type)
    return ModelSharding(process_group_of(model), mesh, parameters)


def process_group_of(model: nn.Module) -> dist.ProcessGroup | None:
    """The group that saves and loads ``model``: its FSDP group (the world under hybrid
    sharding), else the default group if there is one, else None (one process, no collectives)."""
    transform = _fsdp_transform(model) if isinstance(model, ThunderModule) else None
    if transform is not None:
        return dist.group.WORLD if _hybrid_mesh(model) is not None else transform.process_group
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
