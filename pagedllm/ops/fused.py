"""Fused elementwise kernels (Triton): RMSNorm (with the residual add; Gemma's (1 + w) form),
SiLU-and-mul, GELU(tanh)-and-mul, rotary.

Their torch references, with the rounding rules both follow, are in fused_ref.py.
"""

from __future__ import annotations

import torch

from pagedllm.ops._triton import HAS_TRITON, next_pow2, require_triton, tl, triton
from pagedllm.ops.fused_ref import apply_rotary_ref, gelu_tanh_and_mul_ref, rms_norm_ref, silu_and_mul_ref

# ----------------------------------------------------------------------------- kernels

if HAS_TRITON:

    @triton.jit
    def _rms_norm_kernel(
        x_ptr,
        res_ptr,
        w_ptr,
        out_ptr,
        new_res_ptr,
        n_cols,
        eps,
        stride_x,
        stride_r,
        stride_o,
        stride_nr,
        HAS_RESIDUAL: tl.constexpr,
        UNIT_OFFSET: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(new_res_ptr + row * stride_nr + cols, x, mask=mask)
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, 0) / n_cols
        normed = xf * tl.math.rsqrt(var + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if UNIT_OFFSET:  # Gemma: scale by (1 + w) in fp32, one rounding
            out = normed * (1.0 + w)
        else:  # Llama: round the normalised x to the input dtype, then scale
            out = normed.to(x_ptr.dtype.element_ty).to(tl.float32) * w
        tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_and_mul_kernel(x_ptr, out_ptr, n_cols, stride_x, stride_o, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        a = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        y = a / (1.0 + tl.exp(-a)) * b
        tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _gelu_tanh_and_mul_kernel(x_ptr, out_ptr, n_cols, stride_x, stride_o, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        a = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        # gelu_tanh(a) = a * (1 + tanh(u)) / 2 = a * sigmoid(2u), u = sqrt(2/pi) * (a + 0.044715 a^3);
        # the sigmoid from e = exp(-|2u|) <= 1, which never overflows
        u = 0.7978845608028654 * (a + 0.044715 * a * a * a)
        e = tl.exp(-2.0 * tl.abs(u))
        y = a * tl.where(u >= 0, 1.0 / (1.0 + e), e / (1.0 + e)) * b
        tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rotate_heads(x_ptr, tok, stride_t, stride_h, n_heads, cos, sin, BLOCK_H: tl.constexpr, HALF: tl.constexpr):
        offs_h = tl.arange(0, BLOCK_H)
        offs_r = tl.arange(0, HALF)
        mask = (offs_h < n_heads)[:, None]
        p1 = x_ptr + tok * stride_t + offs_h[:, None] * stride_h + offs_r[None, :]
        p2 = p1 + HALF
        x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
        tl.store(p1, (x1 * cos[None, :] - x2 * sin[None, :]).to(x_ptr.dtype.element_ty), mask=mask)
        tl.store(p2, (x2 * cos[None, :] + x1 * sin[None, :]).to(x_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rotary_kernel(
        q_ptr,
        k_ptr,
        cache_ptr,
        pos_ptr,
        stride_qt,
        stride_qh,
        stride_kt,
        stride_kh,
        stride_c,
        n_q_heads,
        n_k_heads,
        HALF: tl.constexpr,
        BLOCK_HQ: tl.constexpr,
        BLOCK_HK: tl.constexpr,
    ):
        tok = tl.program_id(0).to(tl.int64)
        pos = tl.load(pos_ptr + tok).to(tl.int64)
        offs_r = tl.arange(0, HALF)
        cos = tl.load(cache_ptr + pos * stride_c + offs_r).to(tl.float32)
        sin = tl.load(cache_ptr + pos * stride_c + HALF + offs_r).to(tl.float32)
        _rotate_heads(q_ptr, tok, stride_qt, stride_qh, n_q_heads, cos, sin, BLOCK_HQ, HALF)
        _rotate_heads(k_ptr, tok, stride_kt, stride_kh, n_k_heads, cos, sin, BLOCK_HK, HALF)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    unit_offset: bool = False,
):
    """RMSNorm over the last dim (unit_offset: scaled by 1 + weight, Gemma's form); with
    residual, fused add: returns (out, x + residual)."""
    require_triton()
    h = x.shape[-1]
    x2 = x.reshape(-1, h)
    assert x2.stride(-1) == 1 and weight.is_contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    rows = x2.shape[0]
    if residual is not None:
        r2 = residual.reshape(-1, h)
        assert r2.stride(-1) == 1
        new_res = torch.empty_like(out)
    else:
        r2 = new_res = x2
    if rows:
        block = next_pow2(h)
        _rms_norm_kernel[(rows,)](
            x2,
            r2,
            weight,
            out,
            new_res,
            h,
            float(eps),
            x2.stride(0),
            r2.stride(0),
            out.stride(0),
            new_res.stride(0),
            HAS_RESIDUAL=residual is not None,
            UNIT_OFFSET=unit_offset,
            BLOCK=block,
            num_warps=min(16, max(1, block // 256)),
        )
    out = out.view(x.shape)
    return out if residual is None else (out, new_res.view(x.shape))


def _act_and_mul(kernel, x: torch.Tensor) -> torch.Tensor:
    require_triton()
    two_i = x.shape[-1]
    i = two_i // 2
    x2 = x.reshape(-1, two_i)
    assert x2.stride(-1) == 1
    out = torch.empty((x2.shape[0], i), dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block = min(1024, next_pow2(i))
        kernel[(x2.shape[0], triton.cdiv(i, block))](x2, out, i, x2.stride(0), out.stride(0), BLOCK=block, num_warps=4)
    return out.view(*x.shape[:-1], i)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2*I] -> silu(x[..., :I]) * x[..., I:] in x's dtype (fp32 math)."""
    return _act_and_mul(_silu_and_mul_kernel, x)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2*I] -> gelu_tanh(x[..., :I]) * x[..., I:] in x's dtype (fp32 math; GeGLU)."""
    return _act_and_mul(_gelu_tanh_and_mul_kernel, x)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor, positions: torch.Tensor, head_dim: int | None = None
):
    """Neox rotary applied IN PLACE to q and k; returns (q, k).

    q: [T, Hq, D] or [T, Hq*D] (then head_dim, default the cache's rotary dim), k likewise;
    may be strided views of a fused qkv output (last dim contiguous).
    cos_sin_cache: [max_pos, R], cos in [:R/2], sin in [R/2:]; R <= D, power of two.
    """
    require_triton()
    rot = cos_sin_cache.shape[-1]
    d = q.shape[-1] if q.dim() == 3 else (head_dim or rot)
    q3 = q if q.dim() == 3 else q.view(q.shape[0], -1, d)
    k3 = k if k.dim() == 3 else k.view(k.shape[0], -1, d)
    assert rot <= d and rot & (rot - 1) == 0 and rot >= 2
    assert q3.stride(-1) == 1 and k3.stride(-1) == 1 and cos_sin_cache.stride(-1) == 1
    t = q3.shape[0]
    if t:
        _rotary_kernel[(t,)](
            q3,
            k3,
            cos_sin_cache,
            positions,
            q3.stride(0),
            q3.stride(1),
            k3.stride(0),
            k3.stride(1),
            cos_sin_cache.stride(0),
            q3.shape[1],
            k3.shape[1],
            HALF=rot // 2,
            BLOCK_HQ=next_pow2(q3.shape[1]),
            BLOCK_HK=next_pow2(k3.shape[1]),
            num_warps=4,
        )
    return q, k


__all__ = [
    "rms_norm",
    "rms_norm_ref",
    "silu_and_mul",
    "silu_and_mul_ref",
    "gelu_tanh_and_mul",
    "gelu_tanh_and_mul_ref",
    "apply_rotary",
    "apply_rotary_ref",
]
