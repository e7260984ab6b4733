"""The options of :func:`thunder_overlap.fsdp`, parsed and checked in one place.

Every public entry point (``fsdp``, ``fsdp_transforms``, ``FSDPOverlap``, the report CLI) turns
raw user input into these types here and nowhere else:

- :class:`ShardingStrategy` and :class:`BucketingStrategy`, the project's own strategy enums,
  parsed from the enum itself, a case-insensitive string, or Thunder's ``FSDPType`` /
  ``FSDPBucketingStrategy``; Thunder's enums are produced again only where Thunder needs them;
- :class:`MixedPrecision`, the dtypes parameters are gathered and gradients reduced in;
- :class:`FSDPOptions`, the resolved options (device, process group, strategies, ...) that the
  transforms receive, built by :meth:`FSDPOptions.resolve`.

Errors name the bad value and what is accepted, in the caller's terms: a Python argument
(``sharding_strategy must be 'zero2', 'zero3' or 'auto' (or FSDPType.ZERO2/ZERO3), got 'zero4'``) or,
given ``flag=``, a command-line flag (``--sharding must be zero2, zero3 or auto (got 'zero4')``).

Importing this module imports neither torch nor Thunder (each function imports what it uses), so
the command lines parse and check their strategy flags before any heavy import.
"""

from __future__ import annotations

import difflib
import inspect
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from enum import Enum
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist
    from thunder.distributed import FSDPBucketingStrategy, FSDPType
    from torch.distributed.device_mesh import DeviceMesh

    from thunder_overlap._analysis.blocks import BlockTypes
    from thunder_overlap.config import OverlapConfig

__all__ = [
    "BucketingStrategy",
    "FSDPOptions",
    "MixedPrecision",
    "ShardingStrategy",
    "options_from",
    "own_dtype_reducers",
    "parse_bucketing_strategy",
    "parse_sharding_strategy",
    "reduce_dtypes_for",
    "resolve_keywords",
    "unknown_keywords_message",
]


class _Choice(str, Enum):
    """A named choice that is also its lower-case string: it compares, hashes and formats as
    its value, so ``ShardingStrategy.ZERO3 == "zero3"`` and both find the same dict entry."""

    def __str__(self) -> str:
        return self.value

    def __hash__(self) -> int:
        return str.__hash__(self)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The accepted strings, in declaration order."""
        return tuple(member.value for member in cls)


class ShardingStrategy(_Choice):
    """What the forward keeps for backward: ZeRO2 the unsharded parameters, ZeRO3 only shards,
    AUTO the unsharded parameters of the blocks a memory budget has room for, shards of the rest
    ([Note: selective unsharding] in docs/design.md)."""

    ZERO2 = "zero2"
    ZERO3 = "zero3"
    AUTO = "auto"

    @property
    def thunder_type(self) -> FSDPType:
        """Thunder's enum, for ``thunder.distributed`` APIs (AUTO starts from Thunder's ZERO3)."""
        from thunder.distributed import FSDPType

        return FSDPType.ZERO3 if self is ShardingStrategy.AUTO else FSDPType[self.name]


class BucketingStrategy(_Choice):
    """How parameters are grouped per collective (see :func:`~thunder_overlap._bucketing.plan.bucket_owner`)."""

    NONE = "none"
    LAYER = "layer"
    BLOCK = "block"
    # Sized by the cost model: contiguous buckets that saturate bandwidth within the caps
    # (see thunder_overlap._bucketing.auto_plan). Thunder has no such strategy.
    AUTO = "auto"

    @property
    def has_buckets(self) -> bool:
        return self is not BucketingStrategy.NONE

    @property
    def thunder_type(self) -> FSDPBucketingStrategy:
        """Thunder's enum, for ``thunder.distributed`` APIs."""
        from thunder.distributed import FSDPBucketingStrategy

        if self.name not in FSDPBucketingStrategy.__members__:
            raise ValueError(f"Thunder's FSDP has no {self.value!r} bucketing; accepted there: none, layer, block")
        return FSDPBucketingStrategy[self.name]


_ChoiceT = TypeVar("_ChoiceT", bound=_Choice)


