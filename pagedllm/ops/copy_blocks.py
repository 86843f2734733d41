"""Copy whole KV blocks (every layer, K and V) from src ids to dst ids: the copy-on-write copies
of a step, done in one launch before its forward.

The KV tensor is the runner's one allocation, [2, layers, num_blocks, kv_heads, block_size,
head_dim], contiguous: block b of (K or V, layer l) is one contiguous run of
kv_heads * block_size * head_dim elements. Triton kernel: program (pair, K/V x layer, tile)
copies one tile of that run. Reference: `copy_blocks_ref` (index_select + index_copy_), what
the CPU path runs.

An fp8 KV tensor is copied through its uint8 view (`kv_quant.bytes_view`): the same bytes, and
CPU torch has no index_copy_ for float8. Its scales are per layer, not per block: nothing else to copy.

Precondition (the scheduler's copy-on-write gives it): the dst ids are distinct and no dst is
also a src of the same call, so the copies are independent and their order does not matter.
"""

from __future__ import annotations

import torch

from pagedllm.ops._triton import HAS_TRITON, require_triton, tl, triton
from pagedllm.ops.kv_quant import bytes_view

TILE = 1024  # elements per program

if HAS_TRITON:

    @triton.jit
    def _copy_blocks_kernel(kv_ptr, src_ptr, dst_ptr, num_blocks, block_numel, TILE: tl.constexpr):
        pair = tl.program_id(0)
        plane = tl.program_id(1).to(tl.int64)  # (K or V) * layers + layer
        tile = tl.program_id(2)
        src = tl.load(src_ptr + pair).to(tl.int64)
        dst = tl.load(dst_ptr + pair).to(tl.int64)
        offs = tile * TILE + tl.arange(0, TILE)
        mask = offs < block_numel
        base = plane * num_blocks
        x = tl.load(kv_ptr + (base + src) * block_numel + offs, mask=mask)
        tl.store(kv_ptr + (base + dst) * block_numel + offs, x, mask=mask)


def _check(kv: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    assert kv.dim() == 6 and kv.shape[0] == 2, "kv: [2, layers, num_blocks, kv_heads, block_size, head_dim]"
    assert src.shape == dst.shape and src.dim() == 1
    assert src.dtype == dst.dtype == torch.int64


def copy_blocks_ref(kv: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """kv[:, :, dst[i]] = kv[:, :, src[i]] for every i, in place; src, dst: [P] int64 block ids."""
    _check(kv, src, dst)
    kv = bytes_view(kv)
    kv.index_copy_(2, dst, kv.index_select(2, src))


def copy_blocks(kv: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """The Triton kernel of copy_blocks_ref: one launch for all pairs, queued on the current stream."""
    require_triton()
    _check(kv, src, dst)
    assert kv.is_contiguous()
    kv = bytes_view(kv)
    n = src.numel()
    if n == 0:
        return
    block_numel = kv.shape[3] * kv.shape[4] * kv.shape[5]
    grid = (n, kv.shape[0] * kv.shape[1], triton.cdiv(block_numel, TILE))
    _copy_blocks_kernel[grid](kv, src, dst, kv.shape[2], block_numel, TILE=TILE, num_warps=4)
