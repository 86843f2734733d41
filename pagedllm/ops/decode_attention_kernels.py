"""The decode kernel of paged attention: one new token per sequence, several key lanes a program.

`_paged_attn_kernel` (paged_attention_kernels.py) gives a decode program one [16, BLOCK_N] score
tile a step: the 2 query heads of a GQA group of 2 padded to the 16 rows a dot needs, the keys
split over the program's warps. Each step then reduces the scores' row maxima and sums across
warps and hands P from the warps that computed it to the warps that multiply it by V, all through
shared memory with barriers, so a program spends most of a step waiting on itself; with half the
bytes to read (fp8 KV) that wait is what the kernel measures.

Here a program (one sequence x one KV head x one context split) runs LANES independent online
softmaxes, each over its own BLOCK_N keys of every LANES * BLOCK_N-key tile, as one batched
(3-D) dot: lane i's scores are [16, BLOCK_N] = q [16, D] x K_i^T, so a lane's row maxima, sums
and P stay inside the warp that computed them (Triton puts a batched dot's warps on the batch
dimension). The lanes are merged once, after the last tile, by their maxima (the same
log2-sum-exp arithmetic as the split-K merge). A lane whose keys are all masked keeps m = -1e30
and l = 0 and weighs nothing in the merge.

Everything else is `_paged_attn_kernel`'s decode path: the row of token at position p sees keys
p - W < k <= p with a sliding window W (keys start at the window, split-K divides the window),
the logits soft cap, fp8 K/V converted in registers to fp16 (FP16_DOT) with k_scale folded into
qk_scale and v_scale applied to the output, and the split-K partial outputs in the same layout
(`_merge_splits_kernel` merges them).
"""

from __future__ import annotations

from pagedllm.ops._triton import HAS_TRITON, tl, triton

if HAS_TRITON:
    # stride_bt (the block-table width) changes from step to step: left unspecialized.
    @triton.jit(do_not_specialize=["stride_bt"])
    def _decode_attn_kernel(
        out_ptr,
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        block_tables_ptr,
        seq_lens_ptr,
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
        ROWS: tl.constexpr,
        LANES: tl.constexpr,
        BLOCK_N: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        DOT_PREC: tl.constexpr,
        UPCAST: tl.constexpr,
        KV_FP8: tl.constexpr,
        FP16_DOT: tl.constexpr,
        SLIDING: tl.constexpr,
        SOFT_CAP: tl.constexpr,
    ):
        TILE: tl.constexpr = LANES * BLOCK_N
        split = tl.program_id(0)
        kvh = tl.program_id(1)
        b = tl.program_id(2)
        seq_len = tl.load(seq_lens_ptr + b)

        rows = tl.arange(0, ROWS)
        row_valid = rows < GROUP
        head = kvh * GROUP + rows
        offs_d = tl.arange(0, HEAD_DIM)
        t_idx = b.to(tl.int64)
        q = tl.load(
            q_ptr + t_idx * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
            mask=row_valid[:, None],
            other=0.0,
        )
        if FP16_DOT:
            q = q.to(tl.float16)
        if UPCAST:
            q = q.to(tl.float32)
        q3 = tl.broadcast_to(q[None, :, :], (LANES, ROWS, HEAD_DIM))

        if SLIDING:  # the query at seq_len - 1 sees keys > seq_len - 1 - W
            kv_lo = tl.maximum(seq_len - window, 0)
        else:
            kv_lo = 0
        if NUM_SPLITS > 1:
            per = tl.cdiv(tl.cdiv(tl.maximum(seq_len - kv_lo, 0), NUM_SPLITS), TILE) * TILE
            lo = kv_lo + split * per
            hi = tl.minimum(lo + per, seq_len)
        else:
            lo = kv_lo
            hi = seq_len

        lane_key = tl.arange(0, LANES)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]  # [LANES, BLOCK_N]
        k_base = k_cache_ptr + kvh.to(tl.int64) * stride_kh
        v_base = v_cache_ptr + kvh.to(tl.int64) * stride_vh
        bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
        compute_ty = tl.float16 if FP16_DOT else q_ptr.dtype.element_ty

        m_i = tl.full([LANES, ROWS], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([LANES, ROWS], dtype=tl.float32)
        acc = tl.zeros([LANES, ROWS, HEAD_DIM], dtype=tl.float32)
        for start in range(lo, hi, TILE):
            kpos = start + lane_key
            kvalid = kpos < hi
            blk = tl.load(bt_row + kpos // BLOCK_SIZE, mask=kvalid, other=0).to(tl.int64)
            off = kpos % BLOCK_SIZE
            k = tl.load(
                k_base + blk[:, :, None] * stride_kb + off[:, :, None] * stride_kt + offs_d[None, None, :],
                mask=kvalid[:, :, None],
                other=0.0,
            )
            if KV_FP8:
                k = k.to(compute_ty)  # exact
            if UPCAST:
                k = k.to(tl.float32)
            s = tl.dot(q3, tl.permute(k, (0, 2, 1)), input_precision=DOT_PREC) * qk_scale  # [LANES, ROWS, BLOCK_N]
            if SOFT_CAP:  # tanh(x) = sign(x) (1 - e) / (1 + e), e = exp(-2|x|) <= 1: no overflow
                e = tl.math.exp2(tl.abs(s) * (-2.0 * 1.4426950408889634))
                t = (1.0 - e) / (1.0 + e)
                s = tl.where(s < 0.0, -t, t) * cap_log2
            s = tl.where(kvalid[:, None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 2))
            p = tl.math.exp2(s - m_new[:, :, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 2)
            v = tl.load(
                v_base + blk[:, :, None] * stride_vb + off[:, :, None] * stride_vt + offs_d[None, None, :],
                mask=kvalid[:, :, None],
                other=0.0,
            )
            if KV_FP8:
                v = v.to(compute_ty)  # exact
            p = p.to(v.dtype)
            if UPCAST:
                p = p.to(tl.float32)
                v = v.to(tl.float32)
            acc = acc * alpha[:, :, None] + tl.dot(p, v, input_precision=DOT_PREC)
            m_i = m_new

        # merge the lanes: weights 2^(m_lane - m), empty lanes (m = -1e30) weigh 0 unless all are empty
        m = tl.max(m_i, 0)
        w = tl.math.exp2(m_i - m[None, :])
        l_sum = tl.sum(l_i * w, 0)
        o = tl.sum(acc * w[:, :, None], 0)
        nonempty = l_sum > 0.0  # false only for rows with no keys (seq_len 0: a padding row)
        o = o / tl.where(nonempty, l_sum, 1.0)[:, None]
        if KV_FP8:
            o = o * v_scale
        if NUM_SPLITS == 1:
            tl.store(
                out_ptr + t_idx * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                o.to(out_ptr.dtype.element_ty),
                mask=row_valid[:, None],
            )
        else:
            # part_out: [T, Hq, S, D], part_lse: [T, Hq, S], both contiguous fp32 (as _paged_attn_kernel's)
            lse = tl.where(nonempty, m + tl.math.log2(tl.where(nonempty, l_sum, 1.0)), float("-inf"))
            hq = tl.num_programs(1) * GROUP
            row_id = (t_idx * hq + head) * NUM_SPLITS + split
            tl.store(part_out_ptr + row_id[:, None] * HEAD_DIM + offs_d[None, :], o, mask=row_valid[:, None])
            tl.store(part_lse_ptr + row_id, lse, mask=row_valid)
