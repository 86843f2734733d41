"""Architecture name (config.json "architectures") -> model class and its family traits, and the
checks that refuse, at start-up and naming the field, a config the decoder would not compute
exactly as HF transformers does."""

from __future__ import annotations

from pagedllm.model.decoder import ACTIVATIONS, DecoderForCausalLM, FamilyTraits
from pagedllm.model.moe import num_experts_of
from pagedllm.model.quant_config import read_quant_config
from pagedllm.model.rotary import check_rope_scaling
from pagedllm.ops.kernels import Kernels

_REGISTRY: dict[str, FamilyTraits] = {
    "Qwen3ForCausalLM": FamilyTraits(qk_norm=True, windows="layer_types"),
    "Qwen2ForCausalLM": FamilyTraits(qkv_bias=True, windows="layer_types"),
    "LlamaForCausalLM": FamilyTraits(),
    "MistralForCausalLM": FamilyTraits(windows="all"),
    "Phi3ForCausalLM": FamilyTraits(windows="all", partial_rotary=True),
    "Gemma2ForCausalLM": FamilyTraits(
        gemma=True, attn_soft_cap=True, windows="layer_types", activation_field="hidden_activation"
    ),
    "Gemma3ForCausalLM": FamilyTraits(
        gemma=True, qk_norm=True, windows="layer_types", activation_field="hidden_activation"
    ),
    # HF's Qwen3-MoE and Mixtral window every layer when sliding_window is set (Qwen3-MoE's config
    # clears it unless use_sliding_window)
    "Qwen3MoeForCausalLM": FamilyTraits(qk_norm=True, windows="all", moe="qwen3_moe"),
    "MixtralForCausalLM": FamilyTraits(windows="all", moe="mixtral"),
}

SUPPORTED_ARCHITECTURES = sorted(_REGISTRY)
LAYER_TYPES = ("full_attention", "sliding_attention")


