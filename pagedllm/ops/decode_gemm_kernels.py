"""The Triton kernel of the decode GEMM; its launcher, tiling and the algorithm are in decode_gemm.py.

One program computes a [BLOCK_M, BLOCK_N] output tile over one split of K: its loop streams the
tile's rows of W and the matching columns of x (or of act(gate) * up: ACT; or of RMSNorm(x +
residual): NORM, after a first pass over all of K for the rows' mean square), and either stores the
tile or, split, its float32 partial, the last split to arrive adding the partials (SUM_HERE).
"""

from __future__ import annotations

from pagedllm.ops._triton import HAS_TRITON, tl, triton
from pagedllm.ops.pdl import prefetch_l2

if HAS_TRITON:

    @triton.jit
    def _decode_gemm_kernel(
        x_ptr,  # [M, K], unit stride along K
        w_ptr,  # [N, K], unit stride along K
        bias_ptr,  # [N] (HAS_BIAS)
        out_ptr,  # [M, N] in x's dtype
        part_ptr,  # float32 partials [split, M, N] (PARTIAL)
        count_ptr,  # int32 arrivals per output tile, zero between calls (PARTIAL and SUM_HERE)
        res_ptr,  # [M, K] the residual stream, added to x before the norm (NORM and HAS_RESIDUAL)
        norm_w_ptr,  # [K] the RMSNorm's weight (NORM)
        new_res_ptr,  # [M, K] x + residual, written by the first column tile's first split (NORM and HAS_RESIDUAL)
        eps,
        M,
        N,
        K,
        stride_xm,
        stride_wn,
        stride_om,
        stride_rm,
        stride_nrm,
        stride_pm,
        stride_ps,  # between two splits' partials
        k_per_split,  # a multiple of BLOCK_K
        split,
        HAS_BIAS: tl.constexpr,
        PARTIAL: tl.constexpr,
        SUM_HERE: tl.constexpr,  # the last split's program adds the partials (else ops/split_k.py does)
        ACT: tl.constexpr,  # 0: x is the operand; 1 / 2: x is [gate | up], the operand silu / gelu_tanh(gate) * up
        NORM: tl.constexpr,  # 0: x is the operand; 1 / 2: the operand is RMSNorm(x [+ residual]), w * / (1 + w) *
        HAS_RESIDUAL: tl.constexpr,
        NORM_BLOCK: tl.constexpr,  # the mean square's K tile
        USE_PDL: tl.constexpr,  # launched with programmatic dependent launch (ops/pdl.py)
        PREFETCH_LINES: tl.constexpr,  # 128-byte lines in a row of a K tile of W (USE_PDL)
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
        if USE_PDL:  # this program's slice of W into L2 while the kernel before finishes (ops/pdl.py)
            for k0 in range(first, last, BLOCK_K):
                offs_p = k0 + tl.arange(0, PREFETCH_LINES) * (BLOCK_K // PREFETCH_LINES)
                prefetch_l2(w_rows + offs_p[None, :], mask_n[:, None] & (offs_p < last)[None, :])
            tl.extra.cuda.gdc_wait()  # from here on the kernel before has finished and its writes are seen
        if NORM != 0:  # the rows' mean square over all of K: x + residual, rounded as the norm rounds it
            r_rows = res_ptr + offs_m[:, None].to(tl.int64) * stride_rm
            nr_rows = new_res_ptr + offs_m[:, None].to(tl.int64) * stride_nrm
            k_written = tl.where(pid_n + pid_s == 0, K, 0)  # one program writes the residual stream's next value
            squares = tl.zeros((BLOCK_M,), dtype=tl.float32)
            for k0 in range(0, K, NORM_BLOCK):  # wider tiles than the product's: fewer L2 round trips
                offs_k = k0 + tl.arange(0, NORM_BLOCK)
                mask_a = mask_m[:, None] & (offs_k < K)[None, :]
                xr = tl.load(x_rows + offs_k[None, :], mask=mask_a, other=0.0)
                if HAS_RESIDUAL:
                    r = tl.load(r_rows + offs_k[None, :], mask=mask_a, other=0.0)
                    xr = (xr.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
                    tl.store(nr_rows + offs_k[None, :], xr, mask=mask_m[:, None] & (offs_k < k_written)[None, :])
                xf = xr.to(tl.float32)
                squares += tl.sum(xf * xf, 1)
            rstd = tl.math.rsqrt(squares / K + eps)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(first, last, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            if EVEN_K:
                mask_a = mask_m[:, None]
                mask_w = mask_n[:, None]
            else:
                mask_k = offs_k < last
                mask_a = mask_m[:, None] & mask_k[None, :]
                mask_w = mask_n[:, None] & mask_k[None, :]
            a = tl.load(x_rows + offs_k[None, :], mask=mask_a, other=0.0)
            w = tl.load(w_rows + offs_k[None, :], mask=mask_w, other=0.0)
            if ACT != 0:  # a is the gate; the up half starts K columns on (ops/fused.py's formulas)
                g = a.to(tl.float32)
                up = tl.load(x_rows + K + offs_k[None, :], mask=mask_a, other=0.0).to(tl.float32)
                if ACT == 1:
                    y = g / (1.0 + tl.exp(-g)) * up
                else:
                    u = 0.7978845608028654 * (g + 0.044715 * g * g * g)
                    e = tl.exp(-2.0 * tl.abs(u))
                    y = g * tl.where(u >= 0, 1.0 / (1.0 + e), e / (1.0 + e)) * up
                a = y.to(x_ptr.dtype.element_ty)
            if NORM != 0:  # RMSNorm of this K tile (ops/fused.py's _rms_norm_kernel's roundings)
                if HAS_RESIDUAL:
                    r = tl.load(r_rows + offs_k[None, :], mask=mask_a, other=0.0)
                    a = (a.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
                nw = tl.load(norm_w_ptr + offs_k, mask=offs_k < last, other=0.0).to(tl.float32)[None, :]
                normed = a.to(tl.float32) * rstd[:, None]
                if NORM == 1:  # Llama: round the normalised x, then scale
                    a = (normed.to(x_ptr.dtype.element_ty).to(tl.float32) * nw).to(x_ptr.dtype.element_ty)
                else:  # Gemma: scale by (1 + w) in float32, one rounding
                    a = (normed * (1.0 + nw)).to(x_ptr.dtype.element_ty)
            if DOT_F32:
                acc += tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
            else:
                acc += tl.dot(a, tl.trans(w))
        if USE_PDL:
            tl.extra.cuda.gdc_launch_dependents()
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
