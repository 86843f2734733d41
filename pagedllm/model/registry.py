"""Architecture name (config.json "architectures") -> model class and its family traits, and the
checks that refuse, at start-up and naming the field, a config the decoder would not compute
exactly as HF transformers does."""

from __future__ import annotations

from pagedllm.model.decoder import ACTIVATIONS, DecoderForCausalLM, FamilyTraits
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
    if traits.gemma:
        for field in ("final_logit_softcapping", "attn_logit_softcapping"):
            cap = getattr(cfg, field, None)
            if cap is not None and not cap > 0:
                _refuse(field, cap, "a soft cap must be > 0 (or null: none)")


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
    built with it. Mistral and Phi-3 window every layer when sliding_window is set (HF's Mistral
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
