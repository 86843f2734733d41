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

An fp8 cache (ops/kv_quant.py) is read as fp8 bytes and converted in registers (exactly) to
fp16 when q is 16-bit (the dots then run in fp16: fp8 -> bf16 would go through fp32, 35% slower
on the H200) or to fp32 for an fp32 q; k_scale is folded into the softmax scale here and v_scale
multiplies the output in the kernel (paged_attention_kernels.py), so grids and the split-K merge
are unchanged.

A sliding window W (a layer's constant, so a compiled-in switch and one scalar: no host sync,
graph-capturable) starts each program's keys at its first row's window instead of 0, so decode
reads W keys whatever the context and split-K partitions only the window; the tiles at the
window's lower edge are masked like the diagonal ones. A logits soft cap c is applied to each
tile's scores before the mask (paged_attention_kernels.py).

Reference: `attention_ref.paged_attention_ref`. The kernels: paged_attention_kernels.py.
"""

from __future__ import annotations

import torch

from pagedllm import envs
from pagedllm.ops import paged_attention_kernels as kernels
from pagedllm.ops._triton import is_interpreted, next_pow2, num_sms, require_triton, triton
from pagedllm.ops.kv_quant import is_fp8

# ---- Tile table: (phase, KV format) -> (BLOCK_N, num_warps, num_stages) -------------------------
# For q in bf16/fp16 with head_dim <= 128; fp32 q or a wider head uses BLOCK_N 32 (registers), and
# a prefill with head_dim 256 (Gemma 2/3) also 8 warps: its [64, 256] fp32 accumulator is 128
# registers a thread at 4 warps.
# Retune on new hardware with `python benchmarks/kernels.py --sweep [--kv-cache-dtype fp8]`.
TILES: dict[tuple[str, str], tuple[int, int, int]] = {
    # measured, H200, triton 3.6, Qwen3-0.6B shape, bf16 KV: decode the best of 18 (4.44 TB/s of KV
    # at batch 256 x 1024), prefill the best of 12
    ("decode", "16bit"): (64, 4, 2),
    ("prefill", "16bit"): (64, 4, 2),
    # fp8 KV, measured on the H200 (triton 3.6, decode 256 x 1024, dots in fp16: FP16_DOT): one warp a
    # program, BLOCK_N 64, no pipelining: 0.149 ms, 3.61 TB/s of fp8 KV, 85% of a device copy, the best of 34
    # (benchmarks/results/decode-attention/). With 4 warps (BLOCK_N 128, 2 stages: 0.205 ms, 62%, the best of
    # 20 before, fp8-decode-variants-h200.json) every tile's row maxima and sums crossed the warps and P went
    # from the warps that computed it to the warps that multiply it by V through shared memory; one warp
    # keeps all of it in registers. Prefill keeps the bf16 tile (bound by the dots, not the bytes).
    ("decode", "fp8"): (64, 1, 1),
    # fp8 decode cut into splits (num_splits > 1: batch x KV heads short of filling the SMs), with V's
    # load issued beside K's (EARLY_V): each split reads few keys (~85 at batch 16 x ~1,400), so a
    # 64-key tile is mostly a masked tail. Mixed lengths 128-1,536 launched longest first (H100,
    # decode-attention/mixed-tiles-h100-5e20de8.json, us against the 64-key tile): batch 16 15.8
    # against 21.1, 32 31.5 / 35.1, 64 53.1 / 58.0, 128 93.0 / 95.5; at batch 240 (one split) the
    # 64-key tile stays (155.2 against 163.0). bf16 KV: no tile won by more than 4%.
    ("decode_split", "fp8"): (32, 1, 1),
    ("prefill", "fp8"): (64, 4, 2),
}
SPLIT_EARLY_V = True  # the decode_split row's V load beside K's (kernels: EARLY_V)
WIDE_BLOCK_N = 32


def _pick_config(
    decode: bool,
    g_pad: int,
    head_dim: int,
    dtype: torch.dtype,
    kv_dtype: torch.dtype | None = None,
    split: bool = False,
) -> dict:
    """Tile shapes from shapes and dtypes only (q's, and the cache's if not q's), and for an fp8
    decode whether it runs in splits: `TILES`, or the PAGEDLLM_ATTENTION_TILES override of a row."""
    kv_format = "fp8" if kv_dtype is not None and is_fp8(kv_dtype) else "16bit"
    phase = "prefill" if not decode else "decode_split" if split and kv_format == "fp8" else "decode"
    key = (phase, kv_format)
    block_n, num_warps, num_stages = envs.attention_tiles().get(key, TILES[key])
    extra = dict(EARLY_V=SPLIT_EARLY_V) if phase == "decode_split" else {}
    if dtype == torch.float32 or head_dim > 128:
        block_n = WIDE_BLOCK_N
    if head_dim > 128 and not decode:
        num_warps = 8
    block_q = max(1, (16 if decode else 64) // g_pad)  # decode: M = BLOCK_Q * G_PAD >= 16 for tl.dot
    return dict(BLOCK_Q=block_q, BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages, **extra)


def default_num_splits(
    batch: int, num_kv_heads: int, max_seqlen_k: int, device: torch.device, num_warps: int = 4
) -> int:
    """Flash-decoding split count: the most splits that keep the grid within two waves of resident
    programs (4 a SM, or 8 for one-warp tiles: fp8 decode), with >= 128 keys a split (64 for one
    warp), at most 64 splits (128 for one warp). Rounded down to a power of two.

    Two waves, not one: the batches of a real decode step have mixed lengths and are launched
    longest first (`attention_metadata.longest_first`), and then the shorter programs of the second wave fill the
    SMs behind the long ones. Mixed lengths 128-1,536 (H200, launched longest first,
    benchmarks/results/decode-attention/): fp8 at batch 64 ran 52.2 us with 4 splits against
    61.3 with 2 (the one-wave rule's choice), at batch 128 84.6 with 2 against 91.3 with 1; bf16
    at batch 64 57.2 with 2 against 65.1 with 1. At equal lengths two waves cost 1-5% (bf16 64 x
    2,048: 0.96 of a copy with 2 splits, 0.99 with 1).
    At batch 1 the split length bounds the latency: with >= 512 keys a split, a 1,024-key context
    ran as 2 splits of 8 serial tiles (15.7 us a layer on the H200, a quarter of the step).
    One warp, fp8 KV: 1 x 32,768 ran at 59% of a copy with 128 splits against 47% with 64, and
    1 x 1,024 took 7.5 us with 16 splits against 9.6 with 8.
    """
    one_warp = num_warps == 1
    programs = batch * num_kv_heads
    slots = (8 if one_warp else 4) * num_sms(device)  # programs resident at once
    n = max(1, min(2 * slots // programs, max_seqlen_k // (64 if one_warp else 128), 128 if one_warp else 64))
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
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    seq_order: torch.Tensor | None = None,
    _config: dict | None = None,
) -> torch.Tensor:
    """Same semantics as `paged_attention_ref`; returns out [T, Hq, D] in q's dtype.

    max_seqlen_q: python int >= every sequence's q_len (sizes the grid). With
    max_seqlen_q == 1 every sequence has exactly one new token, and cu_seqlens_q may be
    None. max_seqlen_k: an upper bound on seq_lens, only used to choose num_splits
    (default: block_tables.shape[1] * block_size). num_splits: split-K factor; default 1
    unless this is decode and batch * kv_heads is small against the SM count.
    A padding sequence (seq_len 0, one query token, as in a CUDA-graph-padded decode
    batch) gets zeros. sliding_window / logits_soft_cap: `Kernels.attend`'s; block-table entries
    wholly before a sequence's first query's window are never read. seq_order (decode only):
    [B] int32, a permutation of the batch, the order in which the sequences' programs are
    launched (`attention_metadata.longest_first`); it changes the time, not the result. None: batch order.
    """
    require_triton()
    t, hq, d = q.shape
    num_blocks, hkv, block_size, dk = k_cache.shape
    assert dk == d and v_cache.shape == k_cache.shape and hq % hkv == 0
    assert v_cache.dtype == k_cache.dtype
    kv_fp8 = is_fp8(k_cache.dtype)
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
    if seq_order is not None:
        assert decode and seq_order.shape == (batch,) and seq_order.dtype == torch.int32
    if out is None:
        out = torch.empty_like(q)
    if t == 0 or batch == 0:
        return out
    group = hq // hkv
    g_pad = next_pow2(group)
    cfg = dict(_config) if _config else _pick_config(decode, g_pad, d, q.dtype, k_cache.dtype)
    if num_splits is None:
        if decode:
            mk = max_seqlen_k if max_seqlen_k is not None else block_tables.shape[1] * block_size
            if sliding_window is not None:  # the keys a decode query reads
                mk = min(mk, sliding_window)
            num_splits = default_num_splits(batch, hkv, mk, q.device, cfg["num_warps"])
        else:
            num_splits = 1
    num_splits = max(1, int(num_splits))
    if decode and kv_fp8 and num_splits > 1 and not _config:  # TILES' decode_split row
        cfg = _pick_config(decode, g_pad, d, q.dtype, k_cache.dtype, split=True)
    block_q = cfg.pop("BLOCK_Q")
    # fp8 K/V with a 16-bit q: dots in fp16 (fp8 -> fp16 is one conversion; -> bf16 goes through fp32)
    fp16_dot = cfg.pop("FP16_DOT", kv_fp8 and q.dtype != torch.float32)
    early_v = cfg.pop("EARLY_V", False)
    if num_splits > 1:
        part_out = torch.empty((t, hq, num_splits, d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((t, hq, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    assert sliding_window is None or sliding_window >= 1
    qk_scale = float(scale) * (float(k_scale) if kv_fp8 else 1.0)  # k_scale folded in: q.(stored k_scale)
    if logits_soft_cap is not None:  # scores cap_log2 * tanh(q.k * qk_scale) = log2(e) * c tanh(s / c)
        qk_scale, cap_log2 = qk_scale / float(logits_soft_cap), float(logits_soft_cap) * kernels.LOG2E
    else:
        qk_scale, cap_log2 = qk_scale * kernels.LOG2E, 1.0
    common = dict(
        DOT_PREC="ieee" if q.dtype == torch.float32 else None,
        UPCAST=is_interpreted(kernels._paged_attn_kernel) and q.dtype != torch.float32,
        KV_FP8=kv_fp8,
        FP16_DOT=fp16_dot,
        SLIDING=sliding_window is not None,
        SOFT_CAP=logits_soft_cap is not None,
        EARLY_V=early_v,
    )
    kernels._paged_attn_kernel[(triton.cdiv(max_seqlen_q, block_q) * num_splits, hkv, batch)](
        out,
        q,
        k_cache,
        v_cache,
        block_tables,
        cu_seqlens_q if cu_seqlens_q is not None else seq_lens,
        seq_lens,
        seq_order if seq_order is not None else seq_lens,
        part_out,
        part_lse,
        qk_scale,
        float(v_scale) if kv_fp8 else 1.0,
        cap_log2,
        int(sliding_window or 0),
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
        ORDERED=seq_order is not None,
        **common,
        **cfg,
    )
    if num_splits > 1:
        kernels._merge_splits_kernel[(t, hq)](
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
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    seq_order: torch.Tensor | None = None,
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
        k_scale=k_scale,
        v_scale=v_scale,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        seq_order=seq_order,
    )


__all__ = ["paged_attention", "paged_attention_decode", "default_num_splits"]
