"""Benchmark models: built-in TinyGPT presets (no extra dependency) or any litgpt config.

Models are built on the meta device; every implementation then materialises them with the
modules' own ``reset_parameters`` (Thunder's MaterializationTransform does exactly that, and
:func:`materialize` does it for FSDP2 and the local calibration run).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from thunder_overlap.report._builtin_models import TinyGPT, TinyGPTConfig
from thunder_overlap.report._models import UnknownModelError, litgpt_recipe

__all__ = ["TINY_PRESETS", "ModelSpec", "build_model", "materialize", "math_sdpa", "train_flops_per_step", "loss_fn"]

TINY_PRESETS = {
    # CI smoke test: a few hundred thousand parameters, compiles in seconds.
    "tiny-gpt": TinyGPTConfig(n_embd=64, n_head=4, n_layer=2, block_size=32),
    # The slow-link testbed's model (about 4.3M parameters in 4 blocks, the size at which the testbed first measured overlap):
    # blocks big enough that per-parameter collectives run near link rate, small enough that one
    # 2-core machine computes a step in a fraction of a second.
    "tiny-gpt-4m": TinyGPTConfig(n_embd=288, n_head=6, n_layer=4, block_size=128),
}


@dataclass(frozen=True)
class ModelSpec:
    """What the training loop needs to know about the model it feeds."""

    name: str
    vocab_size: int
    block_size: int
    n_layers: int


def _litgpt_model(name: str, n_layers: int | None, block_size: int | None) -> tuple[nn.Module, ModelSpec]:
    try:
        recipe = litgpt_recipe(name, n_layer=n_layers, block_size=block_size, builtins=TINY_PRESETS)
    except UnknownModelError as e:
        raise ValueError(f"--model_name: {e}") from e  # litgpt also comes with the 'bench' extra
    with torch.device("meta"):
        model = recipe.build()
    return model, ModelSpec(name, recipe.vocab_size, recipe.block_size, recipe.n_layer)


def build_model(name: str, n_layers: int | None = None, block_size: int | None = None) -> tuple[nn.Module, ModelSpec]:
    """The model on the meta device, and its spec."""
    if name not in TINY_PRESETS:
        return _litgpt_model(name, n_layers, block_size)
    config = TINY_PRESETS[name]
    config = replace(config, n_layer=n_layers or config.n_layer, block_size=block_size or config.block_size)
    with torch.device("meta"):
        model = TinyGPT(config)
    return model, ModelSpec(name, config.vocab_size, config.block_size, config.n_layer)


def _parameter_aliases(model: nn.Module) -> dict[str, str]:
    """Every second, third... name of a shared parameter -> the first name it has."""
    first: dict[int, str] = {}
    aliases = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def materialize(model: nn.Module, device: torch.device) -> nn.Module:
    """Allocates meta parameters on ``device`` and initialises them with each module's
    ``reset_parameters``, as Thunder's materialisation does: a parameter shared by several
    modules (tied embeddings) is initialised by the first module that owns it. Works on
    FSDP2-sharded modules."""
    aliases = _parameter_aliases(model)
    model.to_empty(device=device)
    # to_empty gives each module a new Parameter for a meta one, which unties shared parameters.
    for alias, base in aliases.items():
        owner, _, leaf = alias.rpartition(".")
        setattr(model.get_submodule(owner), leaf, model.get_parameter(base))
    initialised: set[int] = set()
    with torch.no_grad():
        for module in model.modules():
            own = [id(p) for p in module.parameters(recurse=False)]
            reset = getattr(module, "reset_parameters", None)
            if not callable(reset) or (own and initialised.issuperset(own)):
                continue
            reset()
            initialised.update(own)
    return model


@contextmanager
def math_sdpa():
    """litgpt models trace on the meta device only with the flash/memory-efficient SDPA kernels off."""
    with sdpa_kernel(SDPBackend.MATH):
        yield


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def train_flops_per_step(model: nn.Module, spec: ModelSpec, micro_batch_size: int) -> int:
    """Forward + backward FLOPs of one micro-batch, counted on the meta model (shapes only)."""
    idx = torch.zeros(micro_batch_size, spec.block_size, dtype=torch.long, device="meta")
    with math_sdpa(), FlopCounterMode(display=False) as counter:
        loss_fn(model(idx), idx).backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()
