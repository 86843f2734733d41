"""Torch references of the fused elementwise kernels (fused.py): what the CPU path runs, and
the oracle the kernel tests compare against. Plain torch: importing this never imports triton.

Rounding follows HF transformers, so a model built on these matches HF:
- RMSNorm (Llama/Qwen): residual add rounded to x.dtype first; normalise in fp32; round to
  x.dtype; then multiply by the weight (in fp32, rounded once to x.dtype).
- RMSNorm with unit_offset (Gemma): the checkpoint stores w and the scale is (1 + w); residual
  add rounded as above; normalise and scale in fp32, one rounding at the end.
- SiLU-and-mul, GELU(tanh)-and-mul: fp32 math, one rounding at the end.
- Rotary (neox / rotate-half): fp32 math, one rounding per element.
"""

from __future__ import annotations

import torch


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    unit_offset: bool = False,
):
    """out = weight * normalise(x [+ residual]) (unit_offset: (1 + weight) * ..., Gemma's form);
    with residual returns (out, x + residual)."""
    if residual is not None:
        x = (x.float() + residual.float()).to(x.dtype)
        new_residual = x
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        out = (normed * (1.0 + weight.float())).to(x.dtype)
    else:
        out = (normed.to(x.dtype).float() * weight.float()).to(x.dtype)
    return out if residual is None else (out, new_residual)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2*I] -> silu(x[..., :I]) * x[..., I:]."""
    i = x.shape[-1] // 2
    a, b = x[..., :i].float(), x[..., i:].float()
    return (torch.nn.functional.silu(a) * b).to(x.dtype)


def gelu_tanh_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2*I] -> gelu_tanh(x[..., :I]) * x[..., I:] (GeGLU; HF's gelu_pytorch_tanh)."""
    i = x.shape[-1] // 2
    a, b = x[..., :i].float(), x[..., i:].float()
    return (torch.nn.functional.gelu(a, approximate="tanh") * b).to(x.dtype)


def _rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, H, D]; cos/sin: [T, 1, R/2] with R = rotary dim <= D
    half = cos.shape[-1]
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half : 2 * half]
    out = xf.clone()
    out[..., :half] = x1 * cos - x2 * sin
    out[..., half : 2 * half] = x2 * cos + x1 * sin
    return out.to(x.dtype)


def apply_rotary_ref(
    q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor, positions: torch.Tensor, head_dim: int | None = None
):
    """Neox-style rotary. q: [T, Hq, D] or [T, Hq*D]; k likewise; returns new (q, k).

    cos_sin_cache: [max_pos, R] with cos in [:R/2] and sin in [R/2:]; the first R <= D
    dims of each head are rotated (rotate-half over those R dims). For 2-D inputs D is
    head_dim, default R.
    """
    rot = cos_sin_cache.shape[-1]
    cs = cos_sin_cache[positions.long()].float()
    cos, sin = cs[:, None, : rot // 2], cs[:, None, rot // 2 :]
    d = q.shape[-1] if q.dim() == 3 else (head_dim or rot)

    def one(x):
        x3 = x if x.dim() == 3 else x.reshape(x.shape[0], -1, d)
        return _rotate_ref(x3, cos, sin).reshape(x.shape)

    return one(q), one(k)
