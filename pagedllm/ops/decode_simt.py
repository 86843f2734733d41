"""Decode attention on the CUDA cores (SIMT) for small GQA groups: an experiment beside the tensor-core
kernel (paged_attention_kernels.py), measured by `benchmarks/decode_attention.py --simt`.

Why: the tensor-core kernel pads a decode program's GROUP query rows to the 16 rows `tl.dot` needs,
so with Qwen3-0.6B's group of 2, 7 of 8 accumulator rows are padding: a one-warp program holds
[16, 128] fp32 of accumulator plus a K tile converted to 16 bits, 254 registers a thread, 8 warps an
SM, and one tile in flight per warp. Here a program keeps only its G_PAD real rows: the scores are
q . k as a broadcast product summed over the head dimension, the output p . v summed over the keys,
all in fp32 (fp8 and 16-bit K/V are converted exactly), so a program needs few registers and many
can be resident.

Same contract as `paged_attention_decode` (one new token per sequence, split-K with the merge kernel
of paged_attention_kernels.py, launch order, sliding window, soft cap, fp8 scales), decode only.
Program (split, KV head, sequence): the keys [lo, hi) of its split, full tiles unmasked and the
ragged end masked.
"""

from __future__ import annotations

import torch

from pagedllm.ops import paged_attention_kernels as kernels
from pagedllm.ops._triton import HAS_TRITON, next_pow2, require_triton, tl, triton
from pagedllm.ops.kv_quant import is_fp8

