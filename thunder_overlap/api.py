"""``thunder_overlap.fsdp``: a drop-in replacement for ``thunder.distributed.fsdp``."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import thunder
import torch
import torch.distributed as dist
import torch.nn as nn
from thunder.core.module import ThunderModule
from thunder.core.transform_common import Transform
from thunder.distributed import FSDPBucketingStrategy, FSDPType
from thunder.distributed.transforms.fsdp_v2 import FSDPTransform
from thunder.transforms import MaterializationTransform
from torch.distributed.device_mesh import DeviceMesh

from thunder_overlap._ops import with_collectives_kept_visible
from thunder_overlap._transforms import (
    ActivationCheckpointingTransform,
    BucketingTransform,
    MixedPrecisionTransform,
    OverlapScheduleTransform,
    RefuseDifferentInitTransform,
    RefuseNoSyncTransform,
    RefuseRequiresGradChangeTransform,
    RefuseUnshardableTransform,
    ReplicaReduceTransform,
    ShardsInPlaceTransform,
    Zero3Transform,
)
from thunder_overlap._transforms._model_state import ModelState
from thunder_overlap._transforms.activation_checkpointing import explain_reentrant_checkpoints, refuse_reentrant_checkpoints
from thunder_overlap._transforms.shardable import check_shardable
from thunder_overlap.clip_grad import ClipGradNormMethod
from thunder_overlap.config import OverlapConfig
from thunder_overlap.options import (
    BucketingStrategy,
    FSDPOptions,
    MixedPrecision,
    ShardingStrategy,
    options_from,
    unknown_keywords_message,
)

__all__ = ["fsdp", "fsdp_transforms"]


def fsdp_transforms(options: FSDPOptions | None = None, /, **option_kwargs: Any) -> list[Transform]:
    """The transforms ``fsdp`` applies, for ``thunder.jit(model, transforms=...)``: the refusal
    of a model FSDP cannot shard (or already sharded), of ranks whose initial weights differ
    (without ``broadcast_from``) and of ``requires_grad`` changed after sharding; every block's
    activation checkpointing (``activation_checkpointing`` only); Thunder's sharding, mixed
    precision's casts (a ``mixed_precision`` that sets a dtype only),
    materialisation, then ZeRO3 re-gathering (ZeRO3 only), bucketing (layer, block or auto only),
    the all-reduce across replicas (hybrid sharding only), then scheduling; the shards placed in
    the original module (its parameters are the sharded module's), and the module's
    ``clip_grad_norm_`` method.

    Pass resolved ``options``, or the keywords of :meth:`FSDPOptions.resolve` (``device``,
    ``process_group``, ``sharding_strategy``, ``bucketing_strategy``, ``bucket_cap_mb``,
    ``broadcast_from``, ``config``, ``move_state_dict_to_cpu``, ``block_types``, ``device_mesh``,
    ``mixed_precision``, ``activation_checkpointing``), checked as ``fsdp`` checks them
    (``block_types`` is checked against the model when it is transformed). The list serves one
    model: its transforms share that model's state.
    """
    options = options_from(options, option_kwargs, "fsdp_transforms")
    return _transforms(options, _model_state(options))


def _model_state(options: FSDPOptions) -> ModelState:
    """The state one model's transforms share. With hybrid sharding ranks agree over the world,
    not only the shard group their collectives run on."""
    return ModelState(
        options.config,
        options.block_types,
        # The ranks' first exchange compares these settings, the configuration's and the bucket plans.
        settings=options.agreed_fields(),
        agreement_group=options.world_group if options.hybrid_mesh is not None else None,
        replicate_group=options.replicate_group,
    )


def _transforms(options: FSDPOptions, state: ModelState) -> list[Transform]:
    explain_reentrant_checkpoints()
    transforms: list[Transform] = [RefuseUnshardableTransform(), RefuseRequiresGradChangeTransform()]
    if options.activation_checkpointing:
        transforms.append(ActivationCheckpointingTransform(state))
    if options.broadcast_from is None:  # else every rank gets rank broadcast_from's weights
        transforms.append(RefuseDifferentInitTransform(options.world_group, options.device))
    transforms += [
        FSDPTransform(
            device=options.device,
            broadcast_from=options.broadcast_from,
            sharding_strategy=options.sharding.thunder_type,
            # ShardsInPlaceTransform points the original parameters at the shards instead.
            release_original_parameters=False,
            move_state_dict_to_cpu=options.move_state_dict_to_cpu,
            process_group=options.process_group,
        ),
    ]
    if options.mixed_precision.casts_anything:
        # Right after Thunder's FSDP, whose synchronize ops it replaces, and before autodiff,
        # which then uses its gradient rules ([Note: mixed precision]).
        transforms.append(
            MixedPrecisionTransform(
                options.mixed_precision, bucketing=options.bucketing, hybrid=options.hybrid_mesh is not None
            )
        )
    transforms += [
        MaterializationTransform(options.device, init=MaterializationTransform.init_from_original_module_init()),
    ]
    if options.sharding in (ShardingStrategy.ZERO3, ShardingStrategy.AUTO):
        transforms.append(Zero3Transform(state, selective=options.sharding is ShardingStrategy.AUTO))
    if options.bucketing.has_buckets:
        # After ZeRO3, so that its backward re-gathers are bucketed too; after materialisation,
        # which may replace the parameters the buckets hold.
        transforms.append(
            BucketingTransform(
                state,
                options.bucketing,
                options.process_group,
                options.bucket_cap_bytes,
                replicate_group=options.replicate_group,
                mixed_precision=options.mixed_precision,
            )
        )
    else:
        transforms.append(RefuseNoSyncTransform())
    if options.hybrid_mesh is not None:
        # After bucketing, so that a bucket's reduce-scatter gets one all-reduce; before
        # scheduling, which places the all-reduces like any other collective.
        transforms.append(ReplicaReduceTransform(options.hybrid_mesh))
    # After every transform that places parameters (sharding, materialisation, buckets).
    transforms += [OverlapScheduleTransform(state), ShardsInPlaceTransform(), ClipGradNormMethod()]
    return transforms


def fsdp(
    model: nn.Module,
    *,
    device: torch.device | str | None = None,
    sharding_strategy: ShardingStrategy | FSDPType | str = ShardingStrategy.ZERO2,
    bucketing_strategy: BucketingStrategy | FSDPBucketingStrategy | str = BucketingStrategy.NONE,
    process_group: dist.ProcessGroup | None = None,
    broadcast_from: int | None = None,
    config: OverlapConfig | None = None,
    move_state_dict_to_cpu: bool = False,
    bucket_cap_mb: float | None = None,
    block_types: type[nn.Module] | str | list[type[nn.Module] | str] | tuple[type[nn.Module] | str, ...] | None = None,
    device_mesh: DeviceMesh | None = None,
    mixed_precision: MixedPrecision | None = None,
    activation_checkpointing: bool = False,
    jit_options: Mapping[str, Any] | None = None,
    **unknown: Any,
) -> ThunderModule:
    """Shards ``model`` like ``thunder.distributed.fsdp`` and overlaps its communication.

    Args:
        model: a plain ``nn.Module`` (jitted here, with ``jit_options``) or what ``thunder.jit``
            returned, not yet sharded. Afterwards its parameters are the returned module's (the
            same objects, now this rank's shards), so an optimizer built on it before ``fsdp``
            trains them. A module an earlier ``fsdp`` consumed, or one that holds such a module,
            is refused.
        device: where shards live; default ``cuda:LOCAL_RANK`` for NCCL, ``cpu`` otherwise. A
            CUDA device becomes the current device (NCCL and object collectives use it).
        sharding_strategy: ``"zero2"``/``"zero3"``/``"auto"`` (any case), :class:`ShardingStrategy`
            or Thunder's ``FSDPType``. ZeRO3 saves only sharded parameters for backward and
            re-gathers them there. ``"auto"`` keeps the gathered parameters of the blocks the
            backward needs first to the backward (ZeRO2 for them), as many as
            ``config.memory_budget_bytes`` has room for and the predicted step gains from, and
            re-gathers the rest; the budget defaults to 85% of a CUDA device's memory and is
            required on CPU. ``Zero3Transform.of(model).choice`` says which were kept.
        bucketing_strategy: ``"none"`` (one collective per parameter), ``"layer"`` (one per module
            owning parameters), ``"block"`` (one per transformer block; other parameters by
            module) or ``"auto"`` (contiguous buckets sized by the cost model for this world size
            and network: large enough that latency is a small share of their time, within
            ``bucket_cap_mb``, the prefetch limit and the memory slack), as strings (any case),
            :class:`BucketingStrategy` or Thunder's ``FSDPBucketingStrategy`` (which has no
            auto). Buckets live in persistent flat buffers whose views are the parameters;
            ``BucketingTransform.of(model).summaries.plan`` says which were formed and why.
        process_group: the group to shard over; default a copy of the default group.
        device_mesh: instead of ``process_group``, a ``DeviceMesh`` over every rank: 1-D, the
            group to shard over; 2-D with dims (replicate, shard), as FSDP2's, hybrid sharding
            (HSDP): parameters are sharded and gathered within the shard group, and each
            reduce-scattered gradient shard is then all-reduced across the replicate group.
        mixed_precision: a :class:`MixedPrecision`: the dtype parameters are gathered and computed
            in (``param_dtype``; forward arguments are cast to it) and the dtype gradients are
            reduce-scattered in (``reduce_dtype``); None in either keeps each parameter's dtype.
            Parameters, ``.grad`` and optimizer state keep theirs (float32 masters). Not yet
            with buckets or hybrid sharding: a model whose parameters it casts is refused there.
        activation_checkpointing: True: every block (those of ``block_types``) keeps only its
            inputs for the backward, which recomputes its activations; under ZeRO3 the block's
            one backward re-gather serves its recomputation and its gradients. Models that call
            ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` themselves need no
            option; ``use_reentrant=True`` (transformers' default) is refused, Thunder cannot
            trace it.
        broadcast_from: rank whose parameters are broadcast to all before sharding.
        config: scheduler options (:class:`OverlapConfig`).
        move_state_dict_to_cpu: as in Thunder, for ``original_state_dict``.
        bucket_cap_mb: largest unsharded bucket in MiB (a larger parameter gets a bucket of its
            own); None for no cap. Needs layer, block or auto bucketing.
        block_types: the module classes (or class names, such as litgpt's ``"Block"`` or
            transformers' ``"LlamaDecoderLayer"``) whose outermost instances are the blocks that
            size prefetching and form block buckets; None: the children of the model's largest
            ``nn.ModuleList``/``nn.Sequential`` of two or more modules (a model with none, such as
            one of a single layer, warns). A type that matches no module is an error.
        jit_options: keywords for ``thunder.jit`` (e.g. ``{"executors": [...]}``), when ``model``
            is a plain module; ``transforms`` there run before the FSDP transforms. Any other
            keyword is an error naming the accepted ones: a misspelled option is never ignored.

    Returns:
        A ThunderModule whose ``named_parameters()`` are the local dim-0 shards (padded as Thunder
        pads them) and whose ``.grad`` are their gradients.

    Raises ``ValueError`` before tracing for a model FSDP cannot shard: no parameters, none
    trainable, a 0-dim parameter (make it a 1-element tensor, or a buffer), or one already sharded.
    """
    if unknown:
        raise TypeError(_unknown_fsdp_keywords(unknown))
    if jit_options is not None and not isinstance(jit_options, Mapping):
        raise TypeError(f"jit_options must be a dict of thunder.jit keywords or None, got {jit_options!r}")
    jit_options = dict(jit_options or {})
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module or a thunder.jit module, got {type(model).__name__}")
    if isinstance(model, ThunderModule) and getattr(thunder.compile_data(model), "use_fsdp", False):
        raise ValueError("model is already sharded with FSDP; pass the unsharded model")
    check_shardable(model._model if isinstance(model, ThunderModule) else model)
    refuse_reentrant_checkpoints(model._model if isinstance(model, ThunderModule) else model)
    options = FSDPOptions.resolve(
        device=device,
        process_group=process_group,
        sharding_strategy=sharding_strategy,
        bucketing_strategy=bucketing_strategy,
        bucket_cap_mb=bucket_cap_mb,
        broadcast_from=broadcast_from,
        config=config,
        move_state_dict_to_cpu=move_state_dict_to_cpu,
        block_types=block_types,
        device_mesh=device_mesh,
        mixed_precision=mixed_precision,
        activation_checkpointing=activation_checkpointing,
    )
    # Blocks are found here, before tracing: a block type that matches no module names the
    # classes there are. The transforms use these.
    state = _model_state(options)
    state.find_blocks(model._model if isinstance(model, ThunderModule) else model)
    transforms = _transforms(options, state)

    if isinstance(model, ThunderModule):
        if jit_options:
            raise TypeError(
                f"options {sorted(jit_options)} are thunder.jit options; they apply only when model is a plain "
                "nn.Module, but this model was already jitted"
            )
        from thunder.core.transforms import add_transform

        # One add_transform call with every transform: a second call would re-initialise weights.
        return add_transform(model, transform=transforms)
    user_transforms = list(jit_options.pop("transforms", None) or [])
    executors = jit_options.pop("executors", None)
    executors = with_collectives_kept_visible(thunder.get_default_executors() if executors is None else executors)
    return thunder.jit(model, transforms=[*user_transforms, *transforms], executors=executors, **jit_options)


def _unknown_fsdp_keywords(unknown: Mapping[str, Any]) -> str:
    """The error for keywords ``fsdp`` does not take; those ``thunder.jit`` names are pointed to
    ``jit_options``, where they belong."""
    accepted = [name for name, p in inspect.signature(fsdp).parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    jit_names = set(inspect.signature(thunder.jit).parameters) - {"fn", "compile_options"}
    for_jit = sorted(name for name in unknown if name in jit_names)
    parts = []
    others = [name for name in unknown if name not in jit_names]
    if others:
        parts.append(unknown_keywords_message("fsdp()", others, accepted))
    if for_jit:
        parts.append(f"options {for_jit} are thunder.jit options: pass them as jit_options={{...}}")
    else:
        parts.append("options for thunder.jit go in jit_options={...}")
    return "; ".join(parts)