def resolve(cfg) -> FamilyTraits:
    """The traits of the config's architecture; ValueError, naming the field, for an
    architecture or a variant of one the decoder does not run exactly (check_supported)."""
    archs = list(getattr(cfg, "architectures", None) or [])
    for arch in archs:
        if arch in _REGISTRY:
            traits = _REGISTRY[arch]
            check_supported(cfg, traits)
            return traits
    raise ValueError(
        f"unsupported architecture {archs or '(none in config.json)'}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _refuse(field: str, value, why: str) -> None:
    raise ValueError(f"the model's config.json sets {field}={value!r}: {why}; pagedllm cannot run it exactly")


def _rope_dicts(cfg) -> list[dict]:
    params = getattr(cfg, "rope_parameters", None) or {}
    nested = [v for v in params.values() if isinstance(v, dict)]  # keyed by layer kind (Gemma 3)
    return nested or [params]


def check_supported(cfg, traits: FamilyTraits) -> None:
    """Refuse what the decoder would compute differently from HF: the activation, rope scaling
    types (model/rotary.py), partial rotary outside Phi-3 (HF's other families' default rope
    ignores partial_rotary_factor, their scaled ropes break on it), attention variants (chunked,
    bidirectional, layer kinds other than full and sliding)."""
    read_quant_config(cfg)  # a quantized checkpoint: refused naming the field unless it is an FP8 one pagedllm loads
    act = getattr(cfg, traits.activation_field, None) or "silu"
    if act not in ACTIVATIONS:
        _refuse(traits.activation_field, act, f"supported activations: {', '.join(ACTIVATIONS)}")
    for params in _rope_dicts(cfg):
        check_rope_scaling(params)
        factor = params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
        if not traits.partial_rotary and factor is not None and float(factor) != 1.0:
            _refuse("partial_rotary_factor", factor, "this family rotates the whole head (Phi-3 alone rotates part)")
    if getattr(cfg, "attention_chunk_size", None):
        _refuse("attention_chunk_size", cfg.attention_chunk_size, "chunked attention is not implemented")
    if getattr(cfg, "use_bidirectional_attention", None):
        _refuse("use_bidirectional_attention", True, "only causal attention is implemented")
    if traits.windows == "layer_types":
        _check_layer_types(cfg)
    if traits.moe is not None:
        _check_moe(cfg, traits.moe)
    if traits.gemma:
        for field in ("final_logit_softcapping", "attn_logit_softcapping"):
            cap = getattr(cfg, field, None)
            if cap is not None and not cap > 0:
                _refuse(field, cap, "a soft cap must be > 0 (or null: none)")


# routing variants of other MoE families that the router here (softmax top-k, model/moe.py) does not
# compute: field -> the value that means "not used"
_MOE_VARIANTS: dict[str, object] = {
    "n_group": 1,  # grouped top-k (DeepSeek-V3): experts chosen within the best groups
    "topk_group": 1,
    "shared_expert_intermediate_size": 0,  # Qwen2-MoE: a gated shared expert beside the routed ones
    "n_shared_experts": 0,
    "num_shared_experts": 0,
    "routed_scaling_factor": 1.0,
    "topk_method": "greedy",
    "scoring_func": "softmax",
    "moe_layer_freq": 1,
    "first_k_dense_replace": 0,
}


def _check_moe(cfg, kind: str) -> None:
    """The MoE families' routing as HF computes it and nothing else. router_jitter_noise is
    accepted: HF's Mixtral applies it in training only."""
    for field, unused in _MOE_VARIANTS.items():
        value = getattr(cfg, field, None)
        if value is not None and value != unused:
            _refuse(field, value, "this routing variant is not implemented (softmax top-k routing only)")
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        _refuse("hidden_act", act, "the experts' kernel computes SiLU(gate) * up only")
    experts_field = "num_experts" if kind == "qwen3_moe" else "num_local_experts"
    experts = num_experts_of(cfg)
    top_k = getattr(cfg, "num_experts_per_tok", None)
    if experts and not (isinstance(top_k, int) and 1 <= top_k <= experts):
        _refuse("num_experts_per_tok", top_k, f"a token takes between 1 and {experts_field}={experts} experts")
    if kind == "mixtral" and experts < 1:
        _refuse(experts_field, experts, "a mixture of experts needs at least one expert")
    step = getattr(cfg, "decoder_sparse_step", 1)
    if kind == "qwen3_moe" and not (isinstance(step, int) and step >= 1):
        _refuse("decoder_sparse_step", step, "every step-th layer is sparse: a positive integer")


def _check_layer_types(cfg) -> None:
    n = cfg.num_hidden_layers
    types = getattr(cfg, "layer_types", None)
    if types is None:
        if getattr(cfg, "sliding_window", None):
            _refuse("sliding_window", cfg.sliding_window, "no layer_types say which layers it applies to")
        return
    if len(types) != n:
        _refuse("layer_types", f"[{len(types)} entries]", f"the model has num_hidden_layers={n}")
    for t in types:
        if t not in LAYER_TYPES:
            _refuse("layer_types", t, f"supported layer kinds: {', '.join(LAYER_TYPES)}")
    pattern = getattr(cfg, "sliding_window_pattern", None)  # Gemma's older way of saying layer_types
    if pattern:
        implied = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
        if list(types) != implied:
            _refuse("sliding_window_pattern", pattern, "it disagrees with the config's layer_types")


def layer_windows(cfg) -> list[int | None]:
    """Each decoder layer's attention window (None: full attention), in model order, as HF applies
    it: the KV-cache groups come from it (engine/kv_cache_groups.py), and each layer's Attention is
    built with it. Mistral, Phi-3, Mixtral and Qwen3-MoE window every layer when sliding_window is set (HF's Mistral
    ignores layer_types); Qwen2/3 and Gemma the layers config.layer_types names
    "sliding_attention" (Qwen2's config builds it from use_sliding_window and max_window_layers:
    sliding from layer max_window_layers on); Llama never."""
    traits = resolve(cfg)
    n = cfg.num_hidden_layers
    window = getattr(cfg, "sliding_window", None)
    if traits.windows == "none" or not window:
        return [None] * n
    if not isinstance(window, int) or window < 1:
        _refuse("sliding_window", window, "a window is a positive number of tokens")
    if traits.windows == "all":
        return [window] * n
    return [window if t == "sliding_attention" else None for t in cfg.layer_types]


def sliding_window_of(cfg) -> int | None:
    """The attention window some layer of this config uses, or None when every layer attends to
    its whole context."""
    windows = [w for w in layer_windows(cfg) if w is not None]
    return max(windows) if windows else None


def build_model(cfg, kernels: Kernels, max_model_len: int | None = None) -> DecoderForCausalLM:
    """The model for this config, running `kernels` (ops/kernels.py: kernels_for(device));
    max_model_len: the engine's (None: max_position_embeddings), which picks longrope's factors."""
    return DecoderForCausalLM(cfg, resolve(cfg), kernels, layer_windows(cfg), max_model_len)
