"""Torch references for the paged KV store and paged attention.

They are exact (float32 math) and device-agnostic: the CPU path runs on them and the
Triton kernels are tested against them. `paged_attention_ref` is the plain oracle (one
sequence at a time); the CPU path uses the `*_grouped` forms, which give the same results
without a Python loop over decode rows and without padding a sequence to another's length.

An fp8 cache (ops/kv_quant.py) is stored through `quantize_ref` and read back dequantized in
float32 (`stored * k_scale`, `stored * v_scale`); for a cache in the model's dtype the scales
are ignored.

Every attention here takes the layer's `sliding_window` W and `logits_soft_cap` c (None: off,
and the computation is the one without them, bit for bit). With W the query at position q sees
the keys at q - W < k <= q (HF transformers' `sliding_window_causal_mask_function`), and the
keys a sequence's first new query cannot see are never gathered: block-table entries wholly
before that window may name any block. With c the scores s = scale * q.k become c * tanh(s / c)
before the mask and the softmax (HF Gemma 2's eager attention).
"""

from __future__ import annotations

import torch

from pagedllm.ops.kv_quant import bytes_view, dequantize_ref, quantize_ref


def store_kvcache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """key/value: [N, Hkv, D]; caches: [num_blocks, Hkv, block_size, D]; a PAD_SLOT_ID (negative) slot is skipped.
    An fp8 cache stores saturate(key / k_scale) and saturate(value / v_scale)."""
    block_size = k_cache.shape[2]
    keep = slot_mapping >= 0  # not PAD_SLOT_ID
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    # fp8 through byte views: the same bits, and torch < 2.5 has no index_put for fp8 types
    bytes_view(k_cache)[blocks, :, offsets] = bytes_view(quantize_ref(key[keep], k_scale, k_cache.dtype))
    bytes_view(v_cache)[blocks, :, offsets] = bytes_view(quantize_ref(value[keep], v_scale, v_cache.dtype))


