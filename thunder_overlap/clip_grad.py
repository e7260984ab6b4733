"""Gradient norms and clipping over shards: the whole model's norm, the same on every rank.

On a sharded model ``parameters()`` are this rank's dim-0 shards, so
``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` computes a norm of this rank's rows
alone and every rank scales by its own factor. :func:`clip_grad_norm_` counts every element of the
model's gradient once and reduces the ranks' shares over the shard group
([Note: clipping sharded gradients] in docs/design.md). Clipping by value needs no exchange (each
element is clamped alone); :func:`clip_grad_value_` only refuses gradients not yet reduced.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from numbers import Real
from types import MethodType

import torch
import torch.distributed as dist
from thunder.core.module import ThunderModule
from thunder.core.transform_common import Transform
from thunder.distributed import get_skip_data_parallel_grad_sync
from thunder.distributed.transforms.fsdp_v2 import FSDPTransform
from torch.utils._foreach_utils import _device_has_foreach_support, _has_foreach_support

from thunder_overlap._process_groups import real_rows
from thunder_overlap._transforms import BucketingTransform, OverlapScheduleTransform
from thunder_overlap._transforms._lookup import transform_of

__all__ = ["ClipGradNormMethod", "clip_grad_norm_", "clip_grad_value_", "grad_norm"]

# What torch.nn.utils.clip_grad_norm_ adds to the norm before dividing max_norm by it.
_EPS = 1e-6


@dataclass(frozen=True)
class _ShardedGradients:
    """This rank's gradient shards and what of them counts towards the model's norm."""

    # Every parameter's ``.grad`` that exists, padding included: what clipping scales.
    grads: list[torch.Tensor]
    # The real rows of each (views; none of the padding): what the norm counts.
    counted: list[torch.Tensor]
    # The group the ranks' shares are reduced over: the shard group (a replica's under HSDP,
    # whose replicas hold the same reduced gradients).
    shard_group: dist.ProcessGroup

    @property
    def norm_dtype(self) -> torch.dtype:
        """float64 where a gradient is float64, else float32, whatever the gradients' dtype."""
        return torch.float64 if any(g.dtype == torch.float64 for g in self.grads) else torch.float32


def grad_norm(model: ThunderModule, norm_type: float | str = 2.0, *, foreach: bool | None = None) -> torch.Tensor:
    """The norm of the whole model's gradient, as :func:`clip_grad_norm_` computes it, without
    clipping: for logging. Every rank must call it (one all-reduce of one scalar)."""
    norm_type = _checked_norm_type(norm_type)
    _check_foreach(foreach)
    return _total_norm(_sharded_gradients(model, "grad_norm"), norm_type, foreach)


