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


def build_model(cfg, kernels: Kernels) -> DecoderForCausalLM:
    """The model for this config, running `kernels` (ops/kernels.py: kernels_for(device))."""
    return DecoderForCausalLM(cfg, resolve(cfg), kernels)
