"""The decoder-only transformer of Llama 3, Mistral, Qwen2/2.5, Qwen3, Phi-3, Gemma 2, Gemma 3
(text) and the mixture-of-experts Qwen3-MoE and Mixtral, in one plain PyTorch file.

The families differ in a few switches (FamilyTraits), set per architecture by the registry;
the values behind them (windows, soft caps, rope bases) are read from the HF config here.
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
from pagedllm.model.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.model.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.model.moe import SparseMoeBlock, is_moe_layer
from pagedllm.model.norm import RMSNorm
from pagedllm.model.parallel import tp_size
from pagedllm.model.rotary import RotaryEmbedding
from pagedllm.ops.attention_metadata import AttentionMetadata
from pagedllm.ops.kernels import Kernels

# MLP activation (the config's hidden_act / hidden_activation) -> the Kernels method of act(gate) * up
ACTIVATIONS = {"silu": "silu_and_mul", "gelu_pytorch_tanh": "gelu_tanh_and_mul"}


@dataclass(frozen=True)
class FamilyTraits:
    qkv_bias: bool = False  # Qwen2: q/k/v projections with a bias
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm of every q and k head before rotary
    # Gemma 2/3: RMSNorms scale by (1 + w); four norms per layer (the "sandwich": attention and MLP
    # outputs normalised before their residual add); embeddings times sqrt(hidden_size) rounded to
    # the model's dtype; scores scaled by query_pre_attn_scalar**-0.5; final_logit_softcapping
    gemma: bool = False
    attn_soft_cap: bool = False  # Gemma 2: attn_logit_softcapping (HF's Gemma 3 attention ignores it)
    # which layers config.sliding_window applies to: "none" (Llama: never), "all" (Mistral, Phi-3:
    # every layer when set), "layer_types" (Qwen2/3, Gemma: the layers config.layer_types names sliding)
    windows: str = "none"
    activation_field: str = "hidden_act"  # the config field naming the MLP activation (Gemma: hidden_activation)
    partial_rotary: bool = False  # Phi-3: rope_parameters' partial_rotary_factor rotates the first dims of each head
    # mixture of experts: "qwen3_moe" or "mixtral" (model/moe.py); which layers are sparse: moe.is_moe_layer
    moe: str | None = None


def head_dim_of(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def rope_of(cfg, layer_type: str | None) -> tuple[float, dict | None]:
    """(rope theta, rope parameters) of a layer: the config's rope_parameters (scaling type and
    factors, partial_rotary_factor), taken per layer kind where it is keyed by kind (Gemma 3:
    local layers their own base)."""
    params = getattr(cfg, "rope_parameters", None)
    if params is None:  # a config object from before rope_parameters
        return getattr(cfg, "rope_theta", 10000.0), getattr(cfg, "rope_scaling", None)
    if layer_type in params:
        params = params[layer_type]
    return params.get("rope_theta", 10000.0), params


class DecoderAttention(nn.Module):
    def __init__(
        self,
        cfg,
        traits: FamilyTraits,
        kernels: Kernels,
        layer_type: str | None,
        window: int | None,
        max_model_len: int | None,
    ):
        super().__init__()
        tp = tp_size()
        self.head_dim = head_dim_of(cfg)
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
        self.qk_norm, self.unit_offset = traits.qk_norm, traits.gemma
        if traits.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, kernels, unit_offset=traits.gemma)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, kernels, unit_offset=traits.gemma)
        theta, scaling = rope_of(cfg, layer_type)
        self.rotary = RotaryEmbedding(
            self.head_dim, cfg.max_position_embeddings, theta, scaling, kernels, max_model_len=max_model_len
        )
        scale = cfg.query_pre_attn_scalar**-0.5 if traits.gemma else self.head_dim**-0.5
        cap = cfg.attn_logit_softcapping if traits.attn_soft_cap else None
        self.attn = Attention(
            self.num_heads, self.num_kv_heads, self.head_dim, scale, kernels, sliding_window=window, logits_soft_cap=cap
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv(x)
        return self.out(self.attend(positions, q, k, v, meta))

    # The three parts of forward, apart: a step in piecewise CUDA graphs (worker/piecewise_graphs.py)
    # replays qkv and out in graphs and runs attend, whose shapes change with every step, eagerly.
    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        return q, k, v

    def attend(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q/k norm, rotary and the KV store in one call (Kernels.prepare_qkv, inside the attention
        layer), then attention: [T, Hq, D]."""
        norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else (None, None, 0.0)
        return self.attn(q, k, v, meta, positions, self.rotary.cos_sin_cache, *norms, unit_offset=self.unit_offset)

    def out(self, o: torch.Tensor) -> torch.Tensor:
        return self.o_proj(o.reshape(-1, self.q_size))


class DecoderMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up packed in one matrix: SwiGLU, or GeGLU (Gemma)."""

    def __init__(self, cfg, traits: FamilyTraits, kernels: Kernels):
        super().__init__()
        bias = getattr(cfg, "mlp_bias", False)
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=bias)
        act = getattr(cfg, traits.activation_field, None) or "silu"
        if act not in ACTIVATIONS:
            raise ValueError(f"{traits.activation_field} {act!r} is not supported ({', '.join(ACTIVATIONS)})")
        self.act_and_mul = getattr(kernels, ACTIVATIONS[act])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm residual block. The residual stream travels beside x between layers, so that each
    norm that follows a residual add fuses it (RMSNorm with a residual: norm(x + r), x + r)."""

    def __init__(
        self,
        cfg,
        traits: FamilyTraits,
        kernels: Kernels,
        layer_type: str | None,
        window: int | None,
        max_model_len: int | None,
        layer_index: int = 0,
    ):
        super().__init__()
        eps, gemma = cfg.rms_norm_eps, traits.gemma
        self.self_attn = DecoderAttention(cfg, traits, kernels, layer_type, window, max_model_len)
        self.mlp: nn.Module  # the MLP kind of this layer: dense, or routed experts (MoE families' sparse layers)
        if is_moe_layer(cfg, traits.moe, layer_index):
            self.mlp = SparseMoeBlock(cfg, str(traits.moe), kernels)
        else:
            self.mlp = DecoderMLP(cfg, traits, kernels)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, kernels, unit_offset=gemma)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, kernels, unit_offset=gemma)
        self.sandwich = gemma
        if gemma:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, kernels, unit_offset=True)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, kernels, unit_offset=True)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (this layer's output, not yet added, and the residual stream it is to be added to)."""
        q, k, v, residual = self.before_attention(x, residual)
        return self.after_attention(self.self_attn.attend(positions, q, k, v, meta), residual)

    def before_attention(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The input norm (adding the previous layer's output to the residual stream) and q, k, v."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        q, k, v = self.self_attn.qkv(x)
        return q, k, v, residual

    def after_attention(self, o: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention output projected, the MLP: (its output, not yet added; the residual stream)."""
        x = self.self_attn.out(o)
        if not self.sandwich:  # Llama: post_attention_layernorm is the MLP's input norm
            x, residual = self.post_attention_layernorm(x, residual)
            return self.mlp(x), residual
        # Gemma: norm the attention output, add it, norm the MLP input; norm the MLP output
        x, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(x), residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class DecoderModel(nn.Module):
    embed_scale: torch.Tensor

    def __init__(
        self, cfg, traits: FamilyTraits, kernels: Kernels, windows: Sequence[int | None], max_model_len: int | None
    ):
        super().__init__()
        if len(windows) != cfg.num_hidden_layers:
            raise ValueError(f"{len(windows)} layer windows for {cfg.num_hidden_layers} layers")
        types = getattr(cfg, "layer_types", None) or [None] * cfg.num_hidden_layers
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, traits, kernels, types[i], windows[i], max_model_len, i)
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels, unit_offset=traits.gemma)
        # Gemma: the embedding is scaled by sqrt(hidden_size), rounded to the model's dtype as HF does
        self.scaled_embedding = traits.gemma
        self.register_buffer("embed_scale", torch.tensor(cfg.hidden_size**0.5, dtype=torch.float32), persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x, residual = self.embed(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        return self.final_norm(x, residual)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.scaled_embedding:
            x = x * self.embed_scale.to(x.dtype)
        return x

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        if residual is None:
            return self.norm(x)
        x, _ = self.norm(x, residual)
        return x


class DecoderForCausalLM(nn.Module):
    # checkpoint name -> (packed parameter name, shard id); a checkpoint that names the packed
    # parameters themselves (Phi-3's qkv_proj, gate_up_proj) is cut into these shards on load
    packed_modules: dict[str, tuple[str, int | str]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(
        self,
        cfg,
        traits: FamilyTraits,
        kernels: Kernels,
        windows: Sequence[int | None],
        max_model_len: int | None = None,
    ):
        """windows: each layer's attention window, None for full attention (registry.layer_windows);
        max_model_len: the engine's longest sequence (None: max_position_embeddings), which picks
        longrope's factors (model/rotary.py)."""
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, traits, kernels, windows, max_model_len)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.final_logit_soft_cap = getattr(cfg, "final_logit_softcapping", None) if traits.gemma else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states [T, hidden]."""
        return self.model(input_ids, positions, meta)

    def attention_layers(self) -> list[Attention]:
        return [m for m in self.modules() if isinstance(m, Attention)]

    @property
    def rotary_dim(self) -> int:
        """Dims of a head the rotary embedding turns (head_dim, or less with a partial rotary factor)."""
        return min(m.cos_sin_cache.shape[-1] for m in self.modules() if isinstance(m, RotaryEmbedding))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.final_logit_soft_cap
        if cap is not None:  # Gemma: c * tanh(logits / c), in the logits' dtype as HF
            logits = torch.tanh(logits / cap) * cap
        return logits
