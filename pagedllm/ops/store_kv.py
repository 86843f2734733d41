"""Write new tokens' K/V into the paged cache through slot_mapping (Triton).

One program per token stores all KV heads of that token; a PAD_SLOT_ID slot (any negative
slot) is skipped.
key/value may be strided views of a fused qkv projection; only the last dim must be
contiguous. Reference: `attention_ref.store_kvcache_ref`.

An fp8 cache (ops/kv_quant.py) is quantized on write exactly as `kv_quant.quantize_ref`:
x * inv_scale in float32 (the host passes `inv_scale_of(scale)`: no division in the kernel),
clamped to +-fp8_max, converted round-to-nearest-even. Other caches compile without that code
(FP8 is a constexpr) and store key/value converted to the cache dtype, as before.
"""

from __future__ import annotations

import torch

from pagedllm.ops._triton import HAS_TRITON, is_interpreted, next_pow2, require_triton, tl, triton
from pagedllm.ops.kv_quant import fp8_max, inv_scale_of, is_fp8

if HAS_TRITON:

    @triton.jit
    def _round_to_fp8_grid(x, MANT: tl.constexpr, EMIN: tl.constexpr):
        """float32 x (|x| <= the format's max) rounded to the nearest fp8 value, ties to even, still float32.

        Only for Triton's interpreter, whose float32 -> fp8 conversion truncates and then adds
        the first dropped bit without carrying into the exponent (triton 3.9: 124.3 -> 64, not
        128, in e4m3 and e5m2 alike); on a value already on the fp8 grid it is exact. Adding
        big = 2^(e - MANT + 23) to |x| (e: |x|'s exponent, at least EMIN, the smallest normal
        one) leaves float32 bits only at multiples of the fp8 spacing 2^(e - MANT) there, and
        float32 addition rounds to nearest even.
        """
        bits = x.to(tl.int32, bitcast=True)
        e = tl.maximum(((bits >> 23) & 0xFF) - 127, EMIN)
        big = ((e - MANT + 150) << 23).to(tl.float32, bitcast=True)
        r = ((tl.abs(x) + big) - big).to(tl.int32, bitcast=True)
        return (r | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)  # x's sign, -0.0 included

    @triton.jit
    def _to_cache(x, inv_scale, dst_ty: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr, EXACT: tl.constexpr):
        """x as the cache stores it: x in dst_ty, or for fp8 saturate(x * inv_scale) (= quantize_ref)."""
        if FP8:
            y = tl.clamp(x.to(tl.float32) * inv_scale, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
            if EXACT:
                if dst_ty == tl.float8e4nv:
                    y = _round_to_fp8_grid(y, 3, -6)
                else:
                    y = _round_to_fp8_grid(y, 2, -14)
            return y.to(dst_ty, fp_downcast_rounding="rtne")
        else:
            return x.to(dst_ty)

    @triton.jit
    def _store_kvcache_kernel(
        key_ptr,
        value_ptr,
        k_cache_ptr,
        v_cache_ptr,
        slot_ptr,
        inv_k_scale,
        inv_v_scale,
        stride_kn,
        stride_kh,
        stride_vn,
        stride_vh,
        stride_kcb,
        stride_kch,
        stride_kct,
        stride_vcb,
        stride_vch,
        stride_vct,
        num_heads,
        block_size,
        HEAD_DIM: tl.constexpr,
        BLOCK_H: tl.constexpr,
        FP8: tl.constexpr,
        FP8_MAX: tl.constexpr,
        EXACT: tl.constexpr,
    ):
        tok = tl.program_id(0)
        slot = tl.load(slot_ptr + tok).to(tl.int64)
        if slot < 0:  # PAD_SLOT_ID
            return
        blk = slot // block_size
        off = slot % block_size
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, HEAD_DIM)
        mask = (offs_h < num_heads)[:, None]
        tok64 = tok.to(tl.int64)
        k = tl.load(key_ptr + tok64 * stride_kn + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
        v = tl.load(value_ptr + tok64 * stride_vn + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
        kc = k_cache_ptr + blk * stride_kcb + off * stride_kct
        vc = v_cache_ptr + blk * stride_vcb + off * stride_vct
        k = _to_cache(k, inv_k_scale, k_cache_ptr.dtype.element_ty, FP8, FP8_MAX, EXACT)
        v = _to_cache(v, inv_v_scale, v_cache_ptr.dtype.element_ty, FP8, FP8_MAX, EXACT)
        tl.store(kc + offs_h[:, None] * stride_kch + offs_d[None, :], k, mask=mask)
        tl.store(vc + offs_h[:, None] * stride_vch + offs_d[None, :], v, mask=mask)


def store_kvcache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """key/value: [N, Hkv, D]; caches: [num_blocks, Hkv, block_size, D]; a PAD_SLOT_ID (negative) slot is skipped.
    An fp8 cache stores saturate(key / k_scale) and saturate(value / v_scale); other caches ignore the scales."""
    require_triton()
    n, hkv, d = key.shape
    assert value.shape == key.shape and slot_mapping.shape[0] == n
    assert k_cache.shape[1] == hkv and k_cache.shape[3] == d and v_cache.shape == k_cache.shape
    assert v_cache.dtype == k_cache.dtype
    assert d & (d - 1) == 0, "head_dim must be a power of two"
    for t in (key, value, k_cache, v_cache):
        assert t.stride(-1) == 1, "last dim must be contiguous"
    if n == 0:
        return
    fp8 = is_fp8(k_cache.dtype)
    _store_kvcache_kernel[(n,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        inv_scale_of(k_scale) if fp8 else 1.0,
        inv_scale_of(v_scale) if fp8 else 1.0,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        hkv,
        k_cache.shape[2],
        HEAD_DIM=d,
        BLOCK_H=next_pow2(hkv),
        FP8=fp8,
        FP8_MAX=fp8_max(k_cache.dtype) if fp8 else 0.0,
        EXACT=fp8 and is_interpreted(_store_kvcache_kernel),
        num_warps=4 if hkv * d >= 1024 else 1,
    )
