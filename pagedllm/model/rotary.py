"""Rotary position embedding (neox / rotate-half layout, as HF Llama, Qwen and Phi3) and the
rope scalings of HF transformers (modeling_rope_utils), reproduced in float32 op for op:
"default", "linear", "llama3", "yarn" and "longrope". The rotation itself is ops/fused_ref.py's
(its Triton kernel's on GPU); this file only builds the table it reads.

The table, cos_sin_cache [max_position, R]: row p holds cos(p * inv_freq) in [:R/2] and
sin(p * inv_freq) in [R/2:], both multiplied by the scaling's attention factor (yarn and
longrope; 1 otherwise), as HF multiplies its cos and sin. R = int(head_dim * partial_rotary_factor),
the factor read from the rope parameters (default 1.0): the first R dims of each head are
rotated, as HF Phi3 does (the Triton kernel needs R a power of two).

longrope has two sets of per-frequency factors, short_factor and long_factor. HF picks one per
forward, by the largest position in it (long iff it is past original_max_position_embeddings),
so in HF a sequence's cached keys depend on how it was batched and chunked. Here the choice is
made once, by the engine's max_model_len: long factors iff max_model_len >
original_max_position_embeddings. That is HF's result exactly whenever max_model_len <= original
(HF then always picks short), and for a prompt longer than the original length run in one forward
(HF picks long). It differs from HF, by design, when max_model_len is above the original length
for a sequence that stays within it (HF: short factors; here: long), and for the keys HF cached
with short factors before a sequence grew past the original length (here: long from the start).

"dynamic" (NTK) is refused: HF recomputes its frequencies per forward from the longest
sequence in that forward, which a paged engine cannot follow exactly. Every type not listed
above is refused too, with a ValueError naming it and the supported ones.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pagedllm.ops.kernels import Kernels

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def rope_type_of(scaling: dict | None) -> str:
    """The rope type a config's rope_parameters / rope_scaling names ("type" is the old spelling)."""
    scaling = scaling or {}
    return scaling.get("rope_type", scaling.get("type", "default"))


def check_rope_scaling(scaling: dict | None) -> None:
    """Raise ValueError, naming the type, unless this file reproduces it exactly (call it at start-up)."""
    kind = rope_type_of(scaling)
    if kind == "dynamic":
        raise ValueError(
            "rope_scaling rope_type 'dynamic' (NTK) is not supported: HF recomputes its frequencies per forward "
            "from the longest sequence in the batch, which a paged engine cannot reproduce exactly"
        )
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_scaling rope_type {kind!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )


def _llama3(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, theta: float, scaling: dict, max_position: int) -> tuple[torch.Tensor, float]:
    """YaRN: per frequency, a blend of the original (extrapolated) and the factor-interpolated
    frequency, ramping linearly between the dims that rotate beta_fast and beta_slow times over the
    original length; cos and sin scaled by the attention factor (from factor, or mscale/mscale_all_dim)."""
    original = scaling.get("original_max_position_embeddings") or max_position
    factor = scaling.get("factor")
    if factor is None:  # DeepSeek-style configs: the ratio of the lengths
        factor = max_position / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = float(_mscale(factor, mscale) / _mscale(factor, mscale_all_dim))
        else:
            attention_factor = _mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the dim that turns `rotations` times over the original length
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # weight of the original frequency (HF's order of operations, for the same bits)
    return interpolation * (1 - keep) + extrapolation * keep, attention_factor


def _longrope(
    dim: int, theta: float, scaling: dict, max_position: int, max_model_len: int
) -> tuple[torch.Tensor, float]:
    """LongRoPE: inv_freq / ext_factor per frequency, the long factors iff max_model_len is past the
    original length (module docstring); cos and sin scaled by sqrt(1 + ln(factor) / ln(original))."""
    original = scaling.get("original_max_position_embeddings") or max_position
    factor = scaling.get("factor")
    if factor is None:  # Phi3: the ratio of the lengths
        factor = max_position / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    name = "long_factor" if max_model_len > original else "short_factor"
    ext = scaling[name]
    if len(ext) != dim // 2:
        raise ValueError(f"rope_scaling {name} has {len(ext)} entries; the rotary dim {dim} needs {dim // 2}")
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (torch.tensor(ext, dtype=torch.float32) * theta**shape), attention_factor


def rope_frequencies(
    dim: int, max_position: int, theta: float, scaling: dict | None, max_model_len: int
) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim/2] fp32, attention factor) of the scaling, as HF's rope init functions compute them."""
    check_rope_scaling(scaling)
    kind = rope_type_of(scaling)
    if kind == "yarn":
        return _yarn(dim, theta, scaling or {}, max_position)
    if kind == "longrope":
        return _longrope(dim, theta, scaling or {}, max_position, max_model_len)
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if kind == "linear":
        return inv_freq / (scaling or {})["factor"], 1.0
    if kind == "llama3":
        return _llama3(inv_freq, scaling or {}), 1.0
    return inv_freq, 1.0


class RotaryEmbedding(nn.Module):
    cos_sin_cache: torch.Tensor

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        scaling: dict | None,
        kernels: Kernels,
        *,
        max_model_len: int | None = None,
    ):
        """max_model_len: the engine's longest sequence (None: max_position); it picks longrope's factors."""
        super().__init__()
        self.kernels = kernels
        dim = int(head_dim * (scaling or {}).get("partial_rotary_factor", 1.0))
        inv_freq, attention_factor = rope_frequencies(
            dim, max_position, theta, scaling, max_position if max_model_len is None else max_model_len
        )
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        # [max_position, dim]: cos in the first half, sin in the second (fp32), times the attention factor
        cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        if attention_factor != 1.0:
            cache = cache * attention_factor
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hkv, D] -> rotated (same dtype; on GPU rotated in place)."""
        return self.kernels.apply_rotary(q, k, self.cos_sin_cache, positions)
