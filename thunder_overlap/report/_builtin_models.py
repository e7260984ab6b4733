"""A small GPT-like model for the demo, the tests and the CPU benchmarks.

It has what makes FSDP hard: an embedding whose first dimension needs padding when sharded, an
output head tied to the embedding, and a frozen parameter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["TinyGPTConfig", "TinyGPT", "LlamaConfig", "Llama"]


@dataclass(frozen=True)
class TinyGPTConfig:
    vocab_size: int = 101  # odd, so the embedding is padded on an even world size
    n_embd: int = 64
    n_head: int = 4
    n_layer: int = 8
    block_size: int = 32
    tie_embeddings: bool = True
    freeze_position_embedding: bool = True


# The models call their layers other than the blocks through these functions, not as modules:
# the operations, parameters and names are the same, and so are the traces, but Thunder's
# interpreter then runs no nn.Module.__call__ for them, which is most of what tracing a layer this
# small costs (the tests compile hundreds of these models). The blocks stay module calls, as
# FSDP2's hooks and activation checkpointing need.
# For the same reason the models index tuples rather than unpack them (`shape[0]`, not `batch,
# seq, width = shape`): Thunder's interpreter runs an unpacking as interpreted iteration.
def _linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, layer.weight, layer.bias)


def _layer_norm(layer: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, layer.normalized_shape, layer.weight, layer.bias, layer.eps)


class Attention(nn.Module):
    def __init__(self, config: TinyGPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _attention(self, x)


def _attention(layer: Attention, x: torch.Tensor) -> torch.Tensor:
    shape = x.shape
    batch, seq, width = shape[0], shape[1], shape[2]
    heads = (batch, seq, layer.n_head, width // layer.n_head)
    qkv = _linear(layer.qkv, x).split(width, dim=2)
    q = qkv[0].view(heads).transpose(1, 2)
    k = qkv[1].view(heads).transpose(1, 2)
    v = qkv[2].view(heads).transpose(1, 2)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return _linear(layer.proj, y.transpose(1, 2).reshape(batch, seq, width))


class Block(nn.Module):
    def __init__(self, config: TinyGPTConfig) -> None:
        super().__init__()
        self.norm_1 = nn.LayerNorm(config.n_embd)
        self.attn = Attention(config)
        self.norm_2 = nn.LayerNorm(config.n_embd)
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + _attention(self.attn, _layer_norm(self.norm_1, x))
        return x + _linear(self.proj, F.gelu(_linear(self.fc, _layer_norm(self.norm_2, x))))


class TinyGPT(nn.Module):
    def __init__(self, config: TinyGPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.wpe.weight.requires_grad_(not config.freeze_position_embedding)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # GPT-2's initialisation: with PyTorch's default N(0, 1) embeddings, the tied head
        # starts with logits in the tens and losses far above log(vocab_size).
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = F.embedding(idx, self.wte.weight) + F.embedding(positions, self.wpe.weight)
        for block in self.blocks:
            x = block(x)
        return F.linear(_layer_norm(self.norm_f, x), self.lm_head.weight)


@dataclass(frozen=True)
class LlamaConfig:
    """A Llama-shaped decoder (RMSNorm, rotary attention, SwiGLU MLP, no biases, untied head).
    The defaults are Llama-2-7B's shapes; reports and benchmarks trace it on the meta device."""

    vocab_size: int = 32000
    n_embd: int = 4096
    n_head: int = 32
    # Key/value heads (grouped-query attention, as Llama-2-70B's 8); None: one per query head.
    n_query_groups: int | None = None
    n_layer: int = 32
    intermediate_size: int = 11008
    block_size: int = 4096
    norm_eps: float = 1e-5
    rope_base: float = 10000.0


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def reset_parameters(self) -> None:
        # Thunder's materialisation of a meta-device model calls this on every module with
        # parameters of its own.
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rms_norm(self, x)


def _rms_norm(layer: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + layer.eps) * layer.weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class LlamaBlock(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_query_groups = config.n_query_groups or config.n_head
        self.kv_width = self.n_query_groups * (config.n_embd // config.n_head)
        self.norm_1 = RMSNorm(config.n_embd, config.norm_eps)
        self.qkv = nn.Linear(config.n_embd, config.n_embd + 2 * self.kv_width, bias=False)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.norm_2 = RMSNorm(config.n_embd, config.norm_eps)
        self.fc_1 = nn.Linear(config.n_embd, config.intermediate_size, bias=False)
        self.fc_2 = nn.Linear(config.n_embd, config.intermediate_size, bias=False)
        self.mlp_proj = nn.Linear(config.intermediate_size, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        batch, seq, width = shape[0], shape[1], shape[2]
        head_size = width // self.n_head
        qkv = _linear(self.qkv, _rms_norm(self.norm_1, x)).split((width, self.kv_width, self.kv_width), dim=2)
        q = qkv[0].view(batch, seq, self.n_head, head_size).transpose(1, 2)
        k = qkv[1].view(batch, seq, self.n_query_groups, head_size).transpose(1, 2)
        v = qkv[2].view(batch, seq, self.n_query_groups, head_size).transpose(1, 2)
        if self.n_query_groups != self.n_head:
            repeats = self.n_head // self.n_query_groups
            k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
        y = F.scaled_dot_product_attention(_rotate(q, cos, sin), _rotate(k, cos, sin), v, is_causal=True)
        x = x + _linear(self.proj, y.transpose(1, 2).reshape(batch, seq, width))
        h = _rms_norm(self.norm_2, x)
        return x + _linear(self.mlp_proj, F.silu(_linear(self.fc_1, h)) * _linear(self.fc_2, h))


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.blocks = nn.ModuleList(LlamaBlock(config) for _ in range(config.n_layer))
        self.norm_f = RMSNorm(config.n_embd, config.norm_eps)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        # Rotary tables are computed here rather than kept as buffers, so that a model built on
        # the meta device needs nothing materialised to be traced.
        head_size = self.config.n_embd // self.config.n_head
        inv_freq = 1.0 / self.config.rope_base ** (torch.arange(0, head_size, 2, device=idx.device).float() / head_size)
        angles = torch.outer(torch.arange(idx.shape[1], device=idx.device).float(), inv_freq).repeat(1, 2)
        x = F.embedding(idx, self.wte.weight)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        for block in self.blocks:
            x = block(x, cos, sin)
        return F.linear(_rms_norm(self.norm_f, x), self.lm_head.weight)
