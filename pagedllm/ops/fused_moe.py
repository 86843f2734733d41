"""Fused mixture-of-experts (Triton): the experts of every token in two grouped GEMM launches.

0. `select_experts`: the router's softmax, top-k and renormalisation, one program per token.
1. `moe_align_block_size` (vLLM's name; two small launches, one program per expert: count, then
   place): the T * k (token, expert) pairs sorted by expert, each expert's run padded to a
   multiple of BLOCK_M, so that every BLOCK_M rows of the sorted list belong to one expert. No
   host synchronisation: the sorted buffer has its worst-case length for T * k pairs, and the
   padded length stays a device tensor that the GEMMs read to skip the blocks past it. So every
   shape depends on T alone and the call can be captured in a CUDA graph.
2. `_gate_up_kernel`: per block of BLOCK_M sorted rows and BLOCK_N intermediate columns, x's rows
   times that expert's gate and up matrices, SiLU(gate) * up in the epilogue -> [T * k, I].
3. `_down_kernel`: those rows times the expert's down matrix, scaled by the routing weight in the
   epilogue -> [T * k, H]; the k rows of each token are then summed (one torch reduction).

Block sizes come from MOE_CONFIGS by the number of tokens: decode (few tokens per expert, so
small BLOCK_M wastes less padding) and prefill (many). benchmarks/moe.py --sweep finds the best
per M on a GPU. The references are in ops/moe_ref.py (fused_moe_ref, moe_align_block_size_ref)."""

from __future__ import annotations

import torch

from pagedllm.ops._triton import HAS_TRITON, is_interpreted, next_pow2, require_triton, tl, triton
from pagedllm.ops.moe_ref import padded_size

# (largest number of tokens M, block config): the first entry with M <= its bound applies (None: any).
# Every regime is compiled at start-up with the default settings: the CUDA graphs capture decode
# batches up to max_num_seqs (256), the profiling run the largest step; and the token counts are
# not specialised on (do_not_specialize), so no step compiles a kernel at run time. Shared memory
# per stage of the gate/up kernel: (BLOCK_M + 2 * BLOCK_N) * BLOCK_K * 2 bytes (H200: 227 KiB in all).
MOE_CONFIGS: tuple[tuple[int | None, dict[str, int]], ...] = (
    (16, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4)),
    (64, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=3)),
    (256, dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=3)),
    (1024, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=3)),
    (None, dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)),
)
# Tuned on one H200 at 2e55fd0 (benchmarks/results/moe/moe-kernels-sweep-h200-2e55fd0.json, the
# Qwen3-30B-A3B expert shape): M <= 64 and 256 kept the defaults (the best tried within 3%);
# 1,024 tokens 0.438 -> 0.418 ms with BLOCK_N 64 and 4 warps; 8,192 tokens 2.134 -> 1.835 ms with
# BLOCK_M 128 (benchmarks/moe.py's case run at cbbcc69: 2.05 -> 1.92 ms, Mixtral's experts 15.4 -> 13.8).


def config_for(m: int) -> dict[str, int]:
    for bound, cfg in MOE_CONFIGS:
        if bound is None or m <= bound:
            return cfg
    raise AssertionError("MOE_CONFIGS ends with a catch-all entry")


