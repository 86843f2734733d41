"""The attention block's work between the QKV projection and attention, in one Triton launch:
per token, RMSNorm of every q and k head (optional: Qwen3, Gemma 3), neox rotary of the first
R dims of each q and k head (q and k rewritten in place), and the store of that k and v into
the paged KV cache at slot_mapping[token].

It replaces four launches per layer (two `_rms_norm_kernel`s, each after a copy that
`reshape` makes of the strided q or k view, `_rotary_kernel`, `_store_kvcache_kernel`) and
their host-side Python. Its arithmetic is theirs, step for step: the norm's statistics over
the whole head in one fp32 sum, the normed head rounded to the activation dtype (Llama form:
rounded before and after the weight, Gemma's unit_offset form once, after (1 + w)), the
rotation in fp32 of those rounded values and rounded once more, the store converting that
rounded k (and v) to the cache format with store_kv's `_to_cache`. The torch reference is
the same composition of the references (`TorchKernels.prepare_qkv`).

Grid: one program per (token, head) over Hq + Hkv heads: programs below Hq take a q head,
the others a k head and the v head of the same index. At decode batch 1 there is one token,
and a program per token would put all 24 heads of the Qwen3-0.6B shape (16 q + 8 k, 128
dims) on one SM in sequence; a program per head spreads them over 24 SMs, each a single warp
with the 128-element reduction laid out as `_rms_norm_kernel`'s (same block, same warps), so
the sums, and the bits, are the same. At prefill sizes the grid is T x 24 small programs,
still one launch.
"""

from __future__ import annotations

import torch

from pagedllm.ops._triton import HAS_TRITON, is_interpreted, require_triton, tl, triton
from pagedllm.ops.kv_quant import fp8_max, inv_scale_of, is_fp8

if HAS_TRITON:
    from pagedllm.ops.store_kv import _to_cache

    @triton.jit
    def _norm_rotate_head(
        x_ptr,
        w_ptr,
        cos,
        sin,
        eps,
        HEAD_DIM: tl.constexpr,
        ROT: tl.constexpr,
        QK_NORM: tl.constexpr,
        UNIT_OFFSET: tl.constexpr,
    ):
        """Norm (if QK_NORM) and rotate one head at x_ptr in place; returns its first and second
        rotated halves and the whole normed head (in x's dtype; the tail past ROT is read there)."""
        dt = x_ptr.dtype.element_ty
        HALF: tl.constexpr = ROT // 2
        offs_r = tl.arange(0, HALF)
        cols = tl.arange(0, HEAD_DIM)
        full = tl.load(x_ptr + cols)
        x1 = tl.load(x_ptr + offs_r)
        x2 = tl.load(x_ptr + HALF + offs_r)
        if QK_NORM:
            xf = full.to(tl.float32)
            rstd = tl.math.rsqrt(tl.sum(xf * xf, 0) / HEAD_DIM + eps)
            w = tl.load(w_ptr + cols).to(tl.float32)
            w1 = tl.load(w_ptr + offs_r).to(tl.float32)
            w2 = tl.load(w_ptr + HALF + offs_r).to(tl.float32)
            if UNIT_OFFSET:  # Gemma: (1 + w) in fp32, one rounding
                full = (xf * rstd * (1.0 + w)).to(dt)
                x1 = (x1.to(tl.float32) * rstd * (1.0 + w1)).to(dt)
                x2 = (x2.to(tl.float32) * rstd * (1.0 + w2)).to(dt)
            else:  # Llama: round the normalised x, then scale by w and round again
                full = ((xf * rstd).to(dt).to(tl.float32) * w).to(dt)
                x1 = ((x1.to(tl.float32) * rstd).to(dt).to(tl.float32) * w1).to(dt)
                x2 = ((x2.to(tl.float32) * rstd).to(dt).to(tl.float32) * w2).to(dt)
            if ROT < HEAD_DIM:  # the unrotated tail is written normed
                tl.store(x_ptr + cols, full, mask=cols >= ROT)
        f1 = x1.to(tl.float32)
        f2 = x2.to(tl.float32)
        o1 = (f1 * cos - f2 * sin).to(dt)
        o2 = (f2 * cos + f1 * sin).to(dt)
        tl.store(x_ptr + offs_r, o1)
        tl.store(x_ptr + HALF + offs_r, o2)
        return o1, o2, full

    @triton.jit
    def _prepare_qkv_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        qw_ptr,
        kw_ptr,
        cos_sin_ptr,
        pos_ptr,
        slot_ptr,
        k_cache_ptr,
        v_cache_ptr,
        inv_k_scale,
        inv_v_scale,
        eps,
        stride_qt,
        stride_qh,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_c,
        stride_kcb,
        stride_kch,
        stride_kct,
        stride_vcb,
        stride_vch,
        stride_vct,
        n_q_heads,
        block_size,
        HEAD_DIM: tl.constexpr,
        ROT: tl.constexpr,
        QK_NORM: tl.constexpr,
        UNIT_OFFSET: tl.constexpr,
        HAS_CACHE: tl.constexpr,
        FP8: tl.constexpr,
        FP8_MAX: tl.constexpr,
        EXACT: tl.constexpr,
    ):
        tok = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        HALF: tl.constexpr = ROT // 2
        offs_r = tl.arange(0, HALF)
        pos = tl.load(pos_ptr + tok).to(tl.int64)
        cos = tl.load(cos_sin_ptr + pos * stride_c + offs_r).to(tl.float32)
        sin = tl.load(cos_sin_ptr + pos * stride_c + HALF + offs_r).to(tl.float32)
        if head < n_q_heads:
            _norm_rotate_head(
                q_ptr + tok * stride_qt + head * stride_qh, qw_ptr, cos, sin, eps, HEAD_DIM, ROT, QK_NORM, UNIT_OFFSET
            )
        else:
            kh = (head - n_q_heads).to(tl.int64)
            k1, k2, k_full = _norm_rotate_head(
                k_ptr + tok * stride_kt + kh * stride_kh, kw_ptr, cos, sin, eps, HEAD_DIM, ROT, QK_NORM, UNIT_OFFSET
            )
            if HAS_CACHE:
                slot = tl.load(slot_ptr + tok).to(tl.int64)
                if slot >= 0:  # not PAD_SLOT_ID
                    blk = slot // block_size
                    off = slot % block_size
                    cols = tl.arange(0, HEAD_DIM)
                    kc = k_cache_ptr + blk * stride_kcb + kh * stride_kch + off * stride_kct
                    vc = v_cache_ptr + blk * stride_vcb + kh * stride_vch + off * stride_vct
                    kty = k_cache_ptr.dtype.element_ty
                    tl.store(kc + offs_r, _to_cache(k1, inv_k_scale, kty, FP8, FP8_MAX, EXACT))
                    tl.store(kc + HALF + offs_r, _to_cache(k2, inv_k_scale, kty, FP8, FP8_MAX, EXACT))
                    if ROT < HEAD_DIM:
                        tail = _to_cache(k_full, inv_k_scale, kty, FP8, FP8_MAX, EXACT)
                        tl.store(kc + cols, tail, mask=cols >= ROT)
                    v = tl.load(v_ptr + tok * stride_vt + kh * stride_vh + cols)
                    tl.store(vc + cols, _to_cache(v, inv_v_scale, v_cache_ptr.dtype.element_ty, FP8, FP8_MAX, EXACT))


