"""Write new tokens' K/V into the paged cache through slot_mapping (Triton).

One program per token stores all KV heads of that token; a PAD_SLOT_ID slot (any negative
slot) is skipped.
key/value may be strided views of a fused qkv projection; only the last dim must be
contiguous. Reference: `attention_ref.store_kvcache_ref`.
"""

from __future__ import annotations

import torch

from pagedllm.ops._triton import HAS_TRITON, next_pow2, require_triton, tl, triton

if HAS_TRITON:

    @triton.jit
    def _store_kvcache_kernel(
        key_ptr,
        value_ptr,
        k_cache_ptr,
        v_cache_ptr,
        slot_ptr,
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
        tl.store(kc + offs_h[:, None] * stride_kch + offs_d[None, :], k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(vc + offs_h[:, None] * stride_vch + offs_d[None, :], v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kvcache(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """key/value: [N, Hkv, D]; caches: [num_blocks, Hkv, block_size, D]; a PAD_SLOT_ID (negative) slot is skipped."""
    require_triton()
    n, hkv, d = key.shape
    assert value.shape == key.shape and slot_mapping.shape[0] == n
    assert k_cache.shape[1] == hkv and k_cache.shape[3] == d and v_cache.shape == k_cache.shape
    assert d & (d - 1) == 0, "head_dim must be a power of two"
    for t in (key, value, k_cache, v_cache):
        assert t.stride(-1) == 1, "last dim must be contiguous"
    if n == 0:
        return
    _store_kvcache_kernel[(n,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
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
        num_warps=4 if hkv * d >= 1024 else 1,
    )
