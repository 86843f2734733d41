"""The dense GEMM of a decode step: y = x W^T (+ bias) for the few rows a decode step has.

A decode step's linear layers multiply a handful of rows (x [M, K], M = the batch) by the whole
weight (W [N, K], K contiguous), so reading W is all the work: at M = 1 Qwen3-0.6B's 28 layers read
0.88 GB of weights, 0.21 ms at the device's copy rate. cuBLAS's kernels for these small matrices
(4-12 MB each) read them at about 1.1 TB/s on an H200 (benchmarks/results/latency: 0.78 ms a step,
the largest share of the step at the batch sizes a latency-bound server runs).

This kernel cuts W into narrow column tiles (BLOCK_N rows of W) and, where that gives too few
programs to keep every multiprocessor reading, also splits K: each program streams its
[BLOCK_N, K / split] slice of W through a pipelined loop and multiplies it by the matching columns of
x on the tensor cores (the rows padded to BLOCK_M = 16, the smallest dot: the padding costs no
bytes). Partial sums of a split go to a float32 workspace [split, M, N]. Where the caller passes
`counters` (int32 zeros, one per output tile: `tile_counters`, a buffer the linear layer owns), each
split's program then counts itself in with an atomic add, and the one that arrives last reads the
tile's partial sums back, adds them in split order, and resets the count to zero: no second launch
(a split-K sum kernel cost 1.7 us a call inside a decode step's graph on an H200, 0.14 ms a step at
batch 1). Without counters a second small kernel adds them (ops/split_k.py). Either way the partial
sums are added in the same fixed order: the same result on every run.

Accumulation is float32 and the output is rounded once to x's dtype, as cuBLAS does; the last bit
can differ from cuBLAS's (a different summation order), as it differs between cuBLAS's own
kernels for different M. `linear` picks this kernel on CUDA for bfloat16 and float16 inputs of at
most MAX_ROWS rows (measured: benchmarks/decode_gemm.py), and F.linear otherwise;
PAGEDLLM_DECODE_GEMM=cublas turns it off (A/B runs). Both capture in CUDA graphs: the workspace is
allocated per call, from the graph's pool under capture.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm import envs
from pagedllm.ops._triton import HAS_TRITON, is_interpreted, num_sms, require_triton, tl, triton
from pagedllm.ops.split_k import split_k_sum

DTYPES = (torch.bfloat16, torch.float16)
# the most rows `linear` sends here: at 1-16 rows it beat or tied cuBLAS at every Qwen3-0.6B shape, at 32 and
# more cuBLAS won (H200, benchmarks/results/decode-gemm/decode-gemm-sweep-h200-13d95d7.json)
MAX_ROWS = 16
PROGRAMS_PER_SM = 1  # split K until the grid has about this many programs per multiprocessor (one wave)
MIN_K_TILES = 2  # ... while every split keeps at least this many K tiles
MIN_BLOCK_N = 16


def decode_gemm_config(m: int, n: int, k: int, sms: int) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, split, num_warps, num_stages) for an [m, k] x [k, n] product on
    `sms` multiprocessors: the rows in one or a few 16-row tiles; column tiles of 32 weight rows, or
    64 where 32 would make more than 1.25 waves of programs; K tiles of 128 (256 with 64 columns or
    a long K); and K split until the grid fills PROGRAMS_PER_SM programs per multiprocessor. The
    sweep's best at Qwen3-0.6B's shapes, 1-16 rows: qkv [16, 32, 128] unsplit, o and down [16, 32,
    128] in 4 splits, gate_up [16, 64, 256] unsplit."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    tiles_m = -(-m // block_m)
    block_n = 64 if tiles_m * -(-n // 32) > 1.25 * sms else 32
    block_k = 256 if k >= 4096 or block_n == 64 else 128
    tiles = tiles_m * -(-n // block_n)
    return block_m, block_n, block_k, split_count(tiles, k, block_k, sms), 4, 4


def split_count(tiles: int, k: int, block_k: int, sms: int) -> int:
    """How many programs share an output tile's K: doubled while the grid has fewer than
    PROGRAMS_PER_SM programs per multiprocessor and every split keeps MIN_K_TILES tiles of K."""
    split, k_tiles = 1, -(-k // block_k)
    while tiles * split * 2 <= PROGRAMS_PER_SM * sms and k_tiles // (split * 2) >= MIN_K_TILES:
        split *= 2
    return split


def tile_counters(n: int, device: torch.device | str | None = None) -> torch.Tensor:
    """int32 zeros, one per output tile of up to MAX_ROWS rows and N columns: the arrival counts of
    `decode_gemm`'s in-kernel split-K sum, left at zero after every call."""
    return torch.zeros(-(-MAX_ROWS // 16) * -(-n // MIN_BLOCK_N), dtype=torch.int32, device=device)


def wanted(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` takes this kernel: CUDA, bfloat16 / float16, few rows, unit stride along K."""
    return (
        HAS_TRITON
        and x.is_cuda
        and x.dtype in DTYPES
        and weight.dtype == x.dtype
        and weight.stride(-1) == 1
        and x.numel() // max(1, x.shape[-1]) <= MAX_ROWS
        and envs.decode_gemm() == "triton"
    )


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, counters: torch.Tensor | None = None
) -> torch.Tensor:
    """F.linear, through `decode_gemm` where `wanted` says so (counters: this weight's `tile_counters`)."""
    if not wanted(x, weight):
        return F.linear(x, weight, bias)
    x2 = x.reshape(-1, x.shape[-1])
    y = decode_gemm(x2 if x2.stride(1) == 1 else x2.contiguous(), weight, bias, counters=counters)
    return y.view(*x.shape[:-1], weight.shape[0])


def decode_gemm_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 product rounded once to x's dtype."""
    y = x.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


if HAS_TRITON:

    @triton.jit
    def _decode_gemm_kernel(
        x_ptr,  # [M, K], unit stride along K
        w_ptr,  # [N, K], unit stride along K
        bias_ptr,  # [N] (HAS_BIAS)
        out_ptr,  # [M, N] in x's dtype
        part_ptr,  # float32 partials [split, M, N] (PARTIAL)
        count_ptr,  # int32 arrivals per output tile, zero between calls (PARTIAL and SUM_HERE)
        M,
        N,
        K,
        stride_xm,
        stride_wn,
        stride_om,
        stride_pm,
        stride_ps,  # between two splits' partials
        k_per_split,  # a multiple of BLOCK_K
        split,
        HAS_BIAS: tl.constexpr,
        PARTIAL: tl.constexpr,
        SUM_HERE: tl.constexpr,  # the last split's program adds the partials (else ops/split_k.py does)
        DOT_F32: tl.constexpr,  # float32 operands, IEEE dot: float32 inputs and the interpreter
        EVEN_K: tl.constexpr,  # K a multiple of BLOCK_K: no column masks
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        pid_n, pid_s, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m, mask_n = offs_m < M, offs_n < N
        x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
        w_rows = w_ptr + offs_n[:, None] * stride_wn
        first = pid_s * k_per_split
        last = tl.minimum(first + k_per_split, K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(first, last, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            if EVEN_K:
                a = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None], other=0.0)
                w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None], other=0.0)
            else:
                mask_k = offs_k < last
                a = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
                w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
            if DOT_F32:
                acc += tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
            else:
                acc += tl.dot(a, tl.trans(w))
        mask = mask_m[:, None] & mask_n[None, :]
        out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        if PARTIAL:
            parts = part_ptr + offs_m[:, None] * stride_pm + offs_n[None, :]
            tl.store(parts + pid_s * stride_ps, acc, mask=mask)
            if SUM_HERE:
                # release: this split's partial is written before it counts itself in; acquire: the
                # last to arrive sees every other split's partial
                tile = pid_m * tl.num_programs(0) + pid_n
                tl.debug_barrier()  # every thread's part of the partial stored before one thread counts in
                arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
                if arrived == split - 1:
                    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                    for s in range(split):  # split order, as ops/split_k.py adds them
                        acc += tl.load(parts + s * stride_ps, mask=mask, other=0.0, cache_modifier=".cg")
                    if HAS_BIAS:
                        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
                    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
                    tl.atomic_xchg(count_ptr + tile, 0)  # zero for the next call
        else:
            if HAS_BIAS:
                acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def decode_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: tuple[int, int, int, int, int, int] | None = None,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] times W^T ([N, K], both with unit stride along K) -> [M, N] in x's dtype, accumulated
    in float32. config: (BLOCK_M, BLOCK_N, BLOCK_K, split, num_warps, num_stages), default
    `decode_gemm_config` for this shape and GPU. counters: int32 zeros, at least one per output tile
    (`tile_counters`), for the in-kernel split-K sum; left at zero."""
    require_triton()
    (m, k), n = x.shape, weight.shape[0]
    assert weight.shape[1] == k and x.stride(1) == weight.stride(1) == 1, (x.shape, weight.shape)
    assert bias is None or bias.shape == (n,), bias.shape
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m, block_n, block_k, split, warps, stages = config or decode_gemm_config(m, n, k, num_sms(x.device))
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per_split)  # no empty split
    parts = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, block_n), split, triton.cdiv(m, block_m))
    sum_here = split > 1 and counters is not None
    if sum_here:
        assert counters is not None and counters.dtype == torch.int32 and counters.device == x.device
        assert counters.numel() >= grid[0] * grid[2], f"{counters.numel()} counters for {grid[0] * grid[2]} tiles"
    _decode_gemm_kernel[grid](
        x,
        weight,
        bias if bias is not None else out,
        out,
        parts,
        counters if sum_here else out,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        parts.stride(-2),
        parts.stride(0) if split > 1 else 0,
        k_per_split,
        split,
        HAS_BIAS=bias is not None,
        PARTIAL=split > 1,
        SUM_HERE=sum_here,
        DOT_F32=is_interpreted(_decode_gemm_kernel) or x.dtype == torch.float32,
        EVEN_K=k % block_k == 0,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
        num_stages=stages,
    )
    if split > 1 and not sum_here:
        split_k_sum(parts, bias, out)
    return out