def prepare_qkv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    unit_offset: bool,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k/v [T, Hkv, D] (strided views allowed, last dim contiguous): q and k
    normed per head (weights given) and rotated IN PLACE, k and v stored at slot_mapping
    (negative slots skipped; nothing stored when k_cache is empty). Returns (q, k)."""
    require_triton()
    t, hq, d = q.shape
    hkv = k.shape[1]
    rot = cos_sin_cache.shape[-1]
    qk_norm = q_norm_weight is not None
    assert (k_norm_weight is not None) == qk_norm, "q and k norm weights: both or neither"
    assert k.shape == v.shape == (t, hkv, d) and positions.shape[0] == t
    assert d & (d - 1) == 0 and rot & (rot - 1) == 0 and 2 <= rot <= d, "head_dim and rotary dim: powers of two"
    for x in (q, k, v, cos_sin_cache):
        assert x.stride(-1) == 1, "last dim must be contiguous"
    has_cache = k_cache.numel() > 0
    if has_cache:
        assert slot_mapping.shape[0] == t and k_cache.shape[1] == hkv and k_cache.shape[3] == d
        assert v_cache.shape == k_cache.shape and v_cache.dtype == k_cache.dtype
        assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    if qk_norm:
        assert q_norm_weight is not None and k_norm_weight is not None  # for mypy
        assert q_norm_weight.shape == (d,) and k_norm_weight.shape == (d,)
        assert q_norm_weight.is_contiguous() and k_norm_weight.is_contiguous()
    if t == 0:
        return q, k
    fp8 = has_cache and is_fp8(k_cache.dtype)
    cache_strides = (*k_cache.stride()[:3], *v_cache.stride()[:3]) if has_cache else (0,) * 6
    _prepare_qkv_kernel[(t, hq + hkv)](
        q,
        k,
        v,
        q_norm_weight if qk_norm else q,  # unread without QK_NORM
        k_norm_weight if qk_norm else k,
        cos_sin_cache,
        positions,
        slot_mapping if has_cache else positions,  # unread without HAS_CACHE
        k_cache if has_cache else k,
        v_cache if has_cache else v,
        inv_scale_of(k_scale) if fp8 else 1.0,
        inv_scale_of(v_scale) if fp8 else 1.0,
        float(eps),
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos_sin_cache.stride(0),
        *cache_strides,
        hq,
        k_cache.shape[2] if has_cache else 1,
        HEAD_DIM=d,
        ROT=rot,
        QK_NORM=qk_norm,
        UNIT_OFFSET=unit_offset,
        HAS_CACHE=has_cache,
        FP8=fp8,
        FP8_MAX=fp8_max(k_cache.dtype) if fp8 else 0.0,
        EXACT=fp8 and is_interpreted(_prepare_qkv_kernel),
        num_warps=min(16, max(1, d // 256)),  # _rms_norm_kernel's, for its reduction layout
    )
    return q, k