def take_blocks(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """cache[blocks] (index_select on dim 0), fp8 through its bytes (torch < 2.5 cannot index fp8)."""
    return bytes_view(cache).index_select(0, blocks).view(cache.dtype)


def as_stored(x: torch.Tensor, scale: float, cache_dtype: torch.dtype) -> torch.Tensor:
    """x as attention reads it back from a cache of cache_dtype (x itself unless the cache is fp8),
    in x's dtype: what the pure-prefill path attends over, so that it sees what a later step
    reading the cache sees."""
    if cache_dtype == x.dtype:
        return x
    return dequantize_ref(quantize_ref(x, scale, cache_dtype), scale).to(x.dtype)


def gather_kv(
    cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, scale: float = 1.0, start: int = 0
) -> torch.Tensor:
    """Positions [start, seq_len) of one sequence's K or V, dequantized to float32:
    [seq_len - start, Hkv, D]. Only the blocks holding those positions are read."""
    block_size = cache.shape[2]
    first, num_blocks = start // block_size, (seq_len + block_size - 1) // block_size
    tiles = dequantize_ref(take_blocks(cache, block_table[first:num_blocks].long()), scale)  # [nb, Hkv, bs, D]
    skip = start - first * block_size
    return tiles.transpose(1, 2).reshape(-1, cache.shape[1], cache.shape[3])[skip : skip + seq_len - start]


def window_start(first_q_pos: int, sliding_window: int | None) -> int:
    """The first key position a query at first_q_pos (or any later one) can see."""
    return 0 if sliding_window is None else max(0, first_q_pos - sliding_window + 1)


def soft_cap_(scores: torch.Tensor, logits_soft_cap: float | None) -> torch.Tensor:
    """scores <- c * tanh(scores / c) in place (HF Gemma 2's order of operations); None: unchanged."""
    if logits_soft_cap is not None:
        scores.div_(logits_soft_cap).tanh_().mul_(logits_soft_cap)
    return scores


def hidden(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """[..., L, S] True where the query at q_pos [..., L] must not see the key at k_pos [..., S]:
    k > q (causal) or, with a window W, k <= q - W."""
    q, k = q_pos.unsqueeze(-1), k_pos.unsqueeze(-2)
    out = k > q
    return out if sliding_window is None else out | (k <= q - sliding_window)


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Varlen causal attention over the paged cache.

    q: [T, Hq, D], the new tokens of B sequences packed; cu_seqlens_q: [B+1].
    seq_lens: [B], each sequence's context length *including* its new tokens, whose K/V
    must already be stored. Query i of a sequence with q_len L sits at position
    seq_len - L + i and attends to positions <= that one (and > that one - sliding_window).
    Returns [T, Hq, D] in q's dtype.
    """
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        start, end = cu[b], cu[b + 1]
        if end > start:
            out[start:end] = _attend_one(
                q[start:end],
                k_cache,
                v_cache,
                block_tables[b],
                seq_len,
                scale,
                k_scale,
                v_scale,
                sliding_window=sliding_window,
                logits_soft_cap=logits_soft_cap,
            )
    return out


def _attend_one(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """One sequence's L new tokens q [L, Hq, D] over its seq_len positions, causal: [L, Hq, D].
    With a window only the keys from the first query's window on are gathered."""
    q_len, group = q.shape[0], q.shape[1] // k_cache.shape[1]
    lo = window_start(seq_len - q_len, sliding_window)
    k = gather_kv(k_cache, block_table, seq_len, k_scale, lo)
    v = gather_kv(v_cache, block_table, seq_len, v_scale, lo)
    qs = q.float().transpose(0, 1)  # [Hq, L, D]
    k = k.transpose(0, 1).repeat_interleave(group, dim=0)  # [Hq, S, D]
    v = v.transpose(0, 1).repeat_interleave(group, dim=0)
    scores = soft_cap_(torch.matmul(qs, k.transpose(1, 2)) * scale, logits_soft_cap)  # [Hq, L, S]
    q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
    k_pos = torch.arange(lo, seq_len, device=q.device)
    scores.masked_fill_(hidden(q_pos, k_pos, sliding_window), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v).transpose(0, 1).to(q.dtype)


def _equal_length_runs(cu: list[int]) -> list[tuple[int, int, int]]:
    """(first token, number of sequences, length) for each run of consecutive non-empty
    sequences of one length: the profiling run's batch is one or two such runs."""
    runs: list[tuple[int, int, int]] = []
    for start, end in zip(cu[:-1], cu[1:], strict=False):
        length = end - start
        if length == 0:
            continue
        if runs and runs[-1][2] == length and runs[-1][0] + runs[-1][1] * length == start:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1, length)
        else:
            runs.append((start, 1, length))
    return runs


def _heads_first(x: torch.Tensor, count: int, length: int, repeat: int) -> torch.Tensor:
    """[count * length, H, D] -> [count, H * repeat, length, D] (GQA's K/V heads repeated)."""
    x = x.unflatten(0, (count, length)).transpose(1, 2)
    return x.repeat_interleave(repeat, dim=1) if repeat > 1 else x


def prefill_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Causal attention of new tokens over themselves only (no cached history): [T, Hq, D].

    In q's dtype through SDPA (the window as its boolean mask), except with a soft cap, which
    SDPA cannot apply: then in float32 like `_attend_one`."""
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    for start, count, length in _equal_length_runs(cu_seqlens_q.tolist()):
        end = start + count * length  # `count` sequences of `length` tokens each: one batched call
        qs, ks, vs = (
            _heads_first(x[start:end], count, length, repeat) for x, repeat in ((q, 1), (k, group), (v, group))
        )
        if sliding_window is None and logits_soft_cap is None:
            o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
        else:
            pos = torch.arange(length, device=q.device)
            mask = hidden(pos, pos, sliding_window)
            if logits_soft_cap is None:
                o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=~mask, scale=scale)
            else:
                scores = soft_cap_(torch.matmul(qs.float(), ks.float().transpose(-1, -2)) * scale, logits_soft_cap)
                probs = torch.softmax(scores.masked_fill_(mask, float("-inf")), dim=-1)
                o = torch.matmul(probs, vs.float())
        out[start:end] = o.transpose(1, 2).flatten(0, 1)
    return out


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seqlen_k: int,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Decode only (one query per sequence), all sequences in one batched computation.

    Same result as paged_attention_ref with q_len 1, without its per-sequence loop: K/V are
    gathered in block layout [B, nb, Hkv, bs, D] and positions past seq_len are masked. Every
    row is padded to max_seqlen_k, so work and memory are B x max_seqlen_k: meant for rows of
    similar length, which is how `paged_decode_attention_grouped` calls it. With a window W
    each row gathers only the nb = 1 + cdiv(W - 1, bs) blocks (at most) from the one holding
    its first visible key, seq_len - W, so work is B x min(max_seqlen_k, W + bs).
    """
    b, hq, d = q.shape
    hkv, bs = k_cache.shape[1], k_cache.shape[2]
    group, nb = hq // hkv, -(-max_seqlen_k // bs)
    if sliding_window is None:
        flat = block_tables[:, :nb].reshape(-1).long()  # index_select: ~3x faster than k_cache[table] on CPU
        pos = torch.arange(nb * bs, device=q.device).view(1, nb, 1, 1, bs)
    else:
        nb = min(nb, 1 + -(-(sliding_window - 1) // bs))
        first = (seq_lens.long() - sliding_window).clamp(min=0) // bs  # [B] the block of the first key
        # columns past a short row's table are clamped to its last: positions >= seq_len, masked
        cols = (first[:, None] + torch.arange(nb, device=q.device)).clamp(max=block_tables.shape[1] - 1)
        flat = block_tables.long().gather(1, cols).reshape(-1)
        pos = ((first[:, None] + torch.arange(nb, device=q.device)) * bs).view(b, nb, 1, 1, 1)
        pos = pos + torch.arange(bs, device=q.device).view(1, 1, 1, 1, bs)
    k = dequantize_ref(take_blocks(k_cache, flat).view(b, nb, hkv, bs, d), k_scale)  # [B, nb, Hkv, bs, D]
    v = dequantize_ref(take_blocks(v_cache, flat).view(b, nb, hkv, bs, d), v_scale)
    scores = torch.matmul(q.float().view(b, 1, hkv, group, d), k.transpose(-1, -2)) * scale  # [B, nb, Hkv, G, bs]
    soft_cap_(scores, logits_soft_cap)
    lens = seq_lens.long().view(b, 1, 1, 1, 1)
    masked = pos >= lens if sliding_window is None else (pos >= lens) | (pos < lens - sliding_window)
    scores.masked_fill_(masked, float("-inf"))
    probs = torch.softmax(scores.permute(0, 2, 3, 1, 4).reshape(b, hkv, group, nb * bs), dim=-1)
    probs = probs.view(b, hkv, group, nb, bs).permute(0, 3, 1, 2, 4)  # [B, nb, Hkv, G, bs]
    return torch.matmul(probs, v).sum(1).reshape(b, hq, d).to(q.dtype)


PAD_BUDGET = 1 << 18
"""K and V elements of padding that one group of decode rows may carry (1 MiB in float32),
against the fixed cost of one more group (~0.2-0.3 ms on CPU). `benchmarks/cpu_attention.py
--budget-sweep` times 2^16..2^20 on batches of similar, two and spread lengths: within that
range no choice wins everywhere and the differences are near the shared machine's noise, while
one padded call for the whole batch is up to 2-30x slower (benchmarks/results/cpu-attention.json)."""


def decode_groups(seq_lens: list[int], block_size: int, budget_blocks: int) -> list[list[int]]:
    """Rows of a decode batch in groups of similar length; rows with no context are left out.

    A group is padded to its longest row, so its padding is the sum over its rows of
    (longest - own) blocks. Longest rows first, a row joins the current group while that sum
    stays within budget_blocks, else it starts the next group. A batch whose whole padding fits
    is one group in batch order.
    """
    nb = [-(-n // block_size) for n in seq_lens]
    if nb and min(nb) > 0 and len(nb) * max(nb) - sum(nb) <= budget_blocks:
        return [list(range(len(nb)))]
    groups: list[list[int]] = []
    top = waste = 0
    for i in sorted((i for i, n in enumerate(nb) if n > 0), key=lambda i: -nb[i]):
        if groups and waste + top - nb[i] <= budget_blocks:
            groups[-1].append(i)
            waste += top - nb[i]
        else:
            groups.append([i])
            top, waste = nb[i], 0
    return groups


def paged_decode_attention_grouped(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    pad_budget: int = PAD_BUDGET,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Decode (one query per sequence) without padding every sequence to the batch's longest.

    The rows are split by `decode_groups` and each group runs `paged_decode_attention_ref`
    padded to its own longest row, so work and memory follow the context each sequence has
    (plus at most pad_budget K/V elements of padding per group), not batch x longest context.
    Padded positions are read and given probability exactly 0, so every block a table names
    must hold finite values (the KV tensor starts zeroed); they add exact zeros, and a row gets
    the same bits when a long sequence joins its step (tests/ops/test_attention_ref.py).
    Rows with seq_len 0 get zeros, as in `paged_attention_ref`. With a window, rows are grouped
    by the blocks their window spans (at most 1 + cdiv(W - 1, bs) each), not by their context.
    """
    hkv, bs, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    lens = seq_lens.tolist()
    # the positions each row gathers, from the start of the block of its first visible key
    spans = lens if sliding_window is None else [n - window_start(n - 1, sliding_window) // bs * bs for n in lens]
    groups = decode_groups(spans, bs, max(1, pad_budget // (2 * hkv * bs * d)))
    if len(groups) == 1 and len(groups[0]) == len(lens):  # the common case: no copies in or out
        return paged_decode_attention_ref(
            q,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            max(lens),
            scale,
            k_scale,
            v_scale,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
        )
    out = torch.zeros_like(q)
    for rows in groups:
        idx = torch.tensor(rows, device=q.device)
        part = paged_decode_attention_ref(
            q.index_select(0, idx),
            k_cache,
            v_cache,
            block_tables.index_select(0, idx),
            seq_lens.index_select(0, idx),
            max(lens[i] for i in rows),  # windowed or not, bounds every row's blocks
            scale,
            k_scale,
            v_scale,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
        )
        out.index_copy_(0, idx, part)
    return out


def paged_attention_grouped(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """`paged_attention_ref`'s contract, with the decode rows (one new token) of a mixed batch
    batched by `paged_decode_attention_grouped`; longer rows run one at a time, as there."""
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    out = torch.empty_like(q)
    decode = [b for b in range(len(lens)) if cu[b + 1] - cu[b] == 1]
    if decode:
        rows = torch.tensor(decode, device=q.device)
        tokens = torch.tensor([cu[b] for b in decode], device=q.device)
        part = paged_decode_attention_grouped(
            q.index_select(0, tokens),
            k_cache,
            v_cache,
            block_tables.index_select(0, rows),
            seq_lens.index_select(0, rows),
            scale,
            k_scale,
            v_scale,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
        )
        out.index_copy_(0, tokens, part)
    for b, seq_len in enumerate(lens):
        start, end = cu[b], cu[b + 1]
        if end - start > 1:
            out[start:end] = _attend_one(
                q[start:end],
                k_cache,
                v_cache,
                block_tables[b],
                seq_len,
                scale,
                k_scale,
                v_scale,
                sliding_window=sliding_window,
                logits_soft_cap=logits_soft_cap,
            )
    return out
