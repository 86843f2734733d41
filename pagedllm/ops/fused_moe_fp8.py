"""Fused mixture of experts with FP8 experts (W8A8, Triton): ops/fused_moe.py's plan with e4m3 operands.

The (token, expert) pairs are sorted and padded by expert as in ops/fused_moe.py
(`moe_align_block_size`); then two launches of one grouped GEMM kernel, `_fp8_moe_kernel`:
1. GATED: x quantized once (per token and group of bk columns for block weights, per token for
   per-row weights: ops/moe_quant.py), times each pair's expert's gate and up matrices, both in
   fp8 tensor-core dots; SiLU(gate) * up in float32, stored in x's dtype -> [T * k, I];
2. that intermediate quantized the same way, times the expert's down matrix, scaled by the routing
   weight -> [T * k, H]; the k rows of each token are then summed (one torch reduction).
Block scales multiply each K tile's dot (a K tile never crosses a block: BLOCK_K divides bk); row
scales multiply the finished accumulator. The reference is ops/moe_quant.py: quant_moe_ref. No host
synchronisation, every shape a function of T: the call captures in a CUDA graph.
"""

from __future__ import annotations

import torch

from pagedllm.ops._triton import HAS_TRITON, is_interpreted, require_triton, tl, triton
from pagedllm.ops.fp8_block_linear import block_k_tile, quantize_groups_triton
from pagedllm.ops.fp8_linear import quantize_rows_triton
from pagedllm.ops.fused_moe import config_for, moe_align_block_size
from pagedllm.ops.moe_quant import Fp8Stack, quantize_activations