if HAS_TRITON:

    @triton.jit
    def _topk_softmax_kernel(
        logits_ptr,
        weights_ptr,
        ids_ptr,
        num_experts,
        stride_l,
        TOP_K: tl.constexpr,
        K_PAD: tl.constexpr,
        E_PAD: tl.constexpr,
        RENORMALIZE: tl.constexpr,
        ROUND: tl.constexpr,
    ):
        """One token's router: softmax in float32, the k largest (lowest index first on a tie),
        renormalised and rounded to the logits' dtype where asked."""
        row = tl.program_id(0).to(tl.int64)
        experts = tl.arange(0, E_PAD)
        valid = experts < num_experts
        x = tl.load(logits_ptr + row * stride_l + experts, mask=valid, other=-float("inf")).to(tl.float32)
        p = tl.where(valid, tl.exp(x - tl.max(x, 0)), 0.0)
        p = p / tl.sum(p, 0)
        slots = tl.arange(0, K_PAD)
        w = tl.zeros((K_PAD,), dtype=tl.float32)
        ids = tl.zeros((K_PAD,), dtype=tl.int32)
        for j in tl.static_range(TOP_K):
            best = tl.max(p, 0)
            idx = tl.min(tl.where(p == best, experts, E_PAD), 0)
            w = tl.where(slots == j, best, w)
            ids = tl.where(slots == j, idx, ids)
            p = tl.where(experts == idx, -1.0, p)  # below every probability: never taken again
        if RENORMALIZE:
            w = w / tl.sum(tl.where(slots < TOP_K, w, 0.0), 0)
        if ROUND:
            w = w.to(logits_ptr.dtype.element_ty).to(tl.float32)
        tl.store(weights_ptr + row * TOP_K + slots, w, mask=slots < TOP_K)
        tl.store(ids_ptr + row * TOP_K + slots, ids, mask=slots < TOP_K)

    @triton.jit(do_not_specialize=["num_pairs"])
    def _count_kernel(ids_ptr, counts_ptr, num_pairs, BLOCK: tl.constexpr):
        """Program e: how many of the pairs chose expert e."""
        e = tl.program_id(0)
        n = tl.zeros((BLOCK,), dtype=tl.int32)
        for start in range(0, num_pairs, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1)
            n += (ids == e).to(tl.int32)
        tl.store(counts_ptr + e, tl.sum(n, 0))

    @triton.jit(do_not_specialize=["num_pairs"])
    def _place_kernel(
        ids_ptr,
        counts_ptr,
        sorted_ptr,
        expert_ids_ptr,
        num_padded_ptr,
        num_pairs,
        num_experts,
        BLOCK_M: tl.constexpr,
        E_PAD: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """Program e: its padded run's start (an exclusive scan of every expert's padded count),
        its pairs written there in pair order, the sentinel num_pairs in its padding, and e as the
        expert of its blocks; program 0 also writes the total padded length."""
        e = tl.program_id(0)
        experts = tl.arange(0, E_PAD)
        counts = tl.load(counts_ptr + experts, mask=experts < num_experts, other=0)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        ends = tl.cumsum(padded, 0)
        mine = experts == e
        start = tl.sum(tl.where(mine, ends - padded, 0), 0)
        my_padded = tl.sum(tl.where(mine, padded, 0), 0)
        my_count = tl.sum(tl.where(mine, counts, 0), 0)
        if e == 0:
            tl.store(num_padded_ptr, tl.sum(padded, 0))
        written = start
        for first in range(0, num_pairs, BLOCK):
            offs = first + tl.arange(0, BLOCK)
            ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1)
            hit = (ids == e).to(tl.int32)
            tl.store(sorted_ptr + written + tl.cumsum(hit, 0) - 1, offs, mask=hit == 1)
            written += tl.sum(hit, 0)
        pad = start + my_count + tl.arange(0, BLOCK_M)
        tl.store(sorted_ptr + pad, tl.zeros((BLOCK_M,), dtype=tl.int32) + num_pairs, mask=pad < start + my_padded)
        for b in range(start // BLOCK_M, (start + my_padded) // BLOCK_M, BLOCK):
            blocks = b + tl.arange(0, BLOCK)
            tl.store(expert_ids_ptr + blocks, tl.zeros((BLOCK,), dtype=tl.int32) + e,
                     mask=blocks < (start + my_padded) // BLOCK_M)  # fmt: skip

    @triton.jit
    def _block_of(pid, num_m_blocks, num_n_blocks, GROUP_M: tl.constexpr):
        """Grouped program order: GROUP_M row blocks share their weight columns in L2."""
        per_group = GROUP_M * num_n_blocks
        first_m = (pid // per_group) * GROUP_M
        group_m = tl.minimum(num_m_blocks - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % group_m
        pid_n = (pid % per_group) // group_m
        return pid_m, pid_n

    @triton.jit(do_not_specialize=["num_pairs", "num_m_blocks"])
    def _gate_up_kernel(
        x_ptr,
        w_ptr,
        out_ptr,
        sorted_ptr,
        expert_ptr,
        num_padded_ptr,
        num_pairs,
        num_m_blocks,
        hidden,
        inter,
        top_k,
        stride_xm,
        stride_we,
        stride_wn,
        stride_om,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
        DOT_PREC: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        pid_m, pid_n = _block_of(tl.program_id(0), num_m_blocks, tl.cdiv(inter, BLOCK_N), GROUP_M)
        if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
            return
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_ptr + rows).to(tl.int64)
        row_ok = pair < num_pairs
        expert = tl.load(expert_ptr + pid_m).to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < inter
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = x_ptr + (pair // top_k)[:, None] * stride_xm + ks[None, :]
        g_ptrs = w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]  # [K, N]
        u_ptrs = g_ptrs + inter * stride_wn
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            k_ok = ks < hidden - k0
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if UPCAST:
                a, g, u = a.to(tl.float32), g.to(tl.float32), u.to(tl.float32)
            acc_g = tl.dot(a, g, acc_g, input_precision=DOT_PREC)
            acc_u = tl.dot(a, u, acc_u, input_precision=DOT_PREC)
            a_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
        y = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u  # SiLU(gate) * up
        out = out_ptr + pair[:, None] * stride_om + cols[None, :]
        tl.store(out, y.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit(do_not_specialize=["num_pairs", "num_m_blocks"])
    def _down_kernel(
        a_ptr,
        w_ptr,
        out_ptr,
        weights_ptr,
        sorted_ptr,
        expert_ptr,
        num_padded_ptr,
        num_pairs,
        num_m_blocks,
        inter,
        hidden,
        stride_am,
        stride_we,
        stride_wn,
        stride_om,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
        DOT_PREC: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        pid_m, pid_n = _block_of(tl.program_id(0), num_m_blocks, tl.cdiv(hidden, BLOCK_N), GROUP_M)
        if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
            return
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_ptr + rows).to(tl.int64)
        row_ok = pair < num_pairs
        expert = tl.load(expert_ptr + pid_m).to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < hidden
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + pair[:, None] * stride_am + ks[None, :]
        w_ptrs = w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]  # [K, N]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            k_ok = ks < inter - k0
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if UPCAST:
                a, w = a.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(a, w, acc, input_precision=DOT_PREC)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        acc *= tl.load(weights_ptr + pair, mask=row_ok, other=0.0)[:, None]  # the routing weight
        out = out_ptr + pair[:, None] * stride_om + cols[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, round_weights: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """moe_ref.select_experts' contract in one launch (a program per token)."""
    t, e = router_logits.shape
    logits = router_logits.contiguous()
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=logits.device)
    _topk_softmax_kernel[(t,)](
        logits, weights, ids, e, logits.stride(0), TOP_K=top_k, K_PAD=next_pow2(top_k), E_PAD=next_pow2(e),
        RENORMALIZE=renormalize, ROUND=round_weights and logits.dtype != torch.float32,
    )  # fmt: skip
    return weights, ids


def moe_align_block_size(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """moe_align_block_size_ref's contract (ops/moe_ref.py) in two launches: count per expert, then
    place. Entries of sorted_ids and expert_ids past num_padded are left unwritten (never read)."""
    flat = topk_ids.reshape(-1)
    n, dev = flat.numel(), flat.device
    size = padded_size(n, num_experts, block_m)
    counts = torch.empty(num_experts, dtype=torch.int32, device=dev)
    sorted_ids = torch.empty(size, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(size // block_m, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    block = 256  # pairs per chunk: one size for every n, so no variant compiles at run time
    _count_kernel[(num_experts,)](flat, counts, n, BLOCK=block)
    _place_kernel[(num_experts,)](
        flat, counts, sorted_ids, expert_ids, num_padded, n, num_experts,
        BLOCK_M=block_m, E_PAD=next_pow2(num_experts), BLOCK=block,
    )  # fmt: skip
    return sorted_ids, expert_ids, num_padded


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, k] float32, topk_ids [T, k] ->
    [T, H] in x's dtype (fused_moe_ref's contract). config: block sizes (default config_for(T))."""
    require_triton()
    t, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    inter, top_k = two_i // 2, topk_ids.shape[1]
    cfg = config or config_for(t)
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    sorted_ids, expert_ids, num_padded = moe_align_block_size(topk_ids, num_experts, bm)
    num_pairs, num_m_blocks = t * top_k, expert_ids.numel()
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    prec = "ieee" if x.dtype == torch.float32 else None
    upcast = is_interpreted(_gate_up_kernel) and x.dtype != torch.float32
    launch = dict(GROUP_M=cfg["GROUP_M"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    _gate_up_kernel[(num_m_blocks * triton.cdiv(inter, bn),)](
        x, w13, act, sorted_ids, expert_ids, num_padded, num_pairs, num_m_blocks, hidden, inter, top_k,
        x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_PREC=prec, UPCAST=upcast, **launch,
    )  # fmt: skip
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    _down_kernel[(num_m_blocks * triton.cdiv(hidden, bn),)](
        act, w2, out, weights, sorted_ids, expert_ids, num_padded, num_pairs, num_m_blocks, inter, hidden,
        act.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_PREC=prec, UPCAST=upcast, **launch,
    )  # fmt: skip
    return out.view(t, top_k, hidden).sum(dim=1)  # accumulated in float32 by torch, rounded once