if HAS_TRITON:

    @triton.jit
    def _simt_tile(
        acc, l_i, m_i, q, start, hi, k_base, v_base, bt_row, stride_kb, stride_kt, stride_vb, stride_vt,
        qk_scale, cap_log2, offs_n, offs_d,
        BLOCK_SIZE: tl.constexpr, MASK: tl.constexpr, SOFT_CAP: tl.constexpr,
    ):  # fmt: skip
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
            k = tl.load(k_ptrs, mask=kvalid[:, None], other=0.0).to(tl.float32)
            v = tl.load(v_ptrs, mask=kvalid[:, None], other=0.0).to(tl.float32)
        else:
            k = tl.load(k_ptrs).to(tl.float32)
            v = tl.load(v_ptrs).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * qk_scale  # [G_PAD, BLOCK_N]
        if SOFT_CAP:
            e = tl.math.exp2(tl.abs(s) * (-2.0 * 1.4426950408889634))
            t = (1.0 - e) / (1.0 + e)
            s = tl.where(s < 0.0, -t, t) * cap_log2
        if MASK:
            s = tl.where(kvalid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)  # [G_PAD, HEAD_DIM]
        return acc, l_i, m_new

    @triton.jit(do_not_specialize=["stride_bt"])
    def _decode_simt_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, seq_order_ptr,
        part_out_ptr, part_lse_ptr, qk_scale, v_scale, cap_log2, window,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh,
        stride_vt, stride_bt,
        GROUP: tl.constexpr, G_PAD: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr, ORDERED: tl.constexpr, KV_FP8: tl.constexpr,
        SLIDING: tl.constexpr, SOFT_CAP: tl.constexpr,
    ):  # fmt: skip
        split = tl.program_id(0)
        kvh = tl.program_id(1)
        b = tl.program_id(2)
        if ORDERED:
            b = tl.load(seq_order_ptr + b)
        seq_len = tl.load(seq_lens_ptr + b)
        hg = tl.arange(0, G_PAD)
        row_valid = hg < GROUP
        head = kvh * GROUP + hg
        offs_d = tl.arange(0, HEAD_DIM)
        offs_n = tl.arange(0, BLOCK_N)
        t_idx = b.to(tl.int64)
        q = tl.load(
            q_ptr + t_idx * stride_qt + head[:, None] * stride_qh + offs_d[None, :], mask=row_valid[:, None], other=0.0
        ).to(tl.float32)
        if SLIDING:
            kv_lo = tl.maximum(seq_len - window, 0)
        else:
            kv_lo = 0
        if NUM_SPLITS > 1:
            per = tl.cdiv(tl.cdiv(tl.maximum(seq_len - kv_lo, 0), NUM_SPLITS), BLOCK_N) * BLOCK_N
            lo = kv_lo + split * per
            hi = tl.minimum(lo + per, seq_len)
        else:
            lo = kv_lo
            hi = seq_len
        full_hi = lo + (tl.maximum(hi - lo, 0) // BLOCK_N) * BLOCK_N
        k_base = k_cache_ptr + kvh.to(tl.int64) * stride_kh
        v_base = v_cache_ptr + kvh.to(tl.int64) * stride_vh
        bt_row = block_tables_ptr + t_idx * stride_bt
        m_i = tl.full([G_PAD], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([G_PAD], dtype=tl.float32)
        acc = tl.zeros([G_PAD, HEAD_DIM], dtype=tl.float32)
        for start in range(lo, full_hi, BLOCK_N):
            acc, l_i, m_i = _simt_tile(
                acc, l_i, m_i, q, start, hi, k_base, v_base, bt_row, stride_kb, stride_kt, stride_vb, stride_vt,
                qk_scale, cap_log2, offs_n, offs_d, BLOCK_SIZE, False, SOFT_CAP,
            )  # fmt: skip
        for start in range(full_hi, hi, BLOCK_N):
            acc, l_i, m_i = _simt_tile(
                acc, l_i, m_i, q, start, hi, k_base, v_base, bt_row, stride_kb, stride_kt, stride_vb, stride_vt,
                qk_scale, cap_log2, offs_n, offs_d, BLOCK_SIZE, True, SOFT_CAP,
            )  # fmt: skip
        nonempty = l_i > 0.0
        o = acc / tl.where(nonempty, l_i, 1.0)[:, None]
        if KV_FP8:
            o = o * v_scale
        if NUM_SPLITS == 1:
            tl.store(
                out_ptr + t_idx * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                o.to(out_ptr.dtype.element_ty),
                mask=row_valid[:, None],
            )
        else:
            lse = tl.where(nonempty, m_i + tl.math.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
            hq = tl.num_programs(1) * GROUP
            row_id = (t_idx * hq + head) * NUM_SPLITS + split
            tl.store(part_out_ptr + row_id[:, None] * HEAD_DIM + offs_d[None, :], o, mask=row_valid[:, None])
            tl.store(part_lse_ptr + row_id, lse, mask=row_valid)


def decode_attention_simt(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int = 1,
    out: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    seq_order: torch.Tensor | None = None,
    block_n: int = 16,
    num_warps: int = 1,
) -> torch.Tensor:
    """`paged_attention_decode`'s contract (q: [B, Hq, D], one token per sequence); num_splits is given
    (no heuristic yet), block_n / num_warps are the tile."""
    require_triton()
    batch, hq, d = q.shape
    _, hkv, block_size, _ = k_cache.shape
    assert hq % hkv == 0 and d & (d - 1) == 0 and block_tables.stride(-1) == 1
    kv_fp8 = is_fp8(k_cache.dtype)
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    group = hq // hkv
    num_splits = max(1, int(num_splits))
    if num_splits > 1:
        part_out = torch.empty((batch, hq, num_splits, d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((batch, hq, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out
    qk_scale = float(scale) * (float(k_scale) if kv_fp8 else 1.0)
    if logits_soft_cap is not None:
        qk_scale, cap_log2 = qk_scale / float(logits_soft_cap), float(logits_soft_cap) * kernels.LOG2E
    else:
        qk_scale, cap_log2 = qk_scale * kernels.LOG2E, 1.0
    _decode_simt_kernel[(num_splits, hkv, batch)](
        out, q, k_cache, v_cache, block_tables, seq_lens, seq_order if seq_order is not None else seq_lens,
        part_out, part_lse, qk_scale, float(v_scale) if kv_fp8 else 1.0, cap_log2, int(sliding_window or 0),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        GROUP=group, G_PAD=next_pow2(group), BLOCK_N=block_n, HEAD_DIM=d, BLOCK_SIZE=block_size,
        NUM_SPLITS=num_splits, ORDERED=seq_order is not None, KV_FP8=kv_fp8,
        SLIDING=sliding_window is not None, SOFT_CAP=logits_soft_cap is not None,
        num_warps=num_warps, num_stages=1,
    )  # fmt: skip
    if num_splits > 1:
        kernels._merge_splits_kernel[(batch, hq)](
            out, part_out, part_lse, out.stride(0), out.stride(1),
            NUM_SPLITS=num_splits, S_PAD=max(2, next_pow2(num_splits)), HEAD_DIM=d, num_warps=4 if d >= 128 else 2,
        )  # fmt: skip
    return out


__all__ = ["decode_attention_simt"]