def _spoken(names: tuple[str, ...], quote: bool) -> str:
    """('a', 'b', 'c') -> "'a', 'b' or 'c'" (quote) or "a, b or c"."""
    words = [repr(n) if quote else n for n in names]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def _is_thunder_enum(value: object, name: str) -> bool:
    """Whether ``value`` is a member of Thunder's enum ``name`` (``thunder.distributed``), told by
    its class: checking imports nothing (the command line parses its flags without Thunder)."""
    kind = type(value)
    return isinstance(value, Enum) and (kind.__module__, kind.__name__) == ("thunder.distributed", name)


def _thunder_enum(name: str) -> type[Enum]:
    import thunder.distributed

    return getattr(thunder.distributed, name)


def _parse_choice(choice: type[_ChoiceT], thunder_enum_name: str, value: object, argument: str, flag: str | None) -> _ChoiceT:
    if isinstance(value, choice):
        return value
    if _is_thunder_enum(value, thunder_enum_name) and value.name.lower() in choice.names():
        return choice(value.name.lower())
    if isinstance(value, str) and not isinstance(value, Enum) and value.lower() in choice.names():
        return choice(value.lower())
    if flag is not None:
        raise ValueError(f"{flag} must be {_spoken(choice.names(), quote=False)} (got {value!r})")
    thunder_enum = _thunder_enum(thunder_enum_name)
    members = "/".join(member.name for member in choice if member.name in thunder_enum.__members__)
    raise ValueError(
        f"{argument} must be {_spoken(choice.names(), quote=True)} "
        f"(or {thunder_enum.__name__}.{members}), got {value!r}"
    )


def parse_sharding_strategy(value: ShardingStrategy | FSDPType | str, *, flag: str | None = None) -> ShardingStrategy:
    """The sharding strategy ``value`` names; ``flag`` (e.g. ``"--sharding"``) makes the error
    speak of that command-line flag instead of the ``sharding_strategy`` argument."""
    return _parse_choice(ShardingStrategy, "FSDPType", value, "sharding_strategy", flag)


def parse_bucketing_strategy(
    value: BucketingStrategy | FSDPBucketingStrategy | str, *, flag: str | None = None
) -> BucketingStrategy:
    """The bucketing strategy ``value`` names; ``flag`` as in :func:`parse_sharding_strategy`."""
    return _parse_choice(BucketingStrategy, "FSDPBucketingStrategy", value, "bucketing_strategy", flag)


def _parse_bucket_cap_mb(value: float | None, bucketing: BucketingStrategy) -> int | None:
    """The cap in bytes (None: no cap); refuses a cap that would have no buckets to apply to."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
        raise ValueError(f"bucket_cap_mb must be a positive finite number of MiB, or None for no cap, got {value!r}")
    if int(value * 2**20) < 1:
        raise ValueError(f"bucket_cap_mb={value!r} is less than one byte; a cap is in MiB (e.g. 25 for 25 MiB)")
    if not bucketing.has_buckets:
        raise ValueError(
            f"bucket_cap_mb={value!r} needs bucketing_strategy 'layer', 'block' or 'auto'; with 'none' there are no buckets to cap"
        )
    return int(value * 2**20)


# The dtypes a policy accepts, narrowest first; float16 and bfloat16 are equally narrow but
# neither holds the other's values, so one never reduces the other's gradients.
_MIXED_PRECISION_DTYPES = ("float16", "bfloat16", "float32", "float64")
_PRECISION_RANK = {"float16": 0, "bfloat16": 0, "float32": 1, "float64": 2}


def reduce_dtypes_for(gather: str) -> tuple[str, ...]:
    """The dtype names gradients computed in ``gather`` may be reduced in: ``gather`` itself and
    the wider ones (a narrower reduce would lose what the gradients were computed with)."""
    return tuple(n for n in _MIXED_PRECISION_DTYPES if n == gather or _PRECISION_RANK[n] > _PRECISION_RANK[gather])


def own_dtype_reducers(bucketing: BucketingStrategy, hybrid: bool, *, flags: bool = False) -> list[str]:
    """The options, in the caller's terms (Python arguments or, given ``flags``, command-line
    flags), that reduce gradients in the parameters' own dtype: buckets reduce-scatter into their
    flat gradient shard, and HSDP all-reduces the reduced shard, in that dtype, so a mixed-precision
    ``reduce_dtype`` of its own is not handled with them yet."""
    users = []
    if bucketing.has_buckets:
        users.append(f"--bucketing {bucketing.value}" if flags else f"bucketing_strategy={bucketing.value!r}")
    if hybrid:
        users.append("--shard-group-size" if flags else "hybrid sharding (a 2-D device_mesh)")
    return users


def _dtype_name(value: object) -> str | None:
    """``value``'s name in ``_MIXED_PRECISION_DTYPES``, or None when it is no such torch dtype."""
    import torch

    if not isinstance(value, torch.dtype):
        return None
    name = str(value).removeprefix("torch.")
    return name if name in _MIXED_PRECISION_DTYPES else None


