"""Fused mixture of experts with 4-bit experts (AWQ, GPTQ; weight-only, Triton).

ops/fused_moe.py's plan with each expert's weight kept packed (ops/moe_quant.py: Int4Stack, the
dense 4-bit kernel's layout per expert, ops/int4_linear.py) and dequantized in registers, tile by
tile: `_int4_moe_kernel`, launched twice (GATED: x times the gate and up matrices, SiLU(gate) * up
-> [T * k, I]; then times the down matrix, scaled by the routing weight -> [T * k, H]; the k rows
of each token summed by torch). W^T's K tile is BLOCK_K / 8 whole int32 words per column, read
along N; its group's scale and zero point one row of each; the dequantized tile is rounded to x's
dtype for the tensor-core dot (float32 models and the interpreter: an IEEE float32 dot). GPTQ's
desc_act: a's columns gathered through the expert's `perm`. The reference is ops/moe_quant.py:
quant_moe_ref. No host synchronisation: the call captures in a CUDA graph.
"""

from __future__ import annotations

import torch

from pagedllm.ops._triton import HAS_TRITON, is_interpreted, require_triton, tl, triton
from pagedllm.ops.fused_moe import config_for, moe_align_block_size
from pagedllm.ops.int4_linear import MIN_BLOCK_K, block_k_tile
from pagedllm.ops.moe_quant import Int4Stack

