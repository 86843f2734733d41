"""Block-wise FP8 linear layers (Qwen3-*-FP8, DeepSeek-V3: weights with one scale per block).

- Weights: e4m3 Wq [N, K] with one float32 multiplier per [bn, bk] block, w_scale [N / bn, K / bk]:
  W[n, k] = Wq[n, k] * w_scale[n // bn, k // bk] (a checkpoint's `weight_scale_inv`, model/quant_config.py).
- Activations: one scale per token and group of bk columns, computed in every forward:
  x_scale[m, g] = max|x[m, g bk : (g + 1) bk]| / 448, xq = saturate(x / x_scale).
- y[m, n] = sum over groups g of x_scale[m, g] * w_scale[n // bn, g] * (xq[m, g] . Wq[n, g]) (+ bias).
  On CUDA: one Triton kernel, an fp8 tensor-core dot per k-group scaled into a float32 accumulator
  (`fp8_block_gemm`); elsewhere the float32 product of the dequantized operands (the reference).

N and K are multiples of the block (refused at load otherwise: model/quantization.py), so no block
is partial; M is any number of tokens (the kernel masks the last row tile).
"""

from __future__ import annotations

import torch

from pagedllm.ops._triton import HAS_TRITON, is_interpreted, require_triton, tl, triton
from pagedllm.ops.fp8_linear import FP8, quantize_rows, quantize_rows_triton

# (BLOCK_M, BLOCK_N, GROUP_M, num_warps, num_stages) by the largest M it serves: small row tiles
# and narrow column tiles for decode (more programs to read the weight), large tiles for prefill.
# Untuned guesses until benchmarks/fp8_block_gemm.py --sweep runs on a GPU.
GEMM_CONFIGS = (
    (16, (16, 64, 1, 4, 4)),
    (32, (32, 64, 1, 4, 4)),
    (64, (64, 64, 8, 4, 3)),
    (1 << 62, (128, 128, 8, 8, 3)),
)


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, K / group]): `quantize_rows` over each row's groups."""
    m, k = x.shape
    q, scale = quantize_rows(x.reshape(m * (k // group), group))
    return q.view(m, k), scale.view(m, k // group)


def quantize_groups_triton(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_groups` in one kernel launch (CUDA; the same bytes): x [M, K] contiguous."""
    m, k = x.shape
    q, scale = quantize_rows_triton(x.reshape(m * (k // group), group))
    return q.view(m, k), scale.view(m, k // group)


def dequantize_blocks(wq: torch.Tensor, w_scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """W [N, K] in float32: each element times its block's scale."""
    bn, bk = block
    return wq.float() * w_scale.float().repeat_interleave(bn, 0).repeat_interleave(bk, 1)


def fp8_block_linear_ref(
    x: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The product in float32 from the dequantized operands, in x's dtype: [..., K] -> [..., N]."""
    bk = block[1]
    xq, x_scale = quantize_groups(x.reshape(-1, x.shape[-1]), bk)
    y = (xq.float() * x_scale.repeat_interleave(bk, 1)) @ dequantize_blocks(wq, w_scale, block).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], wq.shape[0])


def fp8_block_linear(
    x: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x W^T (+ bias) with block-scaled fp8 W: the Triton kernel on CUDA, the reference elsewhere."""
    if x.device.type != "cuda" or not HAS_TRITON:
        return fp8_block_linear_ref(x, wq, w_scale, block, bias)
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    xq, x_scale = quantize_groups_triton(x2, block[1])
    y = fp8_block_gemm(xq, x_scale, wq, w_scale, block, bias, x.dtype)
    return y.view(*x.shape[:-1], wq.shape[0])


def block_k_tile(bk: int) -> int:
    """The kernel's K tile: the largest power of two that divides bk, at most 128 (one activation
    scale per row and tile); an fp8 tensor-core dot needs at least 32 (refused below: model/quantization.py)."""
    return min(bk & -bk, 128)


if HAS_TRITON:

    @triton.jit
    def _block_gemm_kernel(
        a_ptr,  # e4m3 [M, K]
        as_ptr,  # float32 [M, K / GROUP_K]
        b_ptr,  # e4m3 [N, K]
        bs_ptr,  # float32 [N / GROUP_N, K / GROUP_K]
        bias_ptr,
        c_ptr,  # [M, N]
        M,
        N,
        K,
        stride_am,
        stride_asm,
        stride_bn,
        stride_bsn,
        stride_cm,
        GROUP_N: tl.constexpr,
        GROUP_K: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        UPCAST: tl.constexpr,  # the interpreter: dot in float32 (ops/_triton.py: is_interpreted)
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
    ):
        # grouped order: GROUP_M row tiles walk the column tiles together, so B tiles stay in L2
        pid = tl.program_id(0)
        tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * tiles_n
        first_m = (pid // per_group) * GROUP_M
        rows = min(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % rows
        pid_n = (pid % per_group) // rows

        offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        mask_m, mask_n = offs_m < M, offs_n < N
        a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]
        b_ptrs = b_ptr + offs_n[None, :] * stride_bn + offs_k[:, None]  # [BLOCK_K, BLOCK_N]: W^T's tile
        as_ptrs = as_ptr + offs_m * stride_asm
        bs_ptrs = bs_ptr + (offs_n // GROUP_N) * stride_bsn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kt in range(0, tl.cdiv(K, BLOCK_K)):  # K is a multiple of GROUP_K, GROUP_K of BLOCK_K
            a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=mask_n[None, :], other=0.0)
            g = (kt * BLOCK_K) // GROUP_K
            a_s = tl.load(as_ptrs + g, mask=mask_m, other=0.0)
            b_s = tl.load(bs_ptrs + g, mask=mask_n, other=0.0)
            if UPCAST:
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def gemm_config(m: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, GROUP_M, num_warps, num_stages) for M rows (GEMM_CONFIGS)."""
    return next(cfg for limit, cfg in GEMM_CONFIGS if m <= limit)


def fp8_block_gemm(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    config: tuple[int, int, int, int, int] | None = None,
) -> torch.Tensor:
    """xq [M, K] e4m3 with x_scale [M, K / bk], wq [N, K] e4m3 with w_scale [N / bn, K / bk] ->
    [M, N] in out_dtype, accumulated in float32. Both operands unit-stride along K. config: a
    GEMM_CONFIGS entry (default: by M)."""
    require_triton()
    (m, k), n = xq.shape, wq.shape[0]
    bn, bk = block
    assert xq.dtype == wq.dtype == FP8 and wq.shape[1] == k and k % bk == 0 and n % bn == 0, (xq.shape, wq.shape)
    assert x_scale.shape == (m, k // bk) and w_scale.shape == (n // bn, k // bk), (x_scale.shape, w_scale.shape)
    assert xq.stride(1) == wq.stride(1) == x_scale.stride(1) == w_scale.stride(1) == 1
    out = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if m == 0:
        return out
    block_m, block_n, group_m, warps, stages = config or gemm_config(m)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _block_gemm_kernel[grid](
        xq,
        x_scale,
        wq,
        w_scale,
        bias if bias is not None else out,
        out,
        m,
        n,
        k,
        xq.stride(0),
        x_scale.stride(0),
        wq.stride(0),
        w_scale.stride(0),
        out.stride(0),
        GROUP_N=bn,
        GROUP_K=bk,
        HAS_BIAS=bias is not None,
        UPCAST=is_interpreted(_block_gemm_kernel),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k_tile(bk),
        GROUP_M=group_m,
        num_warps=warps,
        num_stages=stages,
    )
    return out
