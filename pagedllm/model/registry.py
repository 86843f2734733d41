"""Architecture name (config.json "architectures") -> model class and its family traits."""

from __future__ import annotations

from pagedllm.model.decoder import DecoderForCausalLM, FamilyTraits
from pagedllm.ops.kernels import Kernels

_REGISTRY: dict[str, FamilyTraits] = {
    "Qwen3ForCausalLM": FamilyTraits(qk_norm=True),
    "Qwen2ForCausalLM": FamilyTraits(qkv_bias=True),
    "LlamaForCausalLM": FamilyTraits(),
    "MistralForCausalLM": FamilyTraits(),
}

SUPPORTED_ARCHITECTURES = sorted(_REGISTRY)


def resolve(cfg) -> FamilyTraits:
    archs = list(getattr(cfg, "architectures", None) or [])
    for arch in archs:
        if arch in _REGISTRY:
            return _REGISTRY[arch]
    raise ValueError(
        f"unsupported architecture {archs or '(none in config.json)'}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def sliding_window_of(cfg) -> int | None:
    """The attention window some layer of this config uses, or None when every layer attends to
    its whole context. `layer_types` ("sliding_attention") where the config has it; else Qwen2's
    `use_sliding_window`; else (Mistral) a set `sliding_window` applies to every layer."""
    window = getattr(cfg, "sliding_window", None)
    if not window:
        return None
    types = getattr(cfg, "layer_types", None)
    if types is not None:
        return int(window) if "sliding_attention" in types else None
    if hasattr(cfg, "use_sliding_window"):
        return int(window) if cfg.use_sliding_window else None
    return int(window)


def layer_windows(cfg) -> list[int | None]:
    """Each decoder layer's attention window (None: full attention), in model order: the KV-cache
    groups come from it (engine/kv_cache_groups.py), and each layer's Attention is built with it."""
    window = sliding_window_of(cfg)
    n = cfg.num_hidden_layers
    if window is None:
        return [None] * n
    types = getattr(cfg, "layer_types", None)
    if types is not None:
        return [window if t == "sliding_attention" else None for t in types]
    return [window] * n


def check_window(cfg, max_model_len: int) -> None:
    """ValueError naming `sliding_window` when a windowed layer could see a key outside its window:
    the paged attention kernels attend to the whole context (per-layer windows: issue 16), which
    within max_model_len <= window is exactly the windowed result (no key is ever outside it)."""
    window = sliding_window_of(cfg)
    if window is not None and max_model_len > window:
        raise ValueError(
            f"the model's config.json sets sliding_window={window} (layers attend to the last {window} tokens "
            f"only), which pagedllm does not implement yet: past {window} tokens it would compute other tokens "
            f"than the model. Run it with max_model_len <= {window} (exact: no key is ever outside the window)"
        )


def build_model(cfg, kernels: Kernels) -> DecoderForCausalLM:
    """The model for this config, running `kernels` (ops/kernels.py: kernels_for(device))."""
    return DecoderForCausalLM(cfg, resolve(cfg), kernels)