def clip_grad_norm_(
    model: ThunderModule,
    max_norm: float,
    norm_type: float | str = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clips the gradient of a model ``thunder_overlap.fsdp`` returned by its global norm, as
    ``torch.nn.utils.clip_grad_norm_`` clips the unsharded model's.

    The norm counts each element of the model's gradient once: a shard's padding rows are left
    out, a tied parameter counts once, a parameter without ``.grad`` (frozen) not at all. Each
    rank's share (the sum of ``|g|**norm_type``, or the largest ``|g|`` for the inf-norm) is reduced
    over the shard group with one all-reduce of one scalar; under hybrid sharding only over the
    shard dimension, since the replicas hold the same gradients. It is accumulated in float32
    (float64 where the gradients are) whatever the gradients' dtype. Every shard's ``.grad`` is then
    multiplied by ``min(1, max_norm / (total_norm + 1e-6))``, with no host synchronisation.

    Every rank must call it, after the backward whose gradients it clips and before
    ``optimizer.step()``; not inside ``no_sync()``, whose gradients are not reduced yet.

    Args:
        model: what ``thunder_overlap.fsdp`` (or its transforms) returned.
        max_norm: the largest norm the gradient keeps, a number >= 0.
        norm_type: a p-norm's p (a positive number), or ``inf`` (``float("inf")`` or ``"inf"``).
        error_if_nonfinite: raise, on every rank, if the total norm is NaN or infinite (this
            reads the norm on the host: one synchronisation).
        foreach: use the foreach kernels (None: where the device has them, as torch does).

    Returns:
        The total norm of the whole model's gradient before clipping: a 0-dim tensor on the
        gradients' device, the same value on every rank.
    """
    max_norm = _checked_max_norm(max_norm)
    norm_type = _checked_norm_type(norm_type)
    _check_foreach(foreach)
    if not isinstance(error_if_nonfinite, bool):
        raise TypeError(f"error_if_nonfinite must be True or False, got {error_if_nonfinite!r}")
    sharded = _sharded_gradients(model, "clip_grad_norm_")
    total = _total_norm(sharded, norm_type, foreach)
    if error_if_nonfinite and not torch.isfinite(total).item():
        # The same total on every rank, so every rank raises here.
        raise RuntimeError(
            f"thunder_overlap.clip_grad_norm_: the total norm of order {norm_type} of the model's gradient is {total.item()}, "
            "so the gradients were left as they are; pass error_if_nonfinite=False to scale them by it anyway"
        )
    coefficient = torch.clamp(max_norm / (total + _EPS), max=1.0)
    for grads in _by_device_and_dtype(sharded.grads).values():
        device = grads[0].device
        if _use_foreach(foreach, grads, device):
            torch._foreach_mul_(grads, coefficient.to(device))
        else:
            for g in grads:
                g.mul_(coefficient.to(device))
    return total


def clip_grad_value_(model: ThunderModule, clip_value: float, *, foreach: bool | None = None) -> None:
    """Clamps every gradient element of a model ``thunder_overlap.fsdp`` returned to
    ``[-clip_value, clip_value]``, as ``torch.nn.utils.clip_grad_value_`` does the unsharded
    model's: each rank clamps its own shards. Not inside ``no_sync()``, whose gradients are not
    reduced yet (clamping a rank's share before the sum is not clamping the sum)."""
    if isinstance(clip_value, bool) or not isinstance(clip_value, Real) or not float(clip_value) >= 0:
        raise ValueError(f"clip_value must be a number >= 0, got {clip_value!r}")
    _check_foreach(foreach)
    sharded = _sharded_gradients(model, "clip_grad_value_")
    for grads in _by_device_and_dtype(sharded.grads).values():
        if _use_foreach(foreach, grads, grads[0].device):
            torch._foreach_clamp_min_(grads, -float(clip_value))
            torch._foreach_clamp_max_(grads, float(clip_value))
        else:
            for g in grads:
                g.clamp_(-float(clip_value), float(clip_value))


class ClipGradNormMethod(Transform):
    """Gives the module ``fsdp`` returns the method ``model.clip_grad_norm_(max_norm, ...)``
    (:func:`clip_grad_norm_` on it); changes no trace."""

    def transform_module(self, model: ThunderModule) -> None:
        model.clip_grad_norm_ = MethodType(clip_grad_norm_, model)


# --- the norm ------------------------------------------------------------------------------------


def _total_norm(sharded: _ShardedGradients, norm_type: float, foreach: bool | None) -> torch.Tensor:
    """Every rank's share of the norm, reduced over the shard group, as the norm."""
    dtype, device = sharded.norm_dtype, sharded.grads[0].device
    counted = [g for g in sharded.counted if g.numel()]  # a rank past the last real row has none
    norms: list[torch.Tensor] = []
    for grads in _by_device_and_dtype(counted).values():
        if _use_foreach(foreach, grads, grads[0].device):
            norms.extend(torch._foreach_norm(grads, norm_type, dtype=dtype))
        else:
            norms.extend(torch.linalg.vector_norm(g, norm_type, dtype=dtype) for g in grads)
    stacked = torch.stack([n.to(device) for n in norms]) if norms else torch.zeros(1, dtype=dtype, device=device)
    if math.isinf(norm_type):
        # A MAX reduction need not carry a NaN to every rank; infinity it does, so all ranks see
        # the same non-finite total.
        share = torch.nan_to_num(stacked.max(), nan=math.inf)
        dist.all_reduce(share, op=dist.ReduceOp.MAX, group=sharded.shard_group)
        return share
    share = stacked.pow(norm_type).sum()
    dist.all_reduce(share, op=dist.ReduceOp.SUM, group=sharded.shard_group)
    return share.pow(1.0 / norm_type)


def _by_device_and_dtype(tensors: Iterable[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return groups


def _use_foreach(foreach: bool | None, tensors: list[torch.Tensor], device: torch.device) -> bool:
    """As ``torch.nn.utils.clip_grad_norm_`` decides."""
    if foreach is None:
        return _has_foreach_support(tensors, device)
    if foreach and not _device_has_foreach_support(device):
        raise RuntimeError(f"foreach=True was passed, but there are no foreach kernels for {device.type} tensors; pass foreach=None")
    return foreach


# --- what is counted -----------------------------------------------------------------------------


def _sharded_gradients(model: ThunderModule, caller: str) -> _ShardedGradients:
    fsdp = _check_is_thunder_overlap_model(model, caller)
    if get_skip_data_parallel_grad_sync():
        raise RuntimeError(
            f"thunder_overlap.{caller} was called inside no_sync(): the gradients are not reduced across ranks yet. "
            "Call it after the backward that runs outside no_sync (the last micro-batch's), before optimizer.step()"
        )
    buckets = BucketingTransform.of(model)
    if buckets is not None and any(bucket.unsynced_grads is not None for bucket in buckets.buckets):
        raise RuntimeError(
            f"thunder_overlap.{caller}: the last backward ran under no_sync(), so its gradients are summed on each rank "
            "and not reduced yet. Run the last micro-batch's backward outside no_sync, then call it"
        )
    shard_rank = dist.get_rank(fsdp.process_group)
    grads, counted = [], []
    for name, p in model.named_parameters():  # a tied parameter once
        if p.grad is None:
            continue
        full_shape, _, _ = fsdp.sharded_params[name]  # Thunder's FSDP shards every parameter
        grads.append(p.grad)
        counted.append(p.grad.narrow(0, 0, real_rows(full_shape[0], p.shape[0], shard_rank)))
    if not grads:
        raise RuntimeError(
            f"thunder_overlap.{caller}: no parameter has a gradient; call it after loss.backward() and before "
            "optimizer.zero_grad()"
        )
    return _ShardedGradients(grads, counted, fsdp.process_group)


def _check_is_thunder_overlap_model(model: object, caller: str) -> FSDPTransform:
    """The model's FSDP transform (its shard group and shapes); a clear error for any other model."""
    whole = f"for a model whose parameters are whole, torch.nn.utils.{caller}(model.parameters(), ...) is right"
    if caller == "grad_norm":
        whole = "for a model whose parameters are whole, torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]) is right"
    if not isinstance(model, ThunderModule):
        raise TypeError(f"thunder_overlap.{caller} takes a model that thunder_overlap.fsdp returned, got a {type(model).__name__}; {whole}")
    fsdp = transform_of(model, FSDPTransform)
    if transform_of(model, OverlapScheduleTransform) is None or fsdp is None:
        how = "Thunder's own FSDP (thunder.distributed.fsdp)" if fsdp is not None else "no FSDP (thunder.jit alone)"
        raise TypeError(
            f"thunder_overlap.{caller} takes a model that thunder_overlap.fsdp returned; this ThunderModule is sharded by {how}. "
            f"Shard it with thunder_overlap.fsdp; {whole}"
        )
    return fsdp


# --- arguments -----------------------------------------------------------------------------------


def _checked_max_norm(max_norm: object) -> float:
    if isinstance(max_norm, bool) or not isinstance(max_norm, Real) or not float(max_norm) >= 0:
        raise ValueError(f"max_norm must be a number >= 0, got {max_norm!r}")
    return float(max_norm)


def _checked_norm_type(norm_type: object) -> float:
    value = None
    if not isinstance(norm_type, bool) and isinstance(norm_type, Real | str):
        try:
            value = float(norm_type)
        except ValueError:
            value = None
    if value is None or not value > 0:
        raise ValueError(f"norm_type must be a positive number (a p-norm's p) or inf (float('inf') or 'inf'), got {norm_type!r}")
    return value


def _check_foreach(foreach: object) -> None:
    if foreach is not None and not isinstance(foreach, bool):
        raise TypeError(f"foreach must be None, True or False, got {foreach!r}")
