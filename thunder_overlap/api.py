"""``thunder_overlap.fsdp``: a drop-in replacement for ``thunder.distributed.fsdp``."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import thunder
from thunder.core.module import ThunderModule
from thunder.core.transform_common import Transform
from thunder.distributed import FSDPBucketingStrategy, FSDPType, copy_default_process_group
from thunder.distributed.transforms.fsdp_v2 import FSDPTransform
from thunder.transforms import MaterializationTransform

from thunder_overlap.config import OverlapConfig
from thunder_overlap.transforms.executor import with_collectives_kept_visible
from thunder_overlap.transforms import BucketingTransform, OverlapScheduleTransform, RefuseNoSyncTransform, Zero3Transform

__all__ = ["fsdp", "fsdp_transforms", "parse_sharding_strategy", "parse_bucketing_strategy"]

_SHARDING_NAMES = {"zero2": FSDPType.ZERO2, "zero3": FSDPType.ZERO3}
_BUCKETING_NAMES = {
    "none": FSDPBucketingStrategy.NONE,
    "layer": FSDPBucketingStrategy.LAYER,
    "block": FSDPBucketingStrategy.BLOCK,
}
# The device type each backend communicates. "undefined" is what init_process_group() without
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


def parse_sharding_strategy(value: FSDPType | str) -> FSDPType:
    if isinstance(value, FSDPType):
        return value
    if isinstance(value, str) and value.lower() in _SHARDING_NAMES:
        return _SHARDING_NAMES[value.lower()]
    raise ValueError(
        f"sharding_strategy={value!r} is not supported; accepted: FSDPType.ZERO2, FSDPType.ZERO3, "
        f"or one of {sorted(_SHARDING_NAMES)}"
    )


def parse_bucketing_strategy(value: FSDPBucketingStrategy | str) -> FSDPBucketingStrategy:
    strategy = None
    if isinstance(value, FSDPBucketingStrategy):
        strategy = value
    elif isinstance(value, str) and value.lower() in _BUCKETING_NAMES:
        strategy = _BUCKETING_NAMES[value.lower()]
    if strategy is None:
        raise ValueError(
            f"bucketing_strategy={value!r} is not supported; accepted: FSDPBucketingStrategy.NONE/LAYER/BLOCK "
            f"or one of {sorted(_BUCKETING_NAMES)}"
        )
    return strategy


def _parse_bucket_cap_mb(value: float | None, bucketing: FSDPBucketingStrategy) -> int | None:
    """The cap in bytes; refuses a cap that would have no buckets to apply to."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"bucket_cap_mb must be a positive number of megabytes or None, got {value!r}")
    if bucketing is FSDPBucketingStrategy.NONE:
        raise ValueError(
            f"bucket_cap_mb={value!r} needs bucketing_strategy 'layer' or 'block'; with 'none' there are no buckets to cap"
        )
    return int(value * 2**20)


@dataclass(frozen=True)
class _Setup:
    device: torch.device
    process_group: dist.ProcessGroup
    sharding: FSDPType
    bucketing: FSDPBucketingStrategy
    bucket_cap_bytes: int | None
    broadcast_from: int | None
    config: OverlapConfig | None
    move_state_dict_to_cpu: bool


def _resolve(
    device,
    process_group,
    sharding_strategy,
    bucketing_strategy,
    broadcast_from,
    config,
    move_state_dict_to_cpu,
    bucket_cap_mb=None,
) -> _Setup:
    """Checks every argument of ``fsdp`` and ``FSDPOverlap`` and fills in the defaults."""
    if config is not None and not isinstance(config, OverlapConfig):
        raise TypeError(f"config must be a thunder_overlap.OverlapConfig or None, got {type(config).__name__}")
    if not isinstance(move_state_dict_to_cpu, bool):
        raise TypeError(f"move_state_dict_to_cpu must be a bool, got {move_state_dict_to_cpu!r}")
    sharding = parse_sharding_strategy(sharding_strategy)
    bucketing = parse_bucketing_strategy(bucketing_strategy)
    bucket_cap_bytes = _parse_bucket_cap_mb(bucket_cap_mb, bucketing)
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "thunder_overlap.fsdp needs an initialised process group: call "
            "torch.distributed.init_process_group(...) first (torchrun sets up the environment for it)"
        )
    if process_group is None:
        process_group = copy_default_process_group()
    elif not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"process_group must be a torch.distributed.ProcessGroup or None, got {process_group!r}")
    backend = str(dist.get_backend(process_group))
    world_size = dist.get_world_size(process_group)

    allowed = _device_types(backend)
    if device is None:
        if allowed is not None and "cuda" in allowed and torch.cuda.is_available():
            # torchrun sets LOCAL_RANK; otherwise trust the device the caller selected.
            local_rank = os.environ.get("LOCAL_RANK")
            device = torch.device("cuda", int(local_rank) if local_rank is not None else torch.cuda.current_device())
        else:
            device = torch.device("cpu")
    try:
        device = torch.device(device)
    except (TypeError, RuntimeError) as e:
        raise ValueError(f"device={device!r} is not a valid torch device") from e
    if allowed is not None and device.type not in allowed:
        raise ValueError(
            f"device={str(device)!r} does not match the process group backend {backend!r}, "
            f"which communicates {sorted(allowed)} tensors"
        )

    if broadcast_from is not None:
        if isinstance(broadcast_from, bool) or not isinstance(broadcast_from, int):
            raise TypeError(f"broadcast_from must be a rank (int) or None, got {broadcast_from!r}")
        if not 0 <= broadcast_from < world_size:
            raise ValueError(f"broadcast_from={broadcast_from} is not a rank of this process group (0..{world_size - 1})")
    return _Setup(
        device, process_group, sharding, bucketing, bucket_cap_bytes, broadcast_from, config, move_state_dict_to_cpu
    )


