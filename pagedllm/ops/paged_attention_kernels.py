"""The Triton kernels of paged attention; their launchers and the algorithm are in paged_attention.py.

`_paged_attn_kernel` computes one (query tile x GQA group x context split) program with an
unmasked loop over the keys every row sees and a masked loop over the diagonal tiles (and, with a
sliding window, a masked loop over the tiles at the window's lower edge before them);
`_merge_splits_kernel` combines the splits of flash-decoding by their log2-sum-exp.

Sliding window W (SLIDING, a constexpr; `window` the runtime W): the row at position p sees keys
p - W < k <= p. A program's keys start at its first row's window, lo = p0 - W + 1 (not at 0), so
windowed decode reads O(W) keys whatever the context, and no key before lo is ever loaded: the
block-table entries wholly before a sequence's first window may name any block.
Soft cap c (SOFT_CAP): the host passes qk_scale = scale * k_scale / c and cap_log2 = c * log2(e);
a tile's scores become cap_log2 * tanh(q.k * qk_scale), i.e. c * tanh(s / c) in the log2 domain of
the softmax, before the mask.

Launch order (ORDERED, decode only): the hardware starts programs in grid order, so program z of the
batch axis takes sequence seq_order[z]; the host orders the batch longest first, so that a long
sequence does not start last and run on alone after the others have finished.

fp8 KV (KV_FP8, a constexpr: the 16-bit path compiles as before): K and V tiles are loaded as
fp8 bytes and converted in registers to fp16 (FP16_DOT: q is converted to fp16 too) or to q's
dtype, either of which holds every e4m3 and e5m2 value exactly. The layer's k_scale is already in qk_scale (folded in by the host) and v_scale
multiplies each program's normalised output, so the split-K partials are dequantized before
the merge and the merge kernel needs no scale.
"""

from __future__ import annotations

