"""Varlen causal paged attention (Triton), FlashAttention-2 style, for decode and prefill.

One kernel serves both. A program owns (a tile of BLOCK_Q new tokens of one sequence) x
(all query heads of one KV head's GQA group) x (one split of the context):
its M rows are token-major, head-minor (row r = token r // G_PAD, head r % G_PAD), so each
K/V tile it gathers through the block table is read once for the whole group. For decode
(max_seqlen_q == 1) BLOCK_Q = 16 // G_PAD pads M to the 16 rows `tl.dot` needs.

Keys below the tile's first query position are visible to every row and go through an
unmasked loop; the last (diagonal / ragged) tiles go through a masked one.

Split-K (flash-decoding): with num_splits S > 1 the context [0, kv_hi) of each program is cut
into S chunks of cdiv(cdiv(kv_hi, S), BLOCK_N) * BLOCK_N keys, sized from the sequence's own
length inside the kernel; each split writes its normalised partial output and its
log2-sum-exp, and a second kernel merges them. Grid sizes depend only on shapes and python
ints, so the decode path can be captured in a CUDA graph.

Reference: `attention_ref.paged_attention_ref`.
"""

from __future__ import annotations

import torch

from pagedllm.ops._triton import HAS_TRITON, is_interpreted, next_pow2, num_sms, require_triton, tl, triton

LOG2E = 1.4426950408889634

