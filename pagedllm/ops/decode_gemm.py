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

For an MLP's down projection the kernel can also take the gate_up projection's output and compute
act(gate) * up itself while it loads each K tile (`linear_act`: SiLU or GeGLU's tanh GELU, in float32,
rounded to the input dtype exactly as ops/fused.py's kernels round it), so a decode step has no
activation launch: the same bits as the two launches. For the projection that follows an RMSNorm
(qkv after the input norm, gate_up after the MLP's) it can take the norm's input instead
(`linear_norm`): every program first sums the squares of its rows, x + residual over all of K (a
few KiB from L2 at these row counts), then normalises each K tile as it loads it, with RMSNorm's
roundings (ops/fused_ref.py); the program of the first column tile and split writes x + residual,
the residual stream's next value. A decode step then has no norm launch either; the variance is
summed in another order than the norm kernel's, so a normalised value can differ in its last bit.

Accumulation is float32 and the output is rounded once to x's dtype, as cuBLAS does; the last bit
can differ from cuBLAS's (a different summation order), as it differs between cuBLAS's own
kernels for different M. `linear` picks this kernel on CUDA for bfloat16 and float16 inputs of at
most MAX_ROWS rows (measured: benchmarks/decode_gemm.py), and F.linear otherwise;
PAGEDLLM_DECODE_GEMM=cublas turns it off (A/B runs). Both capture in CUDA graphs: the workspace is
allocated per call, from the graph's pool under capture.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from pagedllm import envs
from pagedllm.ops import decode_gemm_kernels as kernels
from pagedllm.ops import pdl
from pagedllm.ops._triton import HAS_TRITON, is_interpreted, next_pow2, num_sms, require_triton, triton
from pagedllm.ops.split_k import split_k_sum

DTYPES = (torch.bfloat16, torch.float16)
ACTIVATIONS = {"silu": 1, "gelu_pytorch_tanh": 2}  # the MLP activations `linear_act` computes in the kernel
# the most rows `linear` sends here: at 1-16 rows it beat or tied cuBLAS at every Qwen3-0.6B shape, at 32 and
# more cuBLAS won (H200, benchmarks/results/decode-gemm/decode-gemm-sweep-h200-13d95d7.json)
MAX_ROWS = 16
PROGRAMS_PER_SM = 1  # split K until the grid has about this many programs per multiprocessor (one wave)
MIN_K_TILES = 2  # ... while every split keeps at least this many K tiles
MIN_BLOCK_N = 16
MAX_NORM_BLOCK = 512  # columns of x (and of the residual) per load of the norm's mean square (linear_norm)


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


def linear_act(
    gate_up: torch.Tensor,
    weight: torch.Tensor,
    act: str,
    bias: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """act(gate) * up times W^T in one launch, gate_up [..., 2K] = [gate | up] and W [N, K]; None where
    `wanted` would not take the product or PAGEDLLM_DECODE_FUSION is off (then the caller runs the
    activation and `linear`)."""
    if act not in ACTIVATIONS or gate_up.shape[-1] != 2 * weight.shape[1] or not wanted(gate_up, weight):
        return None
    if not envs.decode_fusion():  # read last: the checks above end most calls (CPU, many rows) sooner
        return None
    x2 = gate_up.reshape(-1, gate_up.shape[-1])
    y = decode_gemm(x2 if x2.stride(1) == 1 else x2.contiguous(), weight, bias, counters=counters, act=act)
    return y.view(*gate_up.shape[:-1], weight.shape[0])


def linear_norm(
    x: torch.Tensor,
    norm: NormIn,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(F.linear(RMSNorm(x + residual)), x + residual) in one launch, norm: `NormIn`; None where
    `wanted` would not take the product or PAGEDLLM_DECODE_FUSION is off (then the caller runs the
    norm and `linear`)."""
    residual = norm.residual
    if x.shape[-1] != weight.shape[1] or not wanted(x, weight) or not envs.decode_fusion():
        return None
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        return None
    x2 = x.reshape(-1, x.shape[-1])
    r2 = None if residual is None else residual.reshape(-1, x.shape[-1])
    norm2 = norm._replace(residual=r2 if r2 is None or r2.stride(1) == 1 else r2.contiguous())
    y, new_residual = decode_gemm_norm(
        x2 if x2.stride(1) == 1 else x2.contiguous(), norm2, weight, bias, counters=counters
    )
    return y.view(*x.shape[:-1], weight.shape[0]), new_residual.view(x.shape) if residual is not None else x


def decode_gemm_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 product rounded once to x's dtype."""
    y = x.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


class NormIn(NamedTuple):
    """The RMSNorm whose output is the decode GEMM's operand: its weight [K], eps, Gemma's (1 + w)
    form, and the residual stream [M, K] added to x first (None: x itself is normalised)."""

    weight: torch.Tensor
    eps: float
    unit_offset: bool
    residual: torch.Tensor | None


def decode_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: tuple[int, int, int, int, int, int] | None = None,
    counters: torch.Tensor | None = None,
    act: str | None = None,
) -> torch.Tensor:
    """x [M, K] times W^T ([N, K], both with unit stride along K) -> [M, N] in x's dtype, accumulated
    in float32. config: (BLOCK_M, BLOCK_N, BLOCK_K, split, num_warps, num_stages), default
    `decode_gemm_config` for this shape and GPU. counters: int32 zeros, at least one per output tile
    (`tile_counters`), for the in-kernel split-K sum; left at zero. act ("silu", "gelu_pytorch_tanh"):
    x is [M, 2K] = [gate | up] and the operand is act(gate) * up, rounded to x's dtype."""
    return _launch(x, weight, bias, config, counters, act, None)[0]


def decode_gemm_norm(
    x: torch.Tensor,
    norm: NormIn,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: tuple[int, int, int, int, int, int] | None = None,
    counters: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm(x + norm.residual) times W^T, and x + norm.residual ([M, K] in x's dtype; x itself when
    there is no residual), in one launch; otherwise as `decode_gemm`."""
    out, new_residual = _launch(x, weight, bias, config, counters, None, norm)
    return out, x if new_residual is None else new_residual


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: tuple[int, int, int, int, int, int] | None,
    counters: torch.Tensor | None,
    act: str | None,
    norm: NormIn | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    require_triton()
    m, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    assert x.shape[1] == (2 * k if act else k), (x.shape, weight.shape, act)
    assert x.stride(1) == weight.stride(1) == 1, (x.stride(), weight.stride())
    assert bias is None or bias.shape == (n,), bias.shape
    assert act is None or norm is None, "an activation or a norm, not both"
    residual = norm.residual if norm is not None else None
    if norm is not None:
        assert norm.weight.shape == (k,), (norm.weight.shape, k)
        assert residual is None or (residual.shape == x.shape and residual.stride(1) == 1), residual
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    new_residual = None if residual is None else torch.empty_like(x)
    if m == 0:
        return out, new_residual
    block_m, block_n, block_k, split, warps, stages = config or decode_gemm_config(m, n, k, num_sms(x.device))
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per_split)  # no empty split
    parts = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, block_n), split, triton.cdiv(m, block_m))
    sum_here = split > 1 and counters is not None
    use_pdl = pdl.enabled(x.device)
    if sum_here:
        assert counters is not None and counters.dtype == torch.int32 and counters.device == x.device
        assert counters.numel() >= grid[0] * grid[2], f"{counters.numel()} counters for {grid[0] * grid[2]} tiles"
    kernels._decode_gemm_kernel[grid](
        x,
        weight,
        bias if bias is not None else out,
        out,
        parts,
        counters if sum_here else out,
        residual if residual is not None else x,
        norm.weight if norm is not None else x,
        new_residual if new_residual is not None else x,
        norm.eps if norm is not None else 0.0,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        residual.stride(0) if residual is not None else 0,
        new_residual.stride(0) if new_residual is not None else 0,
        parts.stride(-2),
        parts.stride(0) if split > 1 else 0,
        k_per_split,
        split,
        HAS_BIAS=bias is not None,
        PARTIAL=split > 1,
        SUM_HERE=sum_here,
        ACT=ACTIVATIONS[act] if act else 0,
        NORM=0 if norm is None else 2 if norm.unit_offset else 1,
        HAS_RESIDUAL=residual is not None,
        NORM_BLOCK=min(next_pow2(k), MAX_NORM_BLOCK),
        USE_PDL=use_pdl,
        PREFETCH_LINES=max(1, block_k * weight.element_size() // 128),
        DOT_F32=is_interpreted(kernels._decode_gemm_kernel) or x.dtype == torch.float32,
        EVEN_K=k % block_k == 0,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
        num_stages=stages,
        **pdl.launch_options(use_pdl),
    )
    if split > 1 and not sum_here:
        split_k_sum(parts, bias, out)
    return out, new_residual