@dataclass(frozen=True)
class MixedPrecision:
    """The dtypes FSDP communicates and computes in, like FSDP2's ``MixedPrecisionPolicy``.

    Parameters, their ``.grad`` and the optimizer state keep each parameter's own dtype (float32
    masters) and stay sharded. ``param_dtype``: each shard is cast to it before it is all-gathered
    (in forward, and in ZeRO3's backward re-gathers), so compute runs on parameters of that dtype;
    the forward's floating arguments are cast to it too, buffers are not. ``reduce_dtype``:
    gradients are cast to it, reduce-scattered, and the reduced shard is cast back to the
    parameter's dtype. None keeps the parameter's own dtype for either (FSDP2's
    ``reduce_dtype=None`` means ``param_dtype`` instead): ``MixedPrecision(torch.bfloat16)``
    gathers in bfloat16 and reduces in float32. A dtype equal to a parameter's own adds no cast
    for that parameter. See [Note: mixed precision] in docs/design.md.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        accepted = ", ".join(f"torch.{name}" for name in _MIXED_PRECISION_DTYPES)
        for field_name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, field_name)
            if value is not None and _dtype_name(value) is None:
                raise ValueError(
                    f"MixedPrecision {field_name} must be a floating torch dtype ({accepted}) or None "
                    f"for the parameter's own dtype, got {value!r}"
                )
        if self.param_dtype is None or self.reduce_dtype is None or self.param_dtype == self.reduce_dtype:
            return
        accepted = reduce_dtypes_for(_dtype_name(self.param_dtype))
        if _dtype_name(self.reduce_dtype) not in accepted:
            raise ValueError(
                f"MixedPrecision reduce_dtype={self.reduce_dtype} is not as wide as param_dtype={self.param_dtype}: "
                f"gradients would be reduced in less precision than they were computed in; "
                f"use reduce_dtype={', '.join(f'torch.{n}' for n in accepted)}, or None for the parameter's own dtype"
            )

    @property
    def casts_anything(self) -> bool:
        """False for ``MixedPrecision()``, which keeps every parameter's dtype."""
        return self.param_dtype is not None or self.reduce_dtype is not None

    def dtypes_for(self, dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype] | None:
        """(gather dtype, reduce dtype) of a parameter of ``dtype``; None when both are ``dtype``
        itself or it is not floating: nothing to cast (FSDP2 clamps a policy likewise)."""
        if not dtype.is_floating_point:
            return None
        gather = dtype if self.param_dtype is None else self.param_dtype
        reduce = dtype if self.reduce_dtype is None else self.reduce_dtype
        return None if gather == dtype and reduce == dtype else (gather, reduce)


