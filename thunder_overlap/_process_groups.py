"""Where shards live and which groups they talk over: the device, the process group and the
hybrid-sharding mesh of :class:`~thunder_overlap.options.FSDPOptions`, checked against each other."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: the command line's help reads options.py without torch
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["real_rows", "resolve_device", "resolve_groups"]


# The device types each backend communicates. "undefined" is what init_process_group() without
# a backend reports: it then creates gloo for CPU and NCCL for CUDA tensors.
_BACKEND_DEVICE_TYPES = {"gloo": {"cpu"}, "nccl": {"cuda"}, "undefined": {"cpu", "cuda"}}


def _device_types(backend: str) -> set[str] | None:
    """Device types a backend string such as "gloo" or "cpu:gloo,cuda:nccl" serves; None when
    unknown (e.g. "fake" for tracing), in which case any device is accepted."""
    types: set[str] = set()
    for part in backend.split(","):
        if ":" in part:
            types.add(part.split(":", 1)[0])
        elif part in _BACKEND_DEVICE_TYPES:
            types |= _BACKEND_DEVICE_TYPES[part]
        else:
            return None
    return types


def _cuda_index() -> int:
    """This process's GPU: LOCAL_RANK (torchrun sets it), else the device the caller selected."""
    import torch

    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank is None:
        return torch.cuda.current_device()
    index = int(local_rank)
    if not 0 <= index < torch.cuda.device_count():
        raise ValueError(
            f"LOCAL_RANK={index} names no visible CUDA device ({torch.cuda.device_count()} visible); "
            "pass device= explicitly"
        )
    return index


def resolve_device(device: torch.device | str | None, process_group: dist.ProcessGroup) -> torch.device:
    import torch
    import torch.distributed as dist

    backend = str(dist.get_backend(process_group))
    allowed = _device_types(backend)
    if device is None:
        uses_cuda = allowed is not None and "cuda" in allowed and torch.cuda.is_available()
        device = torch.device("cuda", _cuda_index()) if uses_cuda else torch.device("cpu")
    try:
        device = torch.device(device)
    except (TypeError, RuntimeError) as e:
        raise ValueError(f"device={device!r} is not a valid torch device") from e
    if allowed is not None and device.type not in allowed:
        raise ValueError(
            f"device={str(device)!r} does not match the process group backend {backend!r}, "
            f"which communicates {sorted(allowed)} tensors"
        )
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", _cuda_index())
        # NCCL and the object collectives (rank agreement, cost-model broadcast) run on the
        # current device; left at cuda:0, every rank would use the first GPU.
        torch.cuda.set_device(device)
    return device


def real_rows(full_rows: int, rows_per_rank: int, shard_rank: int) -> int:
    """Rows of a parameter of ``full_rows`` rows in ``shard_rank``'s dim-0 shard of ``rows_per_rank``
    rows. Thunder's FSDP pads dim 0 to a multiple of the shard group's size: the shard's other rows
    are padding (all of them on a rank past the last real row)."""
    return max(0, min(rows_per_rank, full_rows - shard_rank * rows_per_rank))


def resolve_groups(
    process_group: dist.ProcessGroup | None, device_mesh: DeviceMesh | None, broadcast_from: int | None
) -> tuple[dist.ProcessGroup, DeviceMesh | None]:
    """(the group to shard over, the 2-D mesh of hybrid sharding or None), from ``process_group``
    or ``device_mesh`` (not both; neither: a copy of the default group), with ``broadcast_from``
    checked against them."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "thunder_overlap.fsdp needs an initialised process group: call "
            "torch.distributed.init_process_group(...) first (torchrun sets up the environment for it)"
        )
    hybrid_mesh = None
    if device_mesh is not None:
        if process_group is not None:
            raise ValueError(
                "pass either device_mesh or process_group, not both: a 1-D mesh is the group to shard over, "
                "a 2-D mesh (replicate, shard) is hybrid sharding"
            )
        process_group, hybrid_mesh = _groups_of_mesh(device_mesh)
        if broadcast_from is not None and hybrid_mesh is not None:
            raise ValueError(
                f"broadcast_from={broadcast_from!r} is not supported with a 2-D device_mesh (hybrid sharding): "
                "give every rank the same initial parameters (the same seed) and pass broadcast_from=None"
            )
    elif process_group is None:
        process_group = _copy_default_group()
    elif not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"process_group must be a torch.distributed.ProcessGroup or None, got {process_group!r}")
    if broadcast_from is not None:
        if isinstance(broadcast_from, bool) or not isinstance(broadcast_from, int):
            raise TypeError(f"broadcast_from must be a rank (int) or None, got {broadcast_from!r}")
        world_size = dist.get_world_size(process_group)
        if not 0 <= broadcast_from < world_size:
            raise ValueError(f"broadcast_from={broadcast_from} is not a rank of this process group (0..{world_size - 1})")
    return process_group, hybrid_mesh


def _copy_default_group() -> dist.ProcessGroup:
    from thunder.distributed import copy_default_process_group

    from thunder_overlap._console import filter_known_output

    # gloo's native code prints "[Gloo] Rank ... connected ..." for every group it creates; only
    # that exact message is dropped from the copy's output.
    with filter_known_output():
        return copy_default_process_group()


def _groups_of_mesh(device_mesh: object) -> tuple[dist.ProcessGroup, DeviceMesh | None]:
    """(shard group, the mesh if it is hybrid): a 1-D mesh is the shard group, a 2-D mesh has
    dims (replicate, shard), FSDP2's order; the mesh must hold every rank of the world."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"device_mesh must be a torch.distributed.device_mesh.DeviceMesh or None, got {device_mesh!r}")
    if device_mesh.ndim not in (1, 2):
        raise ValueError(
            f"device_mesh must have 1 dim (shard) or 2 dims (replicate, shard), got {device_mesh.ndim} dims "
            f"of sizes {tuple(device_mesh.shape)}"
        )
    world_size = dist.get_world_size()
    if device_mesh.size() != world_size:
        raise ValueError(
            f"device_mesh of shape {tuple(device_mesh.shape)} holds {device_mesh.size()} ranks, but the world has "
            f"{world_size}: the mesh must cover every rank"
        )
    if device_mesh.ndim == 1:
        return device_mesh.get_group(0), None
    return device_mesh.get_group(1), device_mesh
