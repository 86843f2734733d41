"""4-bit weight-only linear layers (AWQ, GPTQ checkpoints): the weight stays packed on the device and is
dequantized in registers, tile by tile, inside the GEMM.

The layout (this rank's shard of W [N, K], built at load by model/int4_layer.py):
- `qweight` int32 [K / 8, N]: eight consecutive input rows of W^T to a word, row k at bits 4 (k % 8)
  (GPTQ's own qweight layout). A K tile of the kernel is then BLOCK_K / 8 whole words per column,
  read along N (coalesced), and any N (a TP shard, a packed q/k/v part) is a plain column slice.
- `scales` [K / group, N] (float16, or float32 for a float32 model) and `zeros` uint8 [K / group, N]
  (0 .. 16: GPTQ's original format stores zeros minus one, so a stored 15 means 16):
  W^T[k, n] = (q[k, n] - zeros[k // group, n]) * scales[k // group, n].
- `perm` int32 [K] or None: GPTQ's desc_act. The rows of W^T are sorted by group at load, so every
  group is `group` consecutive rows again; row k of W^T then multiplies input column perm[k]
  (the kernel gathers x's columns through perm; the reference permutes x first).

y = x[:, perm] @ W^T (+ bias), W^T dequantized in float32 and rounded to x's dtype (the operand the
tensor cores take; float32 models: an IEEE float32 dot), accumulated in float32, out in x's dtype.
On CUDA one Triton kernel (`int4_gemm`), split along K for small M (decode) so that enough programs
read the weight, the partial sums then added in a fixed order by a second small kernel (ops/split_k.py: the same
result on every run). Elsewhere the reference (`int4_linear_ref`): the same bytes dequantized, then
the float32 matmul. Both capture in CUDA graphs: no host synchronisation, and the one workspace
(split-K partials) is allocated per call, from the graph's pool under capture.
"""

from __future__ import annotations

import torch

from pagedllm.ops._triton import HAS_TRITON, is_interpreted, num_sms, require_triton, tl, triton
from pagedllm.ops.split_k import split_k_sum

# (BLOCK_M, BLOCK_N, largest BLOCK_K, GROUP_M, num_warps, num_stages) by the largest M it serves:
# narrow column tiles and split-K for decode, large tiles for prefill. Untuned guesses until
# benchmarks/int4_gemm.py --sweep runs on a GPU.
GEMM_CONFIGS = (
    (16, (16, 64, 128, 1, 4, 4)),
    (32, (32, 64, 128, 1, 4, 4)),
    (64, (64, 64, 64, 8, 4, 3)),
    (1 << 62, (128, 128, 64, 8, 8, 3)),
)
MIN_BLOCK_K = 16  # a tl.dot's smallest K: a group whose K tile would be smaller stays dequantized
PROGRAMS_PER_SM = 4  # split-K until about this many programs per multiprocessor


def pack_k(q: torch.Tensor) -> torch.Tensor:
    """int [K, N] of 0..15 -> int32 [K / 8, N], row k at bits 4 (k % 8)."""
    k, n = q.shape
    v = q.to(torch.int64).view(k // 8, 8, n)
    packed = sum(v[:, j] << (4 * j) for j in range(8))
    assert isinstance(packed, torch.Tensor)
    return (packed - ((packed >> 31) & 1) * (1 << 32)).to(torch.int32)  # the two's-complement int32


def unpack_k(qweight: torch.Tensor) -> torch.Tensor:
    """int32 [K / 8, N] -> int32 [K, N] of 0..15 (`pack_k` backwards)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device)
    return ((qweight.unsqueeze(1) >> shifts[None, :, None]) & 0xF).reshape(-1, qweight.shape[1])


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> torch.Tensor:
    """W^T [K, N] in float32 (in the packed, possibly permuted, row order): (q - zero) * scale."""
    q = unpack_k(qweight).float()
    return (q - zeros.float().repeat_interleave(group, 0)) * scales.float().repeat_interleave(group, 0)


def int4_linear_ref(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group: int,
    perm: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """[..., K] -> [..., N] in x's dtype: the packed bytes dequantized and rounded to x's dtype (the
    kernel's dot operand), then the float32 matmul."""
    x2 = x.reshape(-1, x.shape[-1])
    if perm is not None:
        x2 = x2.index_select(1, perm)
    w = dequantize(qweight, scales, zeros, group).to(x.dtype).float()
    y = x2.float() @ w
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], qweight.shape[1])


def int4_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group: int,
    perm: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x W^T (+ bias) with packed 4-bit W: the Triton kernel on CUDA, the reference elsewhere."""
    if x.device.type != "cuda" or not HAS_TRITON:
        return int4_linear_ref(x, qweight, scales, zeros, group, perm, bias)
    x2 = x.reshape(-1, x.shape[-1])
    y = int4_gemm(x2 if x2.stride(1) == 1 else x2.contiguous(), qweight, scales, zeros, group, perm, bias)
    return y.view(*x.shape[:-1], qweight.shape[1])


def block_k_tile(group: int, largest: int = 128) -> int:
    """The kernel's K tile: the largest power of two dividing the group, at most `largest` (one
    scale row per tile)."""
    return min(group & -group, largest)


def gemm_config(m: int) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, largest BLOCK_K, GROUP_M, num_warps, num_stages) for M rows (GEMM_CONFIGS)."""
    return next(cfg for limit, cfg in GEMM_CONFIGS if m <= limit)