from pagedllm.ops._triton import HAS_TRITON, tl, triton

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
        cap_log2,
        window,
        offs_n,
        offs_d,
        BLOCK_SIZE: tl.constexpr,
        MASK: tl.constexpr,
        DOT_PREC: tl.constexpr,
        UPCAST: tl.constexpr,
        KV_FP8: tl.constexpr,
        COMPUTE_TY: tl.constexpr,
        SLIDING: tl.constexpr,
        SOFT_CAP: tl.constexpr,
        EARLY_V: tl.constexpr,
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
        if EARLY_V:  # V's load issued beside K's: two tiles in flight, not one after the scores
            if MASK:
                v = tl.load(v_ptrs, mask=kvalid[:, None], other=0.0)
            else:
                v = tl.load(v_ptrs)
        if KV_FP8:
            k = k.to(COMPUTE_TY)  # exact
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
        if SOFT_CAP:  # tanh(x) = sign(x) (1 - e) / (1 + e), e = exp(-2|x|) <= 1: no overflow
            e = tl.math.exp2(tl.abs(s) * (-2.0 * 1.4426950408889634))
            t = (1.0 - e) / (1.0 + e)
            s = tl.where(s < 0.0, -t, t) * cap_log2
        if MASK:
            visible = (kpos[None, :] <= q_pos[:, None]) & kvalid[None, :]
            if SLIDING:
                visible = visible & (kpos[None, :] > q_pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if not EARLY_V:
            if MASK:
                v = tl.load(v_ptrs, mask=kvalid[:, None], other=0.0)
            else:
                v = tl.load(v_ptrs)
        if KV_FP8:
            v = v.to(COMPUTE_TY)  # exact
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
        seq_order_ptr,
        part_out_ptr,
        part_lse_ptr,
        qk_scale,
        v_scale,
        cap_log2,
        window,
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
        ORDERED: tl.constexpr,
        DOT_PREC: tl.constexpr,
        UPCAST: tl.constexpr,
        KV_FP8: tl.constexpr,
        FP16_DOT: tl.constexpr,
        SLIDING: tl.constexpr,
        SOFT_CAP: tl.constexpr,
        EARLY_V: tl.constexpr,
    ):
        BLOCK_M: tl.constexpr = BLOCK_Q * G_PAD
        pid0 = tl.program_id(0)
        kvh = tl.program_id(1)
        b = tl.program_id(2)
        if ORDERED:  # decode: the z-th sequence to launch (longest first), not the z-th of the batch
            b = tl.load(seq_order_ptr + b)
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
        if FP16_DOT:  # fp8 K/V with a 16-bit q: the dots in fp16 (fp8 -> fp16 is one cheap conversion)
            q = q.to(tl.float16)
        if UPCAST:
            q = q.to(tl.float32)

        kv_hi = tl.minimum(ctx + (qblk + 1) * BLOCK_Q, seq_len)  # keys any row needs
        kv_full = ctx + qblk * BLOCK_Q + 1  # keys every row sees (causally)
        if SLIDING:
            kv_lo = tl.maximum(ctx + qblk * BLOCK_Q - window + 1, 0)  # the first row's window
        else:
            kv_lo = 0
        # [kv_lo, kv_hi) in tiles of BLOCK_N from kv_lo, cut into NUM_SPLITS chunks of whole tiles
        if NUM_SPLITS > 1:
            per = tl.cdiv(tl.cdiv(tl.maximum(kv_hi - kv_lo, 0), NUM_SPLITS), BLOCK_N) * BLOCK_N
            lo = kv_lo + split * per
            hi = tl.minimum(lo + per, kv_hi)
        else:
            lo = kv_lo
            hi = kv_hi
        # the tiles every row sees wholly: [full_lo, full_hi), on the tile grid from kv_lo
        if SLIDING:  # keys >= kv_hi - W are in every row's window
            edge = kv_lo + tl.cdiv(tl.maximum(kv_hi - window - kv_lo, 0), BLOCK_N) * BLOCK_N
            full_lo = tl.minimum(tl.maximum(edge, lo), tl.maximum(hi, lo))
        else:
            full_lo = lo
        full_hi = tl.maximum(full_lo, lo + (tl.maximum(tl.minimum(hi, kv_full) - lo, 0) // BLOCK_N) * BLOCK_N)

        k_base = k_cache_ptr + kvh.to(tl.int64) * stride_kh
        v_base = v_cache_ptr + kvh.to(tl.int64) * stride_vh
        bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
        compute_ty = tl.float16 if FP16_DOT else q_ptr.dtype.element_ty

        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        if SLIDING:  # the window's lower edge: rows see different keys
            for start in range(lo, full_lo, BLOCK_N):
                acc, l_i, m_i = _attn_tile(
                    acc, l_i, m_i, q, q_pos, start, full_lo, k_base, v_base, bt_row,
                    stride_kb, stride_kt, stride_vb, stride_vt, qk_scale, cap_log2, window, offs_n, offs_d,
                    BLOCK_SIZE, True, DOT_PREC, UPCAST, KV_FP8, compute_ty, SLIDING, SOFT_CAP, EARLY_V,
                )  # fmt: skip
        for start in range(full_lo, full_hi, BLOCK_N):
            acc, l_i, m_i = _attn_tile(
                acc, l_i, m_i, q, q_pos, start, hi, k_base, v_base, bt_row,
                stride_kb, stride_kt, stride_vb, stride_vt, qk_scale, cap_log2, window, offs_n, offs_d,
                BLOCK_SIZE, False, DOT_PREC, UPCAST, KV_FP8, compute_ty, SLIDING, SOFT_CAP, EARLY_V,
            )  # fmt: skip
        for start in range(full_hi, hi, BLOCK_N):  # the diagonal and the ragged end
            acc, l_i, m_i = _attn_tile(
                acc, l_i, m_i, q, q_pos, start, hi, k_base, v_base, bt_row,
                stride_kb, stride_kt, stride_vb, stride_vt, qk_scale, cap_log2, window, offs_n, offs_d,
                BLOCK_SIZE, True, DOT_PREC, UPCAST, KV_FP8, compute_ty, SLIDING, SOFT_CAP, EARLY_V,
            )  # fmt: skip

        nonempty = l_i > 0.0  # false only for rows with no keys (seq_len 0)
        o = acc / tl.where(nonempty, l_i, 1.0)[:, None]
        if KV_FP8:
            o = o * v_scale  # sum_j p_j (stored_j * v_scale) = v_scale * sum_j p_j stored_j
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