@dataclass(frozen=True)
class FSDPOptions:
    """Resolved options of :func:`thunder_overlap.fsdp`; build with :meth:`FSDPOptions.resolve`."""

    device: torch.device
    process_group: dist.ProcessGroup
    sharding: ShardingStrategy
    bucketing: BucketingStrategy
    # Largest unsharded bucket in bytes; None for no cap (layer/block/auto bucketing only).
    bucket_cap_bytes: int | None
    # Rank whose parameters are broadcast before sharding; None for no broadcast.
    broadcast_from: int | None
    config: OverlapConfig
    move_state_dict_to_cpu: bool
    # Module classes (or class names) that form blocks; None: detect them (analysis.blocks).
    block_types: BlockTypes | None = None
    # Hybrid sharding: the 2-D device mesh (replicate, shard); process_group is its shard
    # group. None for plain FSDP.
    hybrid_mesh: DeviceMesh | None = None
    # The dtypes of gathers and reductions; MixedPrecision() keeps the parameters' own.
    mixed_precision: MixedPrecision = MixedPrecision()
    # Every block recomputes its activations in the backward ([Note: activation checkpointing]).
    activation_checkpointing: bool = False

    @property
    def replicate_group(self) -> dist.ProcessGroup | None:
        """The group each reduced gradient shard is all-reduced over (hybrid sharding only)."""
        return None if self.hybrid_mesh is None else self.hybrid_mesh.get_group(0)

    def agreed_fields(self) -> dict[str, object]:
        """The options every rank must share, by name, for the ranks' agreement at the first
        compile (the configuration's own: :meth:`OverlapConfig.agreed_fields`)."""
        import torch.distributed as dist

        mesh = None if self.hybrid_mesh is None else tuple(self.hybrid_mesh.shape)
        return {
            "sharding_strategy": self.sharding.value,
            "bucketing_strategy": self.bucketing.value,
            "bucket_cap_bytes": self.bucket_cap_bytes,
            "block_types": self.block_types,
            "device_mesh": mesh,
            "mixed_precision": self.mixed_precision,
            "activation_checkpointing": self.activation_checkpointing,
            "world_size": dist.get_world_size(self.process_group),
        }

    @property
    def world_group(self) -> dist.ProcessGroup:
        """The group every rank of the model is in: ranks agree on their schedules over it."""
        import torch.distributed as dist

        return self.process_group if self.replicate_group is None else dist.group.WORLD

    def __post_init__(self) -> None:
        # Raw user input goes through resolve(); this only catches a hand-built instance.
        if not isinstance(self.sharding, ShardingStrategy) or not isinstance(self.bucketing, BucketingStrategy):
            raise TypeError(
                f"FSDPOptions holds parsed strategies, got sharding={self.sharding!r}, bucketing={self.bucketing!r}; "
                "build it with FSDPOptions.resolve(...)"
            )

    @classmethod
    def resolve(
        cls,
        *,
        device: torch.device | str | None = None,
        process_group: dist.ProcessGroup | None = None,
        sharding_strategy: ShardingStrategy | FSDPType | str = ShardingStrategy.ZERO2,
        bucketing_strategy: BucketingStrategy | FSDPBucketingStrategy | str = BucketingStrategy.NONE,
        bucket_cap_mb: float | None = None,
        broadcast_from: int | None = None,
        config: OverlapConfig | None = None,
        move_state_dict_to_cpu: bool = False,
        block_types: object = None,
        device_mesh: DeviceMesh | None = None,
        mixed_precision: MixedPrecision | None = None,
        activation_checkpointing: bool = False,
    ) -> FSDPOptions:
        """Checks user input and fills in defaults (see :func:`thunder_overlap.fsdp` for each option).

        A CUDA device becomes this process's current device (``torch.cuda.set_device``).
        """
        from thunder_overlap._analysis.blocks import parse_block_types
        from thunder_overlap._process_groups import resolve_device, resolve_groups
        from thunder_overlap.config import OverlapConfig

        if config is not None and not isinstance(config, OverlapConfig):
            raise TypeError(f"config must be a thunder_overlap.OverlapConfig or None, got {type(config).__name__}")
        if not isinstance(move_state_dict_to_cpu, bool):
            raise TypeError(f"move_state_dict_to_cpu must be a bool, got {move_state_dict_to_cpu!r}")
        if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
            raise TypeError(
                f"mixed_precision must be a thunder_overlap.MixedPrecision or None, got {mixed_precision!r} "
                "(e.g. MixedPrecision(param_dtype=torch.bfloat16))"
            )
        if not isinstance(activation_checkpointing, bool):
            raise TypeError(f"activation_checkpointing must be a bool, got {activation_checkpointing!r}")
        sharding = parse_sharding_strategy(sharding_strategy)
        bucketing = parse_bucketing_strategy(bucketing_strategy)
        bucket_cap_bytes = _parse_bucket_cap_mb(bucket_cap_mb, bucketing)
        parsed_block_types = parse_block_types(block_types)
        process_group, hybrid_mesh = resolve_groups(process_group, device_mesh, broadcast_from)
        device = resolve_device(device, process_group)
        config = config if config is not None else OverlapConfig()
        if sharding is ShardingStrategy.AUTO and config.memory_budget_bytes is None:
            config = replace(config, memory_budget_bytes=_default_memory_budget(device))
        return cls(
            device=device,
            process_group=process_group,
            sharding=sharding,
            bucketing=bucketing,
            bucket_cap_bytes=bucket_cap_bytes,
            broadcast_from=broadcast_from,
            config=config,
            move_state_dict_to_cpu=move_state_dict_to_cpu,
            block_types=parsed_block_types,
            hybrid_mesh=hybrid_mesh,
            mixed_precision=MixedPrecision() if mixed_precision is None else mixed_precision,
            activation_checkpointing=activation_checkpointing,
        )


