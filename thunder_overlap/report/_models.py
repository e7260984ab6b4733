"""Models the report can build on the meta device, and how it traces them without running.

Shared by the ``report`` command line and the benchmarks: the built-in models (no extra
dependency), any litgpt config by name, and :func:`trace_model`, which traces a meta model with
thunder_overlap's FSDP over a fake process group of any size (Thunder's own FSDP of the same
model: :func:`~thunder_overlap.report._thunder_baseline.thunder_fsdp_baseline` of the result).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the report's command line lists BUILTIN_MODELS before it imports torch
    from torch import nn

__all__ = ["BUILTIN_MODELS", "ModelRecipe", "UnknownModelError", "hybrid_mesh", "litgpt_recipe", "model_recipe", "trace_model"]

LITGPT_HINT = "litgpt config names (such as 'Llama-2-7b-hf') need litgpt: pip install litgpt==0.5.13"


class UnknownModelError(ValueError):
    """A model name that is neither built in nor a litgpt config (or litgpt is missing)."""


@dataclass(frozen=True)
class ModelRecipe:
    """How to build one model (call ``build`` under ``torch.device("meta")``) and its sizes."""

    build: Callable[[], nn.Module]
    block_size: int
    vocab_size: int
    n_layer: int


def _tiny_gpt(n_layer: int | None) -> ModelRecipe:
    from thunder_overlap.report._builtin_models import TinyGPT, TinyGPTConfig

    config = TinyGPTConfig()
    config = replace(config, n_layer=n_layer or config.n_layer)
    return ModelRecipe(lambda: TinyGPT(config), config.block_size, config.vocab_size, config.n_layer)


def _llama_2_7b(n_layer: int | None) -> ModelRecipe:
    from thunder_overlap.report._builtin_models import Llama, LlamaConfig

    config = LlamaConfig()
    config = replace(config, n_layer=n_layer or config.n_layer)
    return ModelRecipe(lambda: Llama(config), config.block_size, config.vocab_size, config.n_layer)


def _llama_2_70b(n_layer: int | None) -> ModelRecipe:
    from thunder_overlap.report._builtin_models import Llama, LlamaConfig

    # Llama-2-70B: 8192 wide, 64 query heads sharing 8 key/value heads, 80 layers.
    config = LlamaConfig(n_embd=8192, n_head=64, n_query_groups=8, n_layer=80, intermediate_size=28672)
    config = replace(config, n_layer=n_layer or config.n_layer)
    return ModelRecipe(lambda: Llama(config), config.block_size, config.vocab_size, config.n_layer)


# name -> recipe for a number of layers (None: the config's own).
BUILTIN_MODELS: dict[str, Callable[[int | None], ModelRecipe]] = {
    "tiny-gpt": _tiny_gpt,
    "llama-2-7b": _llama_2_7b,
    "llama-2-70b": _llama_2_70b,
}


def litgpt_recipe(name: str, *, n_layer: int | None = None, block_size: int | None = None, builtins=BUILTIN_MODELS) -> ModelRecipe:
    """A litgpt ``GPT`` from its config name; ``builtins`` only words the error for an unknown name."""
    try:
        from litgpt import Config
        from litgpt.model import GPT
    except ImportError:
        raise UnknownModelError(f"unknown model {name!r}; built-in models: {sorted(builtins)}. {LITGPT_HINT}") from None
    overrides = {k: v for k, v in (("n_layer", n_layer), ("block_size", block_size)) if v is not None}
    try:
        config = Config.from_name(name, **overrides)
    except ValueError:
        raise UnknownModelError(f"unknown model {name!r}: neither built-in ({sorted(builtins)}) nor a litgpt config name") from None
    return ModelRecipe(lambda: GPT(config), config.block_size, config.padded_vocab_size, config.n_layer)


def model_recipe(name: str, n_layer: int | None = None) -> ModelRecipe:
    """A built-in model by name, else a litgpt config."""
    if name in BUILTIN_MODELS:
        return BUILTIN_MODELS[name](n_layer)
    return litgpt_recipe(name, n_layer=n_layer)


def hybrid_mesh(world_size: int, shard_group_size: int):
    """The 2-D device mesh (replicate, shard) of hybrid sharding on the live process group:
    ``world_size // shard_group_size`` replicas of shard groups of ``shard_group_size``
    consecutive ranks (a node's GPUs when it is the node size), FSDP2's order."""
    from torch.distributed.device_mesh import init_device_mesh

    if shard_group_size < 1 or world_size % shard_group_size:
        raise ValueError(f"shard group size {shard_group_size} does not divide the world size {world_size}")
    # Thunder traces on "meta"; the mesh's device type only places checkpoint DTensors.
    return init_device_mesh("cpu", (world_size // shard_group_size, shard_group_size), mesh_dim_names=("replicate", "shard"))


def trace_model(
    model: nn.Module,
    *,
    world_size: int,
    sharding: str,
    bucketing: str,
    idx_shape: tuple[int, int],
    config=None,
    shard_group_size: int | None = None,
    mixed_precision=None,
    activation_checkpointing: bool = False,
):
    """Traces ``model`` (on meta) with thunder_overlap's FSDP on a fake group of ``world_size``
    and ``config`` (an OverlapConfig; give it the report's cost model, as the meta device has no
    profile of its own); returns the jitted module, whose last traces the report reads.

    Runs in the live default group when there is one of ``world_size`` ranks (keep it alive
    while simulating with a cost model that has a topology: it reads each group's ranks), else
    in a fake group of its own. ``shard_group_size``: hybrid sharding on the (replicate, shard)
    mesh of :func:`hybrid_mesh`; None shards over the whole world. ``mixed_precision``: a
    :class:`~thunder_overlap.MixedPrecision`, or None. ``activation_checkpointing``:
    every block recomputes its activations in the backward."""
    import thunder
    import torch
    import torch.distributed as dist

    from thunder_overlap.api import fsdp
    from thunder_overlap.report._thunder_baseline import _math_attention, fake_process_group

    if dist.is_initialized() and dist.get_world_size() != world_size:
        raise ValueError(f"the live default process group has {dist.get_world_size()} ranks, not {world_size}")
    with nullcontext() if dist.is_initialized() else fake_process_group(world_size), _math_attention():
        mesh = hybrid_mesh(world_size, shard_group_size) if shard_group_size is not None else None
        jm = fsdp(
            model,
            device="meta",
            sharding_strategy=sharding,
            bucketing_strategy=bucketing,
            config=config,
            device_mesh=mesh,
            mixed_precision=mixed_precision,
            activation_checkpointing=activation_checkpointing,
        )
        idx = torch.zeros(idx_shape, dtype=torch.long, device="meta")
        thunder.compile_data(jm).get_computation_and_inputs(idx)
        return jm