if HAS_TRITON:
    from pagedllm.ops.fused_moe import _block_of

    @triton.jit(do_not_specialize=["num_pairs", "num_m_blocks"])
    def _fp8_moe_kernel(
        a_ptr,  # e4m3 [rows, K]: x (GATED, a row per token) or the intermediate (a row per pair)
        as_ptr,  # float32 [rows, K / GROUP_K] (block) or [rows, 1]
        w_ptr,  # e4m3 [E, N, K]
        ws_ptr,  # float32 [E, N / GROUP_N, K / GROUP_K] (block) or [E, N]
        out_ptr,  # [T * k, N_OUT]
        weights_ptr,  # float32 [T * k] routing weights (not GATED)
        sorted_ptr,
        expert_ptr,
        num_padded_ptr,
        num_pairs,
        num_m_blocks,
        K,
        n_out,  # GATED: I (gate rows [0, I), up rows [I, 2I)); else H
        a_div,  # pair -> row of a: top_k (GATED) or 1
        stride_am,
        stride_asm,
        stride_we,
        stride_wn,
        stride_wse,
        stride_wsn,
        stride_om,
        GROUP_N: tl.constexpr,
        GROUP_K: tl.constexpr,
        PER_ROW: tl.constexpr,  # one scale per row of a and of W, applied to the accumulator
        GATED: tl.constexpr,
        UPCAST: tl.constexpr,  # the interpreter: dot in float32 (ops/_triton.py: is_interpreted)
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
    ):
        pid_m, pid_n = _block_of(tl.program_id(0), num_m_blocks, tl.cdiv(n_out, BLOCK_N), GROUP_M)
        if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
            return
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_ptr + rows).to(tl.int64)
        row_ok = pair < num_pairs
        a_row = pair // a_div
        expert = tl.load(expert_ptr + pid_m).to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < n_out
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + a_row[:, None] * stride_am + ks[None, :]
        g_ptrs = w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]  # [K, N]
        u_ptrs = g_ptrs + n_out * stride_wn
        as_ptrs = as_ptr + a_row * stride_asm
        gs_ptrs = ws_ptr + expert * stride_wse + (cols // GROUP_N) * stride_wsn
        us_ptrs = ws_ptr + expert * stride_wse + ((cols + n_out) // GROUP_N) * stride_wsn
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = ks < K - k0
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if UPCAST:
                a, g = a.to(tl.float32), g.to(tl.float32)
            if PER_ROW:
                acc_g = tl.dot(a, g, acc_g)
            else:
                grp = k0 // GROUP_K
                a_s = tl.load(as_ptrs + grp, mask=row_ok, other=0.0)
                g_s = tl.load(gs_ptrs + grp, mask=col_ok, other=0.0)
                acc_g += tl.dot(a, g) * a_s[:, None] * g_s[None, :]
            if GATED:
                u = tl.load(u_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                if UPCAST:
                    u = u.to(tl.float32)
                if PER_ROW:
                    acc_u = tl.dot(a, u, acc_u)
                else:
                    u_s = tl.load(us_ptrs + k0 // GROUP_K, mask=col_ok, other=0.0)
                    acc_u += tl.dot(a, u) * a_s[:, None] * u_s[None, :]
            a_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
        if PER_ROW:
            a_s = tl.load(as_ptrs, mask=row_ok, other=0.0)[:, None]
            acc_g *= a_s * tl.load(gs_ptrs, mask=col_ok, other=0.0)[None, :]
            if GATED:
                acc_u *= a_s * tl.load(us_ptrs, mask=col_ok, other=0.0)[None, :]
        if GATED:
            y = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u  # SiLU(gate) * up
        else:
            y = acc_g * tl.load(weights_ptr + pair, mask=row_ok, other=0.0)[:, None]  # the routing weight
        out = out_ptr + pair[:, None] * stride_om + cols[None, :]
        tl.store(out, y.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _quantize(x: torch.Tensor, block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_activations' bytes: one Triton launch on CUDA, torch ops elsewhere (the interpreter)."""
    if x.device.type != "cuda":
        return quantize_activations(x, block)
    return quantize_rows_triton(x) if block is None else quantize_groups_triton(x, block[1])


def _gemm(
    a: torch.Tensor,
    w: Fp8Stack,
    out: torch.Tensor,
    routing: torch.Tensor,
    align: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    num_pairs: int,
    a_div: int,
    gated: bool,
    cfg: dict[str, int],
) -> None:
    """One launch of _fp8_moe_kernel: a [rows, K] quantized here, into out [T * k, N_out]."""
    sorted_ids, expert_ids, num_padded = align
    aq, a_scale = _quantize(a, w.block)
    n_out = w.weight.shape[1] // (2 if gated else 1)
    k = w.weight.shape[2]
    bn, bk = w.block or (1, k)
    block_k = cfg["BLOCK_K"] if w.block is None else block_k_tile(bk)
    scale = w.scale if w.block is not None else w.scale.unsqueeze(2)  # [E, N, 1]: the row's scale
    grid = (expert_ids.numel() * triton.cdiv(n_out, cfg["BLOCK_N"]),)
    _fp8_moe_kernel[grid](
        aq, a_scale, w.weight, scale, out, routing, sorted_ids, expert_ids, num_padded, num_pairs,
        expert_ids.numel(), k, n_out, a_div, aq.stride(0), a_scale.stride(0), w.weight.stride(0),
        w.weight.stride(1), scale.stride(0), scale.stride(1), out.stride(0),
        GROUP_N=bn, GROUP_K=bk, PER_ROW=w.block is None, GATED=gated, UPCAST=is_interpreted(_fp8_moe_kernel),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=block_k, GROUP_M=cfg["GROUP_M"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip


def fused_moe_fp8(
    x: torch.Tensor,
    w13: Fp8Stack,
    w2: Fp8Stack,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """quant_moe_ref's contract (ops/moe_quant.py) for FP8 stacks: x [T, H] -> [T, H] in x's dtype.
    config: block sizes (default ops/fused_moe.py: config_for(T); block weights take BLOCK_K from bk)."""
    require_triton()
    t, hidden = x.shape
    num_experts, two_i, _ = w13.weight.shape
    inter, top_k = two_i // 2, topk_ids.shape[1]
    cfg = config or config_for(t)
    align = moe_align_block_size(topk_ids, num_experts, cfg["BLOCK_M"])
    num_pairs = t * top_k
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    routing = topk_weights.reshape(-1).to(torch.float32).contiguous()
    _gemm(x.contiguous(), w13, act, routing, align, num_pairs, top_k, True, cfg)
    _gemm(act, w2, out, routing, align, num_pairs, 1, False, cfg)
    return out.view(t, top_k, hidden).sum(dim=1)  # accumulated in float32 by torch, rounded once