# Sharding "auto" on CUDA without a budget: this share of the device's memory. The rest is left to
# what the traces do not hold (optimizer state, the allocator's fragmentation, CUDA's own context).
_DEFAULT_BUDGET_SHARE = 0.85


def _default_memory_budget(device: torch.device) -> int:
    """Sharding "auto"'s budget where the user gave none: a share of the CUDA device's memory."""
    import torch

    if device.type != "cuda":
        raise ValueError(
            f"sharding_strategy='auto' on device {str(device)!r} needs a memory budget: pass "
            "config=OverlapConfig(memory_budget_bytes=...), the bytes a rank's step may hold "
            "(only on CUDA does it default to a share of the device's memory)"
        )
    return int(torch.cuda.get_device_properties(device).total_memory * _DEFAULT_BUDGET_SHARE)


def unknown_keywords_message(caller: str, unknown: Iterable[str], accepted: Iterable[str]) -> str:
    """The error for keywords ``caller`` does not take: each with the accepted name it is closest
    to, then every accepted name, sorted. A misspelled option must not pass silently (or as
    Python's bare "unexpected keyword argument", which names no alternative)."""
    unknown, accepted = sorted(unknown), sorted(accepted)
    guesses = []
    for name in unknown:
        close = [a for a in accepted if a.startswith(name) or name.startswith(a)] or difflib.get_close_matches(name, accepted, n=1)
        if close:
            guesses.append(f"{name!r} -> {close[0]!r}")
    did_you_mean = f" (did you mean {', '.join(guesses)}?)" if guesses else ""
    return f"{caller} got unknown keyword arguments {unknown}{did_you_mean}; it accepts {accepted}"


def resolve_keywords() -> list[str]:
    """The keywords of :meth:`FSDPOptions.resolve`, which ``fsdp_transforms`` and ``FSDPOverlap`` take."""
    return [name for name in inspect.signature(FSDPOptions.resolve).parameters if name != "cls"]


def options_from(options: FSDPOptions | None, option_kwargs: Mapping[str, object], caller: str) -> FSDPOptions:
    """``options`` as given, or resolved from the keywords of :meth:`FSDPOptions.resolve`: the
    two ways ``fsdp_transforms`` and ``FSDPOverlap`` accept options (``caller`` names which)."""
    if options is None:
        accepted = resolve_keywords()
        unknown = [name for name in option_kwargs if name not in accepted]
        if unknown:
            raise TypeError(unknown_keywords_message(f"{caller}()", unknown, accepted))
        return FSDPOptions.resolve(**option_kwargs)
    if not isinstance(options, FSDPOptions):
        raise TypeError(
            f"{caller} takes a thunder_overlap.FSDPOptions as its only positional argument, got {options!r}; "
            "pass the other options by keyword"
        )
    if option_kwargs:
        raise TypeError(f"{caller}: pass either an FSDPOptions or keywords, not both (got keywords {sorted(option_kwargs)})")
    return options
