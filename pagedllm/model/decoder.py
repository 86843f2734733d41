"""The decoder-only transformer of Llama 3, Qwen2/2.5 and Qwen3, in one plain PyTorch file.

The families differ in three switches, read from the HF config by the registry:
qkv bias (Qwen2), per-head q/k RMSNorm (Qwen3), tied embeddings (Qwen3 small, Llama 3.2).
Activations are [T, hidden]: the tokens of all scheduled sequences packed, no padding.
The kernels (torch references or Triton, ops/kernels.py) are chosen once, by whoever builds
the model, and handed to every layer that computes; the AttentionMetadata of a forward is
its argument, passed down to every attention layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.model.attention import Attention
from pagedllm.model.attention_metadata import AttentionMetadata
from pagedllm.model.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.model.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.model.norm import RMSNorm
from pagedllm.model.parallel import tp_size
from pagedllm.model.rotary import RotaryEmbedding
from pagedllm.ops.kernels import Kernels


@dataclass
class FamilyTraits:
    qkv_bias: bool = False
    qk_norm: bool = False


class DecoderAttention(nn.Module):
    def __init__(self, cfg, traits: FamilyTraits, kernels: Kernels):
        super().__init__()
        tp = tp_size()
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.num_heads = cfg.num_attention_heads // tp
        self.num_kv_heads = cfg.num_key_value_heads // tp
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = traits.qkv_bias or getattr(cfg, "attention_bias", False)
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, self.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, bias=bias
        )
        self.o_proj = RowParallelLinear(
            cfg.num_attention_heads * self.head_dim, cfg.hidden_size, bias=getattr(cfg, "attention_bias", False)
        )
        self.qk_norm = traits.qk_norm
        if traits.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, kernels)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, kernels)
        rope_params = getattr(cfg, "rope_parameters", None) or {}
        theta = rope_params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        scaling = getattr(cfg, "rope_scaling", None) or (
            rope_params if rope_params.get("rope_type", "default") != "default" else None
        )
        self.rotary = RotaryEmbedding(self.head_dim, cfg.max_position_embeddings, theta, scaling, kernels)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5, kernels)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        o = self.attn(q, k, v, meta)
        return self.o_proj(o.reshape(-1, self.q_size))


class DecoderMLP(nn.Module):
    def __init__(self, cfg, kernels: Kernels):
        super().__init__()
        self.kernels = kernels
        bias = getattr(cfg, "mlp_bias", False)
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=bias)
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported (silu only)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.kernels.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg, traits: FamilyTraits, kernels: Kernels):
        super().__init__()
        self.self_attn = DecoderAttention(cfg, traits, kernels)
        self.mlp = DecoderMLP(cfg, kernels)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg, traits: FamilyTraits, kernels: Kernels):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, traits, kernels) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        x, _ = self.norm(x, residual)
        return x


class DecoderForCausalLM(nn.Module):
    # checkpoint name -> (packed parameter name, shard id)
    packed_modules: dict[str, tuple[str, int | str]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg, traits: FamilyTraits, kernels: Kernels):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, traits, kernels)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states [T, hidden]."""
        return self.model(input_ids, positions, meta)

    def attention_layers(self) -> list[Attention]:
        return [m for m in self.modules() if isinstance(m, Attention)]

    def bind_kv_cache(self, k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor]) -> None:
        """Bind layer i's attention to k_caches[i] / v_caches[i] (see Attention.bind_kv_cache: the
        KV tensor is sized by a profiling forward of this model, so it is bound after it)."""
        layers = self.attention_layers()
        if not len(layers) == len(k_caches) == len(v_caches):
            raise ValueError(f"{len(layers)} attention layers, {len(k_caches)} K and {len(v_caches)} V caches")
        for layer, k, v in zip(layers, k_caches, v_caches, strict=True):
            layer.bind_kv_cache(k, v)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