def fsdp_transforms(
    *,
    device: torch.device,
    process_group: dist.ProcessGroup,
    sharding_strategy: FSDPType,
    bucketing_strategy: FSDPBucketingStrategy = FSDPBucketingStrategy.NONE,
    bucket_cap_bytes: int | None = None,
    broadcast_from: int | None = None,
    config: OverlapConfig | None = None,
    move_state_dict_to_cpu: bool = False,
) -> list[Transform]:
    """The transforms ``fsdp`` applies, for ``thunder.jit(model, transforms=...)``: Thunder's
    sharding and materialisation, then ZeRO3 re-gathering (ZeRO3 only), bucketing (layer or
    block only), then scheduling."""
    transforms: list[Transform] = [
        FSDPTransform(
            device=device,
            broadcast_from=broadcast_from,
            sharding_strategy=sharding_strategy,
            release_original_parameters=True,
            move_state_dict_to_cpu=move_state_dict_to_cpu,
            process_group=process_group,
        ),
        MaterializationTransform(device, init=MaterializationTransform.init_from_original_module_init()),
    ]
    if sharding_strategy is FSDPType.ZERO3:
        transforms.append(Zero3Transform())
    if bucketing_strategy is not FSDPBucketingStrategy.NONE:
        # After ZeRO3, so that its backward re-gathers are bucketed too; after materialisation,
        # which may replace the parameters the buckets hold.
        transforms.append(BucketingTransform(bucketing_strategy.name.lower(), process_group, bucket_cap_bytes))
    else:
        transforms.append(RefuseNoSyncTransform())
    transforms.append(OverlapScheduleTransform(config))
    return transforms


def _setup_transforms(setup: _Setup) -> list[Transform]:
    return fsdp_transforms(
        device=setup.device,
        process_group=setup.process_group,
        sharding_strategy=setup.sharding,
        bucketing_strategy=setup.bucketing,
        bucket_cap_bytes=setup.bucket_cap_bytes,
        broadcast_from=setup.broadcast_from,
        config=setup.config,
        move_state_dict_to_cpu=setup.move_state_dict_to_cpu,
    )


def fsdp(
    model: nn.Module,
    *,
    device: torch.device | str | None = None,
    sharding_strategy: FSDPType | str = FSDPType.ZERO2,
    bucketing_strategy: FSDPBucketingStrategy | str = FSDPBucketingStrategy.NONE,
    process_group: dist.ProcessGroup | None = None,
    broadcast_from: int | None = None,
    config: OverlapConfig | None = None,
    move_state_dict_to_cpu: bool = False,
    bucket_cap_mb: float | None = None,
    **jit_options: Any,
) -> ThunderModule:
    """Shards ``model`` like ``thunder.distributed.fsdp`` and overlaps its communication.

    Args:
        model: a plain ``nn.Module`` (jitted here, with ``jit_options``) or what ``thunder.jit``
            returned, not yet sharded.
        device: where shards live; default ``cuda:LOCAL_RANK`` for NCCL, ``cpu`` otherwise.
        sharding_strategy: ``FSDPType.ZERO2``/``ZERO3`` or ``"zero2"``/``"zero3"``. ZeRO3 saves
            only sharded parameters for backward and re-gathers them there.
        bucketing_strategy: ``"none"`` (one collective per parameter), ``"layer"`` (one per module
            owning parameters) or ``"block"`` (one per transformer block; other parameters by
            module). Buckets live in persistent flat buffers whose views are the parameters.
        process_group: the group to shard over; default a copy of the default group.
        broadcast_from: rank whose parameters are broadcast to all before sharding.
        config: scheduler options (:class:`OverlapConfig`).
        move_state_dict_to_cpu: as in Thunder, for ``original_state_dict``.
        bucket_cap_mb: largest unsharded bucket in MiB (a larger parameter gets a bucket of its
            own); None for no cap. Needs layer or block bucketing.
        jit_options: passed to ``thunder.jit`` when ``model`` is a plain module.

    Returns:
        A ThunderModule whose ``named_parameters()`` are the local dim-0 shards (padded as Thunder
        pads them) and whose ``.grad`` are their gradients.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module or a thunder.jit module, got {type(model).__name__}")
    setup = _resolve(
        device,
        process_group,
        sharding_strategy,
        bucketing_strategy,
        broadcast_from,
        config,
        move_state_dict_to_cpu,
        bucket_cap_mb,
    )
    transforms = _setup_transforms(setup)

    if isinstance(model, ThunderModule):
        if jit_options:
            raise TypeError(
                f"options {sorted(jit_options)} are thunder.jit options; they apply only when model is a plain "
                "nn.Module, but this model was already jitted"
            )
        if getattr(thunder.compile_data(model), "use_fsdp", False) or getattr(model._model, "use_fsdp", False):
            raise ValueError("model is already sharded with FSDP; pass the unsharded model")
        from thunder.core.transforms import add_transform

        # One add_transform call with every transform: a second call would re-initialise weights.
        return add_transform(model, transform=transforms)
    user_transforms = list(jit_options.pop("transforms", None) or [])
    executors = jit_options.pop("executors", None)
    executors = with_collectives_kept_visible(thunder.get_default_executors() if executors is None else executors)
    return thunder.jit(model, transforms=[*user_transforms, *transforms], executors=executors, **jit_options)