if HAS_TRITON:

    @triton.jit
    def _attn_tile(
        acc,
        l_i,
        m_i,
        q,
        q_pos,
        start,
        hi,
        k_base,
        v_base,
        bt_row,
        stride_kb,
        stride_kt,
        stride_vb,
        stride_vt,
        qk_scale,
        offs_n,
        offs_d,
        BLOCK_SIZE: tl.constexpr,
        MASK: tl.constexpr,
        DOT_PREC: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        kpos = start + offs_n
        if MASK:
            kvalid = kpos < hi
            blk = tl.load(bt_row + kpos // BLOCK_SIZE, mask=kvalid, other=0).to(tl.int64)
        else:
            blk = tl.load(bt_row + kpos // BLOCK_SIZE).to(tl.int64)
        off = kpos % BLOCK_SIZE
        k_ptrs = k_base + blk[:, None] * stride_kb + off[:, None] * stride_kt + offs_d[None, :]
        v_ptrs = v_base + blk[:, None] * stride_vb + off[:, None] * stride_vt + offs_d[None, :]
        if MASK:
            k = tl.load(k_ptrs, mask=kvalid[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
        if MASK:
            visible = (kpos[None, :] <= q_pos[:, None]) & kvalid[None, :]
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASK:
            v = tl.load(v_ptrs, mask=kvalid[:, None], other=0.0)
        else:
            v = tl.load(v_ptrs)
        p = p.to(v.dtype)
        if UPCAST:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PREC)
        return acc, l_i, m_new

    # stride_bt (the block-table width) changes from step to step: left unspecialized, so it
    # does not compile a variant per value class (==1, %16, other) in the middle of serving.
    @triton.jit(do_not_specialize=["stride_bt"])
    def _paged_attn_kernel(
        out_ptr,
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        block_tables_ptr,
        cu_seqlens_q_ptr,
        seq_lens_ptr,
        part_out_ptr,
        part_lse_ptr,
        qk_scale,
        stride_qt,
        stride_qh,
        stride_ot,
        stride_oh,
        stride_kb,
        stride_kh,
        stride_kt,
        stride_vb,
        stride_vh,
        stride_vt,
        stride_bt,
        GROUP: tl.constexpr,
        G_PAD: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        BLOCK_N: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        DECODE: tl.constexpr,
        DOT_PREC: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        BLOCK_M: tl.constexpr = BLOCK_Q * G_PAD
        pid0 = tl.program_id(0)
        kvh = tl.program_id(1)
        b = tl.program_id(2)
        # Highest q blocks (the most keys under the causal mask) are launched first.
        qblk = tl.num_programs(0) // NUM_SPLITS - 1 - pid0 // NUM_SPLITS
        split = pid0 % NUM_SPLITS
        if DECODE:
            q_start = b
            q_len = 1
        else:
            q_start = tl.load(cu_seqlens_q_ptr + b)
            q_len = tl.load(cu_seqlens_q_ptr + b + 1) - q_start
        if qblk * BLOCK_Q >= q_len:
            return
        seq_len = tl.load(seq_lens_ptr + b)
        ctx = seq_len - q_len  # cached tokens before the new ones

        rows = tl.arange(0, BLOCK_M)
        tok = qblk * BLOCK_Q + rows // G_PAD  # index within the sequence's new tokens
        hg = rows % G_PAD
        row_valid = (tok < q_len) & (hg < GROUP)
        head = kvh * GROUP + hg
        q_pos = ctx + tok
        offs_d = tl.arange(0, HEAD_DIM)
        offs_n = tl.arange(0, BLOCK_N)
        t_idx = (q_start + tok).to(tl.int64)
        q = tl.load(
            q_ptr + t_idx[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
            mask=row_valid[:, None],
            other=0.0,
        )
        if UPCAST:
            q = q.to(tl.float32)

        kv_hi = tl.minimum(ctx + (qblk + 1) * BLOCK_Q, seq_len)  # keys any row needs
        kv_full = ctx + qblk * BLOCK_Q + 1  # keys every row sees
        if NUM_SPLITS > 1:
            per = tl.cdiv(tl.cdiv(kv_hi, NUM_SPLITS), BLOCK_N) * BLOCK_N
            lo = split * per
            hi = tl.minimum(lo + per, kv_hi)
        else:
            lo = 0
            hi = kv_hi
        full_end = lo + (tl.maximum(tl.minimum(hi, kv_full) - lo, 0) // BLOCK_N) * BLOCK_N

        k_base = k_cache_ptr + kvh.to(tl.int64) * stride_kh
        v_base = v_cache_ptr + kvh.to(tl.int64) * stride_vh
        bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt

        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        for start in range(lo, full_end, BLOCK_N):
            acc, l_i, m_i = _attn_tile(
                acc,
                l_i,
                m_i,
                q,
                q_pos,
                start,
                hi,
                k_base,
                v_base,
                bt_row,
                stride_kb,
                stride_kt,
                stride_vb,
                stride_vt,
                qk_scale,
                offs_n,
                offs_d,
                BLOCK_SIZE,
                False,
                DOT_PREC,
                UPCAST,
            )
        for start in range(full_end, hi, BLOCK_N):
            acc, l_i, m_i = _attn_tile(
                acc,
                l_i,
                m_i,
                q,
                q_pos,
                start,
                hi,
                k_base,
                v_base,
                bt_row,
                stride_kb,
                stride_kt,
                stride_vb,
                stride_vt,
                qk_scale,
                offs_n,
                offs_d,
                BLOCK_SIZE,
                True,
                DOT_PREC,
                UPCAST,
            )

        nonempty = l_i > 0.0  # false only for rows with no keys (seq_len 0)
        o = acc / tl.where(nonempty, l_i, 1.0)[:, None]
        if NUM_SPLITS == 1:
            tl.store(
                out_ptr + t_idx[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                o.to(out_ptr.dtype.element_ty),
                mask=row_valid[:, None],
            )
        else:
            # part_out: [T, Hq, S, D], part_lse: [T, Hq, S], both contiguous fp32.
            lse = tl.where(nonempty, m_i + tl.math.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
            hq = tl.num_programs(1) * GROUP
            row_id = (t_idx * hq + head) * NUM_SPLITS + split
            tl.store(part_out_ptr + row_id[:, None] * HEAD_DIM + offs_d[None, :], o, mask=row_valid[:, None])
            tl.store(part_lse_ptr + row_id, lse, mask=row_valid)

    @triton.jit
    def _merge_splits_kernel(
        out_ptr,
        part_out_ptr,
        part_lse_ptr,
        stride_ot,
        stride_oh,
        NUM_SPLITS: tl.constexpr,
        S_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        hq = tl.num_programs(1)
        offs_s = tl.arange(0, S_PAD)
        offs_d = tl.arange(0, HEAD_DIM)
        base = (t * hq + h) * NUM_SPLITS
        smask = offs_s < NUM_SPLITS
        lse = tl.load(part_lse_ptr + base + offs_s, mask=smask, other=float("-inf"))
        m = tl.max(lse, 0)
        m = tl.where(m > float("-inf"), m, 0.0)  # all splits empty: padding row
        w = tl.math.exp2(lse - m)  # exp2(-inf) = 0 for empty splits
        po = tl.load(
            part_out_ptr + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :], mask=smask[:, None], other=0.0
        )
        w_sum = tl.sum(w, 0)
        o = tl.sum(po * w[:, None], 0) / tl.where(w_sum > 0.0, w_sum, 1.0)
        tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty))


def _pick_config(decode: bool, g_pad: int, head_dim: int, dtype: torch.dtype) -> dict:
    """Tile shapes, from shapes and dtype only.

    Measured on an H200 (triton 3.6, Qwen3-0.6B shape, bf16; benchmarks/kernels.py --sweep):
    decode BLOCK_N 64 / 4 warps / 2 stages was the best of 18 (4.44 TB/s of KV at batch 256 x
    1024); prefill BLOCK_M 64 / BLOCK_N 64 / 4 warps / 2 stages the best of 12.
    """
    wide = dtype == torch.float32 or head_dim > 128
    if decode:
        block_q = max(1, 16 // g_pad)
        return dict(BLOCK_Q=block_q, BLOCK_N=32 if wide else 64, num_warps=4, num_stages=2)
    block_q = max(1, 64 // g_pad)
    return dict(BLOCK_Q=block_q, BLOCK_N=32 if wide else 64, num_warps=4, num_stages=2)


def default_num_splits(batch: int, num_kv_heads: int, max_seqlen_k: int, device: torch.device) -> int:
    """Flash-decoding split count: about 4 programs per SM, >= 512 keys a split, rounded down
    to a power of two.

    (H200, batch 8 x 8192, 8 KV heads: 8 splits 3.86 TB/s, 9 splits 3.28, 16 splits 3.66.)
    """
    programs = batch * num_kv_heads
    sms = num_sms(device)
    if programs >= 2 * sms:
        return 1
    n = max(1, min(4 * sms // programs, max_seqlen_k // 512, 64))
    return 1 << (n.bit_length() - 1)  # a power of two: NUM_SPLITS is compiled in, few variants


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_seqlen_q: int,
    max_seqlen_k: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    _config: dict | None = None,
) -> torch.Tensor:
    """Same semantics as `paged_attention_ref`; returns out [T, Hq, D] in q's dtype.

    max_seqlen_q: python int >= every sequence's q_len (sizes the grid). With
    max_seqlen_q == 1 every sequence has exactly one new token, and cu_seqlens_q may be
    None. max_seqlen_k: an upper bound on seq_lens, only used to choose num_splits
    (default: block_tables.shape[1] * block_size). num_splits: split-K factor; default 1
    unless this is decode and batch * kv_heads is small against the SM count.
    A padding sequence (seq_len 0, one query token, as in a CUDA-graph-padded decode
    batch) gets zeros.
    """
    require_triton()
    t, hq, d = q.shape
    num_blocks, hkv, block_size, dk = k_cache.shape
    assert dk == d and v_cache.shape == k_cache.shape and hq % hkv == 0
    assert d & (d - 1) == 0 and d >= 16, "head_dim must be a power of two >= 16"
    assert block_size & (block_size - 1) == 0, "block_size must be a power of two"
    for x in (q, k_cache, v_cache):
        assert x.stride(-1) == 1, "last dim must be contiguous"
    assert block_tables.stride(-1) == 1
    batch = seq_lens.shape[0]
    decode = max_seqlen_q == 1
    if decode:
        assert t == batch, "decode expects one query token per sequence"
    else:
        assert cu_seqlens_q is not None
    if out is None:
        out = torch.empty_like(q)
    if t == 0 or batch == 0:
        return out
    group = hq // hkv
    g_pad = next_pow2(group)
    cfg = dict(_config) if _config else _pick_config(decode, g_pad, d, q.dtype)
    block_q = cfg.pop("BLOCK_Q")
    if num_splits is None:
        if decode:
            mk = max_seqlen_k if max_seqlen_k is not None else block_tables.shape[1] * block_size
            num_splits = default_num_splits(batch, hkv, mk, q.device)
        else:
            num_splits = 1
    num_splits = max(1, int(num_splits))
    if num_splits > 1:
        part_out = torch.empty((t, hq, num_splits, d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((t, hq, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    num_q_blocks = triton.cdiv(max_seqlen_q, block_q)
    grid = (num_q_blocks * num_splits, hkv, batch)
    _paged_attn_kernel[grid](
        out,
        q,
        k_cache,
        v_cache,
        block_tables,
        cu_seqlens_q if cu_seqlens_q is not None else seq_lens,
        seq_lens,
        part_out,
        part_lse,
        float(scale) * LOG2E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        GROUP=group,
        G_PAD=g_pad,
        BLOCK_Q=block_q,
        HEAD_DIM=d,
        BLOCK_SIZE=block_size,
        NUM_SPLITS=num_splits,
        DECODE=decode,
        DOT_PREC="ieee" if q.dtype == torch.float32 else None,
        UPCAST=is_interpreted(_paged_attn_kernel) and q.dtype != torch.float32,
        **cfg,
    )
    if num_splits > 1:
        _merge_splits_kernel[(t, hq)](
            out,
            part_out,
            part_lse,
            out.stride(0),
            out.stride(1),
            NUM_SPLITS=num_splits,
            S_PAD=max(2, next_pow2(num_splits)),
            HEAD_DIM=d,
            num_warps=4 if d >= 128 else 2,
        )
    return out


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_seqlen_k: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One new token per sequence (q: [B, Hq, D]); CUDA-graph capturable."""
    return paged_attention(
        q,
        k_cache,
        v_cache,
        block_tables,
        None,
        seq_lens,
        scale,
        max_seqlen_q=1,
        max_seqlen_k=max_seqlen_k,
        num_splits=num_splits,
        out=out,
    )


__all__ = ["paged_attention", "paged_attention_decode", "default_num_splits"]