if HAS_TRITON:
    from pagedllm.ops.fused_moe import _block_of

    @triton.jit
    def _dequantized_tile(qw_ptrs, s_ptrs, z_ptrs, col_ok, shifts, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
        """[BLOCK_K, BLOCK_N] of W^T in float32: the K tile's words unpacked, (q - zero) * scale."""
        packed = tl.load(qw_ptrs, mask=col_ok[None, :], other=0)
        q = tl.reshape((packed[:, None, :] >> shifts[None, :, None]) & 0xF, (BLOCK_K, BLOCK_N))
        s = tl.load(s_ptrs, mask=col_ok, other=0.0).to(tl.float32)
        z = tl.load(z_ptrs, mask=col_ok, other=0).to(tl.float32)
        return (q.to(tl.float32) - z[None, :]) * s[None, :]

    @triton.jit(do_not_specialize=["num_pairs", "num_m_blocks"])
    def _int4_moe_kernel(
        a_ptr,  # [rows, K]: x (GATED, a row per token) or the intermediate (a row per pair)
        qw_ptr,  # int32 [E, K / 8, N]
        s_ptr,  # [E, K / GROUP, N]
        z_ptr,  # uint8 [E, K / GROUP, N]
        perm_ptr,  # int32 [E, K] (HAS_PERM)
        out_ptr,  # [T * k, N_OUT]
        weights_ptr,  # float32 [T * k] routing weights (not GATED)
        sorted_ptr,
        expert_ptr,
        num_padded_ptr,
        num_pairs,
        num_m_blocks,
        K,
        n_out,  # GATED: I (gate columns [0, I), up columns [I, 2I)); else H
        a_div,  # pair -> row of a: top_k (GATED) or 1
        stride_am,
        stride_qe,
        stride_qk,
        stride_se,
        stride_sg,
        stride_ze,
        stride_zg,
        stride_pe,
        stride_om,
        GROUP: tl.constexpr,
        HAS_PERM: tl.constexpr,
        GATED: tl.constexpr,
        DOT_F32: tl.constexpr,  # float32 operands, IEEE dot: float32 models and the interpreter
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
        cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        col_ok = cols < n_out
        shifts = tl.arange(0, 8) * 4  # row 8w + j of a word's rows sits at bits 4j
        qw_base = qw_ptr + expert * stride_qe + cols[None, :]
        s_base = s_ptr + expert * stride_se + cols
        z_base = z_ptr + expert * stride_ze + cols
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kt in range(0, K // BLOCK_K):  # K is a multiple of GROUP, GROUP of BLOCK_K
            offs_k = kt * BLOCK_K + tl.arange(0, BLOCK_K)
            if HAS_PERM:
                a_cols = tl.load(perm_ptr + expert * stride_pe + offs_k).to(tl.int64)
            else:
                a_cols = offs_k.to(tl.int64)
            a = tl.load(a_ptr + a_row[:, None] * stride_am + a_cols[None, :], mask=row_ok[:, None], other=0.0)
            words = kt * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
            qw_ptrs = qw_base + words[:, None] * stride_qk
            g_row = (kt * BLOCK_K) // GROUP
            w = _dequantized_tile(
                qw_ptrs, s_base + g_row * stride_sg, z_base + g_row * stride_zg, col_ok, shifts, BLOCK_K, BLOCK_N
            )
            if DOT_F32:
                a = a.to(tl.float32)
                acc_g += tl.dot(a, w, input_precision="ieee")
            else:
                acc_g += tl.dot(a, w.to(a.dtype))
            if GATED:  # the up matrix: n_out columns further on
                u = _dequantized_tile(
                    qw_ptrs + n_out,
                    s_base + g_row * stride_sg + n_out,
                    z_base + g_row * stride_zg + n_out,
                    col_ok,
                    shifts,
                    BLOCK_K,
                    BLOCK_N,
                )
                if DOT_F32:
                    acc_u += tl.dot(a, u, input_precision="ieee")
                else:
                    acc_u += tl.dot(a, u.to(a.dtype))
        if GATED:
            y = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u  # SiLU(gate) * up
        else:
            y = acc_g * tl.load(weights_ptr + pair, mask=row_ok, other=0.0)[:, None]  # the routing weight
        out = out_ptr + pair[:, None] * stride_om + cols[None, :]
        tl.store(out, y.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _gemm(
    a: torch.Tensor,
    w: Int4Stack,
    out: torch.Tensor,
    routing: torch.Tensor,
    align: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    num_pairs: int,
    a_div: int,
    gated: bool,
    cfg: dict[str, int],
) -> None:
    """One launch of _int4_moe_kernel: a [rows, K] into out [T * k, N_out]."""
    sorted_ids, expert_ids, num_padded = align
    k, n = w.qweight.shape[1] * 8, w.qweight.shape[2]
    n_out = n // (2 if gated else 1)
    block_k = block_k_tile(w.group, cfg["BLOCK_K"])
    assert block_k >= MIN_BLOCK_K and k % w.group == 0, (w.group, k)
    assert w.zeros.dtype == torch.uint8 and a.stride(1) == 1
    perm = w.perm if w.perm is not None else w.qweight
    grid = (expert_ids.numel() * triton.cdiv(n_out, cfg["BLOCK_N"]),)
    _int4_moe_kernel[grid](
        a, w.qweight, w.scales, w.zeros, perm, out, routing, sorted_ids, expert_ids, num_padded, num_pairs,
        expert_ids.numel(), k, n_out, a_div, a.stride(0), w.qweight.stride(0), w.qweight.stride(1),
        w.scales.stride(0), w.scales.stride(1), w.zeros.stride(0), w.zeros.stride(1), perm.stride(0), out.stride(0),
        GROUP=w.group, HAS_PERM=w.perm is not None, GATED=gated,
        DOT_F32=is_interpreted(_int4_moe_kernel) or a.dtype == torch.float32,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=block_k, GROUP_M=cfg["GROUP_M"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip


def fused_moe_int4(
    x: torch.Tensor,
    w13: Int4Stack,
    w2: Int4Stack,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """quant_moe_ref's contract (ops/moe_quant.py) for 4-bit stacks: x [T, H] -> [T, H] in x's dtype.
    config: block sizes (default ops/fused_moe.py: config_for(T); BLOCK_K at most the group's tile)."""
    require_triton()
    t, hidden = x.shape
    num_experts, _, two_i = w13.qweight.shape
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