def split_k(tiles_mn: int, k_tiles: int, sms: int) -> int:
    """How many programs share each output tile's K: doubled while the grid has fewer than
    PROGRAMS_PER_SM programs per multiprocessor and each split keeps at least four K tiles."""
    split = 1
    while tiles_mn * split * 2 <= PROGRAMS_PER_SM * sms and k_tiles // (split * 2) >= 4:
        split *= 2
    return split


if HAS_TRITON:

    @triton.jit
    def _int4_gemm_kernel(
        x_ptr,  # [M, K], unit stride along K
        qw_ptr,  # int32 [K / 8, N]
        s_ptr,  # [K / GROUP, N]
        z_ptr,  # uint8 [K / GROUP, N]
        perm_ptr,  # int32 [K] (HAS_PERM)
        bias_ptr,  # [N] (HAS_BIAS)
        out_ptr,  # [M, N] in x's dtype, or float32 partials [SPLIT_K, M, N]
        M,
        N,
        K,
        stride_xm,
        stride_qk,
        stride_sg,
        stride_zg,
        stride_om,
        stride_os,  # between the partials of two splits
        GROUP: tl.constexpr,
        HAS_PERM: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        DOT_F32: tl.constexpr,  # float32 operands, IEEE dot: float32 models and the interpreter
        SPLIT_K: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
    ):
        # grouped order: GROUP_M row tiles walk the column tiles together, so weight tiles stay in L2
        pid, pid_k = tl.program_id(0), tl.program_id(1)
        tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * tiles_n
        first_m = (pid // per_group) * GROUP_M
        rows = min(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % rows
        pid_n = (pid % per_group) // rows

        offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m, mask_n = offs_m < M, offs_n < N
        shifts = tl.arange(0, 8) * 4  # row 8w + j of a word's rows sits at bits 4j
        k_tiles = K // BLOCK_K  # K is a multiple of GROUP, GROUP of BLOCK_K
        per_split = tl.cdiv(k_tiles, SPLIT_K)
        first = pid_k * per_split
        last = tl.minimum(first + per_split, k_tiles)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kt in range(first, last):
            offs_k = kt * BLOCK_K + tl.arange(0, BLOCK_K)
            if HAS_PERM:
                cols = tl.load(perm_ptr + offs_k).to(tl.int64)
            else:
                cols = offs_k.to(tl.int64)
            a = tl.load(x_ptr + offs_m[:, None] * stride_xm + cols[None, :], mask=mask_m[:, None], other=0.0)
            words = kt * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
            packed = tl.load(qw_ptr + words[:, None] * stride_qk + offs_n[None, :], mask=mask_n[None, :], other=0)
            q = tl.reshape((packed[:, None, :] >> shifts[None, :, None]) & 0xF, (BLOCK_K, BLOCK_N))
            g = (kt * BLOCK_K) // GROUP
            s = tl.load(s_ptr + g * stride_sg + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + g * stride_zg + offs_n, mask=mask_n, other=0).to(tl.float32)
            w = (q.to(tl.float32) - z[None, :]) * s[None, :]
            if DOT_F32:
                acc += tl.dot(a.to(tl.float32), w, input_precision="ieee")
            else:
                acc += tl.dot(a, w.to(a.dtype))
        mask = mask_m[:, None] & mask_n[None, :]
        if SPLIT_K == 1:
            if HAS_BIAS:
                acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            out_ptrs = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
            tl.store(out_ptrs, acc, mask=mask)


def int4_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group: int,
    perm: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    config: tuple[int, int, int, int, int, int] | None = None,
    split: int | None = None,
) -> torch.Tensor:
    """x [M, K] (unit stride along K) times the packed W^T [K, N] -> [M, N] in x's dtype, accumulated in
    float32. config: a GEMM_CONFIGS entry (default: by M); split: programs per output tile along K
    (default: `split_k` for this grid and GPU)."""
    require_triton()
    (m, k), n = x.shape, qweight.shape[1]
    assert qweight.shape[0] * 8 == k and k % group == 0, (x.shape, qweight.shape, group)
    assert scales.shape == zeros.shape == (k // group, n) and zeros.dtype == torch.uint8, (scales.shape, zeros.shape)
    assert x.stride(1) == qweight.stride(1) == scales.stride(1) == zeros.stride(1) == 1
    assert perm is None or (perm.shape == (k,) and perm.dtype == torch.int32)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m, block_n, largest_k, group_m, warps, stages = config or gemm_config(m)
    block_k = block_k_tile(group, largest_k)
    assert block_k >= MIN_BLOCK_K, f"group {group}: a K tile of {block_k} rows is below a dot's {MIN_BLOCK_K}"
    tiles_mn = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    if split is None:
        split = split_k(tiles_mn, k // block_k, num_sms(x.device))
    dest = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    interpreted = is_interpreted(_int4_gemm_kernel)
    _int4_gemm_kernel[(tiles_mn, split)](
        x,
        qweight,
        scales,
        zeros,
        perm if perm is not None else qweight,
        bias if bias is not None else out,
        dest,
        m,
        n,
        k,
        x.stride(0),
        qweight.stride(0),
        scales.stride(0),
        zeros.stride(0),
        dest.stride(-2),
        dest.stride(0) if split > 1 else 0,
        GROUP=group,
        HAS_PERM=perm is not None,
        HAS_BIAS=bias is not None,
        DOT_F32=interpreted or x.dtype == torch.float32,
        SPLIT_K=split,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        GROUP_M=group_m,
        num_warps=warps,
        num_stages=stages,
    )
    if split > 1:
        split_k_sum(dest, bias, out)
    return out
